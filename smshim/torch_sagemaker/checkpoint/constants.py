"""Keys that mark what a checkpoint state dict holds (imported by HyperPod's adapter)."""

SMP_IS_LOAD_INFO_KEY = "smp_is_load_info"
SMP_IS_PARTIAL_KEY = "smp_is_partial"
