"""SMP v2 (`import torch.sagemaker as tsm`) on plain torch.distributed: placeholder, owned by the
SMP v2 core work (tsm.init, tsm.state, FSDP patches); `transform/` holds tsm.transform's engine."""
