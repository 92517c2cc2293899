"""Helper modules for tests/test_usage_patterns.py, imported inside the spawned ranks."""
