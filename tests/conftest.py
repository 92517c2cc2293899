"""Session-wide settings for the tests (inherited by every rank and launcher they start)."""

import os

# The tests' models are tiny, and by default weights that small keep autograd's path (the fused
# weight gradients, weight_grad.py, pay off on large weights only). The tests fuse every weight,
# so that the fused path is exercised together with every feature; test_weight_grad.py checks
# the default threshold itself.
os.environ.setdefault("SMSHIM_FUSED_WGRAD_MIN_NUMEL", "0")

# Checkpoints are signed with a per-user key created on first save in the user's config
# directory (checkpointing/signing.py): the tests use a throw-away one, never the developer's.
if "XDG_CONFIG_HOME" not in os.environ:
    import tempfile

    os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="smshim-tests-config-")
os.environ.pop("SMSHIM_CHECKPOINT_KEY", None)
