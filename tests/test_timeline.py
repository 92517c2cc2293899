"""The pipeline timeline recorder (SMSHIM_TRACE) and the plot script."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from smshim.timeline import recorder as tl_mod
from smshim.timeline.recorder import Timeline, from_env

REPO = Path(__file__).resolve().parent.parent


def _load(path):
    with open(path) as f:
        doc = json.load(f)
    assert set(doc) >= {"traceEvents", "displayTimeUnit"} and doc["displayTimeUnit"] == "ms"
    return doc["traceEvents"]


def _record_pipeline(tl, n_mb=4, step=0, threaded=True):
    """Spans as the engine records them: one worker thread per microbatch plus waits."""
    def worker(mb):
        with tl.span("wait", "wait", module="main", microbatch=mb, step=step):
            time.sleep(0.001)
        with tl.span("fwd", "forward", module="main", microbatch=mb, step=step):
            time.sleep(0.002)
        with tl.span("bwd", "backward", module="main", microbatch=mb, step=step):
            time.sleep(0.003)

    if threaded:
        threads = [threading.Thread(target=worker, args=(mb,), name=f"mb-worker-{mb}") for mb in range(n_mb)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for mb in range(n_mb):
            worker(mb)


def test_spans_from_several_threads_make_a_valid_chrome_trace(tmp_path):
    tl = Timeline(3, str(tmp_path))
    with tl.span("main-span", "forward", module="root", microbatch=0, step=7):
        time.sleep(0.001)
    tl.instant("marker", "sched", step=7)
    _record_pipeline(tl, n_mb=4)
    path = tl.flush()
    assert path == str(tmp_path / "trace_rank3.json")
    events = _load(path)

    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 1 + 4 * 3
    for e in spans:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert e["pid"] == 3
        assert e["dur"] >= 0
    fwd = [e for e in spans if e["cat"] == "forward" and e["args"]["module"] == "main"]
    assert sorted(e["args"]["microbatch"] for e in fwd) == [0, 1, 2, 3]
    assert all(e["args"]["step"] == 0 for e in fwd)
    # Durations are in microseconds: the 2 ms sleeps show up as >= 2000.
    assert all(e["dur"] >= 2000 for e in fwd)
    # A span's events in one thread are ordered and do not overlap.
    for mb in range(4):
        mine = sorted((e for e in spans if e["args"].get("microbatch") == mb and e["args"].get("module") == "main"),
                      key=lambda e: e["ts"])
        assert [e["cat"] for e in mine] == ["wait", "forward", "backward"]
        assert len({e["tid"] for e in mine}) == 1
        for a, b in zip(mine, mine[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3

    # One lane per thread, each labelled by a thread_name metadata event.
    lanes = {e["tid"] for e in spans}
    assert len(lanes) == 5  # the main thread + 4 workers
    assert all(isinstance(t, int) and 0 <= t < 5 for t in lanes)
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(names) == lanes
    assert {names[e["tid"]] for e in fwd} == {f"mb-worker-{mb}" for mb in range(4)}
    assert any(e["ph"] == "M" and e["name"] == "process_name" and e["pid"] == 3 for e in events)

    inst = [e for e in events if e["ph"] == "i"]
    assert len(inst) == 1 and inst[0]["name"] == "marker" and inst[0]["s"] == "t"


def test_lanes_are_reused_by_threads_with_the_same_name(tmp_path):
    tl = Timeline(0, str(tmp_path))
    for step in range(3):  # the engine may re-create its workers every step under the same names
        _record_pipeline(tl, n_mb=2, step=step)
    events = _load(tl.flush())
    lanes = {e["tid"] for e in events if e["ph"] == "X"}
    assert len(lanes) == 2

    # Two live threads sharing a name still get separate lanes (overlapping spans never share one).
    tl2 = Timeline(1, str(tmp_path))
    barrier = threading.Barrier(2)

    def work():
        with tl2.span("s", "forward"):
            barrier.wait()

    threads = [threading.Thread(target=work, name="same") for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = _load(tl2.flush())
    assert len({e["tid"] for e in events if e["ph"] == "X"}) == 2


def test_span_records_even_when_the_body_raises(tmp_path):
    tl = Timeline(0, str(tmp_path))
    with pytest.raises(KeyError):
        with tl.span("boom", "forward", microbatch=1):
            raise KeyError("x")
    (e,) = [e for e in _load(tl.flush()) if e["ph"] == "X"]
    assert e["args"] == {"microbatch": 1, "error": "KeyError"}


def test_flush_appends_and_rewrites(tmp_path):
    tl = Timeline(0, str(tmp_path))
    with tl.span("a", "forward"):
        pass
    assert len([e for e in _load(tl.flush()) if e["ph"] == "X"]) == 1
    with tl.span("b", "backward"):
        pass
    events = [e for e in _load(tl.flush()) if e["ph"] == "X"]
    assert [e["name"] for e in events] == ["a", "b"]
    # Non-JSON argument values are written as strings rather than failing the flush.
    with tl.span("c", "forward", shape=object()):
        pass
    assert any(e["name"] == "c" for e in _load(tl.flush()))


def test_memory_is_capped(tmp_path):
    tl = Timeline(0, str(tmp_path), max_events=10)
    for i in range(25):
        tl.instant(f"e{i}", "sched")
    doc = json.loads(Path(tl.flush()).read_text())
    kept = [e["name"] for e in doc["traceEvents"] if e["ph"] == "i"]
    assert kept == [f"e{i}" for i in range(15, 25)]
    assert doc["otherData"]["dropped_events"] == 15
    # Thread labels are not subject to the cap.
    assert any(e["ph"] == "M" and e["name"] == "thread_name" for e in doc["traceEvents"])


def test_timestamps_share_the_monotonic_clock(tmp_path):
    before = time.perf_counter_ns() / 1000.0
    tl = Timeline(0, str(tmp_path))
    with tl.span("a", "forward"):
        pass
    after = time.perf_counter_ns() / 1000.0
    (e,) = [e for e in _load(tl.flush()) if e["ph"] == "X"]
    assert before <= e["ts"] <= e["ts"] + e["dur"] <= after


def test_disabled_timeline_writes_nothing(tmp_path, monkeypatch):
    tl = Timeline(0, None)
    assert not tl.enabled
    cm1, cm2 = tl.span("a", "forward", microbatch=1), tl.span("b", "backward")
    assert cm1 is cm2  # one shared no-op object: no allocation per span
    with cm1:
        with cm2:  # re-entrant
            pass
    tl.instant("x", "y")
    assert tl.flush() is None
    assert tl.events() == []

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(tl_mod.TRACE_ENV, raising=False)
    assert not from_env(0).enabled
    monkeypatch.setenv(tl_mod.TRACE_ENV, "")
    assert not from_env(0).enabled
    assert list(tmp_path.iterdir()) == []

    monkeypatch.setenv(tl_mod.TRACE_ENV, str(tmp_path / "traces"))
    t = from_env(5)
    assert t.enabled and t.rank == 5
    with t.span("a", "forward"):
        pass
    assert Path(t.flush()) == tmp_path / "traces" / "trace_rank5.json"


def test_flush_is_atomic_under_concurrent_reads(tmp_path):
    tl = Timeline(0, str(tmp_path))
    path = tmp_path / "trace_rank0.json"
    stop = threading.Event()
    errors = []

    def writer():
        i = 0
        while not stop.is_set():
            for _ in range(200):
                with tl.span(f"s{i}", "forward", microbatch=i, step=0):
                    pass
                i += 1
            tl.flush()

    def reader():
        reads = 0
        while not stop.is_set() or reads == 0:
            if path.exists():
                try:
                    _load(path)  # must never see a half-written file
                    reads += 1
                except Exception as e:  # noqa: BLE001 - collected and asserted below
                    errors.append(e)
                    return

    threads = [threading.Thread(target=writer, name="w1"), threading.Thread(target=writer, name="w2"),
               threading.Thread(target=reader, name="r")]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    # No temporary files are left behind.
    assert [p.name for p in tmp_path.iterdir()] == ["trace_rank0.json"]
    tl.flush()
    spans = [e for e in _load(path) if e["ph"] == "X"]
    assert len(spans) >= 400


def test_atexit_flush_writes_unflushed_events(tmp_path):
    code = (
        "from smshim.timeline.recorder import from_env\n"
        "tl = from_env(2)\n"
        "with tl.span('a', 'forward', microbatch=0, step=0):\n"
        "    pass\n"
    )
    env = dict(os.environ, SMSHIM_TRACE=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120, cwd=REPO)
    events = _load(tmp_path / "trace_rank2.json")
    assert [e["name"] for e in events if e["ph"] == "X"] == ["a"]


def test_plot_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    trace_dir = tmp_path / "trace"
    for rank in range(2):
        tl = Timeline(rank, str(trace_dir))
        for step in range(2):
            _record_pipeline(tl, n_mb=3, step=step, threaded=False)
        tl.flush()
    out = tmp_path / "timeline.png"
    r = subprocess.run(
        [sys.executable, "-m", "smshim", "timeline", str(trace_dir), "-o", str(out), "--step", "1"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2 rank(s), 18 span(s)" in r.stderr  # 2 ranks x 3 microbatches x (wait, fwd, bwd) of step 1

    # A step with no spans and a directory without traces are clear errors, not empty plots.
    r = subprocess.run([sys.executable, "-m", "smshim", "timeline", str(trace_dir),
                        "-o", str(tmp_path / "x.png"), "--step", "9"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no forward/backward/wait spans" in r.stderr
    r = subprocess.run([sys.executable, "-m", "smshim", "timeline", str(tmp_path / "none"),
                        "-o", str(tmp_path / "x.png")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no trace_rank" in r.stderr


def test_legend_names_every_colour_drawn():
    from smshim.timeline.plot import COLOURS, DRAWN, LEGEND

    assert set(LEGEND) == set(DRAWN) == set(COLOURS)
    assert "transfer" in LEGEND
