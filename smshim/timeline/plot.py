"""Draw the pipeline timeline written with ``SMSHIM_TRACE=<dir>`` as a PNG.

    smshim timeline DIR -o timeline.png [--step N]      (or, from Python, `draw(DIR, PNG, step)`)

One row per rank; a bar per forward (blue) / backward (orange) span with its microbatch number
written in it where it fits, weight gradients computed in the bubbles (purple); frames on the
wire (green, "transfer") and waits (light grey) behind them. The x axis is milliseconds from the
first span shown (ranks on one host share a clock, so their rows line up).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Any, Dict, List, Optional

COLOURS = {"forward": "#1f77b4", "backward": "#ff7f0e", "weight_grad": "#9467bd", "wait": "#d9d9d9",
           "transfer": "#2ca02c"}
# Drawing order: waits underneath.
DRAWN = ("wait", "transfer", "forward", "backward", "weight_grad")
# Legend order: every colour drawn, work first.
LEGEND = ("forward", "backward", "weight_grad", "transfer", "wait")
assert set(LEGEND) == set(DRAWN) == set(COLOURS)


class TimelineError(ValueError):
    """Nothing to draw: no trace files, or no spans for the step asked for."""


def load_spans(directory: str, step: Optional[int] = None) -> Dict[int, List[Dict[str, Any]]]:
    """rank -> complete ("X") events of the drawn categories, optionally only those of ``step``."""
    paths = sorted(glob.glob(os.path.join(directory, "trace_rank*.json")))
    if not paths:
        raise TimelineError(f"no trace_rank*.json files in {directory!r} (was SMSHIM_TRACE set to it?)")
    spans: Dict[int, List[Dict[str, Any]]] = {}
    for path in paths:
        m = re.search(r"trace_rank(\d+)\.json$", path)
        if m is None:
            continue
        with open(path) as f:
            doc = json.load(f)
        events = doc["traceEvents"] if isinstance(doc, dict) else doc
        rank_spans = spans.setdefault(int(m.group(1)), [])
        for e in events:
            if e.get("ph") != "X" or e.get("cat") not in DRAWN:
                continue
            if step is not None and (e.get("args") or {}).get("step") != step:
                continue
            rank_spans.append(e)
    return spans


def plot(spans: Dict[int, List[Dict[str, Any]]], out: str, title: Optional[str] = None) -> None:
    try:
        import matplotlib
    except ImportError:
        raise TimelineError("drawing a timeline needs matplotlib: pip install matplotlib "
                            "(or pip install 'smshim[examples]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    all_spans = [e for s in spans.values() for e in s]
    if not all_spans:
        raise TimelineError("no forward/backward/wait spans to draw (wrong --step?)")
    t0 = min(e["ts"] for e in all_spans)
    t1 = max(e["ts"] + e["dur"] for e in all_spans)
    total_ms = max((t1 - t0) / 1000.0, 1e-6)
    ranks = sorted(spans)

    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * len(ranks)))
    for row, rank in enumerate(ranks):
        for cat in DRAWN:
            events = [e for e in spans[rank] if e["cat"] == cat]
            if not events:
                continue
            xranges = [((e["ts"] - t0) / 1000.0, e["dur"] / 1000.0) for e in events]
            h = 0.8 if cat != "wait" else 0.5
            # One broken_barh per (rank, category) keeps big traces (100k+ spans) quick to draw.
            ax.broken_barh(xranges, (row - h / 2, h), facecolors=COLOURS[cat],
                           edgecolors="white" if cat != "wait" else "none", linewidth=0.4)
            if cat == "wait":
                continue
            for (x, w), e in zip(xranges, events):
                mb = (e.get("args") or {}).get("microbatch")
                # ~1.2 % of the axis per character is roughly what a small label needs at this width.
                if mb is not None and w / total_ms > 0.012 * len(str(mb)):
                    ax.text(x + w / 2, row, str(mb), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, total_ms)
    ax.set_xlabel("time (ms)")
    ax.set_title(title or "smshim pipeline timeline", loc="left")
    # Legend above the axes, beside the title, so it never hides a bar.
    ax.legend(handles=[Patch(color=COLOURS[c], label=c.replace("_", " "))
                       for c in LEGEND],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncol=len(LEGEND), frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def draw(directory: str, out: str, step: Optional[int] = None,
         title: Optional[str] = None) -> int:
    """Draw the traces in `directory` (one step, or all) to the PNG `out`; returns the number of
    spans drawn. Raises TimelineError when there is nothing to draw."""
    spans = load_spans(directory, step)
    if title is None and step is not None:
        title = f"smshim pipeline timeline, step {step}"
    plot(spans, out, title)
    return sum(len(s) for s in spans.values())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`smshim timeline`'s arguments."""
    p.add_argument("directory", help="directory given as SMSHIM_TRACE (holds trace_rank*.json)")
    p.add_argument("-o", "--output", default="timeline.png", help="PNG to write (default timeline.png)")
    p.add_argument("--step", type=int, default=None, help="only draw spans whose args.step equals N")


def run(a: argparse.Namespace) -> int:
    try:
        n = draw(a.directory, a.output, a.step)
    except TimelineError as e:
        sys.stderr.write(f"smshim timeline: error: {e}\n")
        return 2
    ranks = len(glob.glob(os.path.join(a.directory, "trace_rank*.json")))
    sys.stderr.write(f"wrote {a.output}: {ranks} rank(s), {n} span(s)\n")
    return 0
