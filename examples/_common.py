"""Helpers shared by the examples: progress output, output directory, plots, the digits data set
and the small CNN of the two MNIST-style examples.

Nothing here is smshim-specific: the examples are ordinary SageMaker training scripts, and this
module is the kind of utility file such scripts ship next to them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from typing import Dict, Optional, Sequence, TextIO, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))


def log(msg: str) -> None:
    """One line on stdout, flushed at once (the launcher interleaves several processes' output)."""
    print(msg, flush=True)


def output_dir(requested: Optional[str]) -> str:
    """--out-dir if given, else the parent of SM_MODEL_DIR (a SageMaker job's output), else
    ./smshim_output/."""
    if requested:
        path = requested
    elif os.environ.get("SM_MODEL_DIR"):
        path = os.path.dirname(os.path.abspath(os.environ["SM_MODEL_DIR"]))
    else:
        path = "smshim_output"
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    return path


def human(n: float) -> str:
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.1f}T"


class Progress:
    """Per-step training progress: a `\\r` bar on a terminal, one plain line per step otherwise."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO = sys.stdout) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream
        self.tty = enabled and stream.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, loss: float, step_s: float, samples: int,
               tokens: Optional[int] = None) -> None:
        if not self.enabled:
            return
        rate = f"{samples / step_s:7.1f} samples/s"
        if tokens is not None:
            rate += f" {human(tokens / step_s):>7} tokens/s"
        stats = f"step {step + 1:>{len(str(self.total))}}/{self.total}  loss {loss:.4f}  " \
                f"{1e3 * step_s:6.1f} ms/step  {rate}"
        if self.tty:
            width = 24
            done = int(width * (step + 1) / self.total)
            self.stream.write(f"\r[{'#' * done}{'.' * (width - done)}] {stats}")
        else:
            self.stream.write(stats + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ---- plots (matplotlib is optional: the `examples` extra installs it) ---------------------------

def have_matplotlib(what: str) -> bool:
    if importlib.util.find_spec("matplotlib") is None:
        log(f"matplotlib is not installed: skipping {what} (pip install 'smshim[examples]')")
        return False
    return True


def plot_curve(values: Sequence[float], path: str, title: str, ylabel: str = "loss") -> bool:
    """A line plot of `values` against the step number, written to `path` (PNG)."""
    if not have_matplotlib(os.path.basename(path)):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(values) + 1), values, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, loc="left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_timeline(trace_dir: str, path: str, step: int) -> bool:
    """Draw one step of a SMSHIM_TRACE directory (what `smshim timeline` draws)."""
    if not have_matplotlib(os.path.basename(path)):
        return False
    from smshim.timeline.plot import draw

    draw(trace_dir, path, step, title=f"pipeline timeline, step {step}")
    return True


# ---- the digits data set and a small CNN (the two MNIST-style examples) ------------------------

def load_digits_split(test_fraction: float = 0.2, seed: int = 0,
                      limit: Optional[int] = None) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped with the package: no
    download), scaled to [0, 1], shuffled with `seed` and split into train/test."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("this example needs scikit-learn: pip install scikit-learn "
                         "(or pip install 'smshim[examples]')") from None
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # N x 1 x 8 x 8
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    if limit is not None:
        perm = perm[:limit]
    x, y = x[perm], y[perm]
    n_test = int(len(x) * test_fraction)
    return {"train": (x[n_test:], y[n_test:]), "test": (x[:n_test], y[:n_test])}


def loaders(data: Dict[str, Tuple[torch.Tensor, torch.Tensor]], batch_size: int, test_batch_size: int,
            replicas: int, rank: int, seed: int = 0):
    """Train and test DataLoaders over this replica's shard (DistributedSampler). drop_last
    everywhere: every replica must run the same number of steps, and with model parallelism each
    batch must split evenly into microbatches."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    out = []
    for split, bs, shuffle in (("train", batch_size, True), ("test", test_batch_size, False)):
        ds = TensorDataset(*data[split])
        sampler = DistributedSampler(ds, num_replicas=replicas, rank=rank, shuffle=shuffle,
                                     seed=seed, drop_last=True)
        out.append(DataLoader(ds, batch_size=bs, sampler=sampler, drop_last=True))
    return out


class DigitsCNN(nn.Module):
    """Two conv layers and a two-layer classifier for 8x8 digits (log-probabilities out)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout(torch.flatten(x, 1))
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)
