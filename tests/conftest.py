"""Session-wide settings for the tests (inherited by every rank and launcher they start)."""

import os

# The tests' models are tiny, and by default weights that small keep autograd's path (the fused
# weight gradients, weight_grad.py, pay off on large weights only). The tests fuse every weight,
# so that the fused path is exercised together with every feature; test_weight_grad.py checks
# the default threshold itself.
os.environ.setdefault("SMSHIM_FUSED_WGRAD_MIN_NUMEL", "0")
