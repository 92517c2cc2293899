"""Draw the pipeline timeline written with ``SMSHIM_TRACE=<dir>`` as a PNG.

    python benchmarks/plot_timeline.py DIR -o timeline.png [--step N]

One row per rank; a bar per forward (blue) / backward (orange) span with its microbatch number
written in it where it fits, weight gradients computed in the bubbles (purple); sends (green) and
waits (light grey) behind them. The x axis is milliseconds from the
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


def load_spans(directory: str, step: Optional[int] = None) -> Dict[int, List[Dict[str, Any]]]:
    """rank -> complete ("X") events of the drawn categories, optionally only those of ``step``."""
    paths = sorted(glob.glob(os.path.join(directory, "trace_rank*.json")))
    if not paths:
        raise SystemExit(f"no trace_rank*.json files in {directory!r} (was SMSHIM_TRACE set to it?)")
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
        raise SystemExit("plot_timeline.py needs matplotlib: pip install matplotlib "
                         "(or pip install 'smshim[examples]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    all_spans = [e for s in spans.values() for e in s]
    if not all_spans:
        raise SystemExit("no forward/backward/wait spans to draw (wrong --step?)")
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
                       for c in ("forward", "backward", "weight_grad", "wait")],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", help="directory given as SMSHIM_TRACE (holds trace_rank*.json)")
    p.add_argument("-o", "--output", default="timeline.png", help="PNG to write (default timeline.png)")
    p.add_argument("--step", type=int, default=None, help="only draw spans whose args.step equals N")
    a = p.parse_args(argv)
    spans = load_spans(a.directory, a.step)
    title = f"smshim pipeline timeline, step {a.step}" if a.step is not None else None
    plot(spans, a.output, title)
    n = sum(len(s) for s in spans.values())
    sys.stderr.write(f"wrote {a.output}: {len(spans)} rank(s), {n} span(s)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
