"""Worker output of `smshim run`: stderr to per-rank files, shown live except tracebacks, and a
short failure summary.

torchrun's log machinery (`LogsSpecs`, the `--log-dir` / `--redirects` of torchrun) writes each
worker's stderr to `<log-dir>/<run id>_*/attempt_<k>/<local rank>/stderr.log`; stdout goes to the
terminal untouched. A tailer copies stderr lines to the terminal as they come (warnings, logging,
progress bars) but holds back Python tracebacks: with N ranks failing alike they would print N
times. When the job fails, `failure_summary` gives the first error once, from the lowest failing
rank, with the script's line that raised, one line for the other ranks, and the log files' paths.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from typing import Dict, Iterable, List, Optional, TextIO, Tuple

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

_TRACEBACK_START = ("Traceback (most recent call last):",
                    "During handling of the above exception, another exception occurred:",
                    "The above exception was the direct cause of the following exception:")


# torch.distributed's excepthook prefixes an uncaught exception's lines with "[rank<N>]: ".
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?", re.M)


class _Tail:
    """Copies one growing file to `dst` line by line, without the tracebacks in it."""

    def __init__(self, path: str, dst: TextIO, done: threading.Event) -> None:
        self._path, self._dst, self._done = path, dst, done
        self._in_traceback = self._after = False
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"tail {path}")
        self.thread.start()

    def _keep(self, line: str) -> bool:
        text = _RANK_PREFIX.sub("", line.rstrip("\n"))
        if text.startswith(_TRACEBACK_START):
            self._in_traceback, self._after = True, False
            return False
        if self._in_traceback:
            if text == "" or text.startswith((" ", "\t")):
                return False
            self._in_traceback, self._after = False, True  # the exception line ends it
            return False
        if self._after and text.strip() == "":
            return False  # the blank lines between chained tracebacks
        self._after = False
        return True

    def _run(self) -> None:
        while not os.path.exists(self._path):
            if self._done.wait(0.1):
                if not os.path.exists(self._path):
                    return
        with open(self._path, errors="replace") as f:
            partial = ""
            while True:
                got = f.readline()
                if got.endswith("\n"):
                    line, partial = partial + got, ""
                    self._copy(line)
                elif got:
                    # A line still being written (a traceback's caret line comes in pieces): its
                    # tail alone would look like the exception line that ends a traceback.
                    partial += got
                    self._done.wait(0.02)
                elif self._done.is_set():
                    if partial:
                        self._copy(partial)
                    return
                else:
                    self._done.wait(0.1)

    def _copy(self, line: str) -> None:
        if self._keep(line):
            self._dst.write(line)
            self._dst.flush()


class WorkerExits(logging.Filter):
    """Keeps torch's "failed (exitcode: N) local_rank: R ..." records (its multiprocessing
    logger) for smshim's own restart message, and lets nothing through to the terminal."""

    LOGGER = "torch.distributed.elastic.multiprocessing.api"

    def __init__(self) -> None:
        super().__init__()
        self.failed: List[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if msg.startswith("failed (exitcode"):
            self.failed.append(msg.split(" of binary")[0])
        return False

    def install(self) -> "WorkerExits":
        log = logging.getLogger(self.LOGGER)
        log.setLevel(logging.ERROR)  # records must be made for the filter to see them
        log.addFilter(self)
        return self

    def take(self) -> str:
        out, self.failed[:] = "; ".join(self.failed), []
        return out


class TailingLogsSpecs(DefaultLogsSpecs):
    """torch's DefaultLogsSpecs with stderr redirected to files, tailed to our stderr."""

    def __init__(self, log_dir: str, tee_all: bool = False) -> None:
        # tee_all: torchrun's `--tee 3`, every line of every rank (tracebacks included).
        super().__init__(log_dir=log_dir, redirects=Std.ERR, tee=Std.ERR if tee_all else Std.NONE)
        self._tee_all = tee_all
        self._done = threading.Event()
        self._tails: List[_Tail] = []
        self.attempt_dirs: List[str] = []
        self.exits = WorkerExits()

    def reify(self, envs):  # type: ignore[no-untyped-def]
        dest = super().reify(envs)
        if dest.stderrs and self.attempt_dirs:
            # A restart (--max-restarts): the failure's traceback went to the logs only.
            what = self.exits.take() or "a worker failed"
            print(f"smshim run: {what}; restarting the workers. The failed attempt's logs: "
                  f"{self.attempt_dirs[-1]}/<local rank>/stderr.log", file=sys.stderr, flush=True)
        if dest.stderrs:
            self.attempt_dirs.append(os.path.dirname(os.path.dirname(next(iter(dest.stderrs.values())))))
        if not self._tee_all:
            for path in dest.stderrs.values():
                self._tails.append(_Tail(path, sys.stderr, self._done))
        return dest

    def close(self) -> None:
        """Copy what is left and stop the tailers."""
        self._done.set()
        for t in self._tails:
            t.thread.join(timeout=5)


def _last_traceback(text: str) -> Optional[List[str]]:
    start = text.rfind("Traceback (most recent call last):")
    if start < 0:
        return None
    # A chained exception's final traceback is the last one; its exception line ends it.
    lines = text[start:].splitlines()
    out = [lines[0]]
    for line in lines[1:]:
        out.append(line)
        if line and not line.startswith((" ", "\t")):
            break
    return out


def describe(stderr_text: str, script: str) -> Tuple[str, Optional[str]]:
    """(the exception line, "<script>:<line>: <code>" of the deepest frame in the script)."""
    stderr_text = _RANK_PREFIX.sub("", stderr_text)
    tb = _last_traceback(stderr_text)
    if tb is None:
        tail = [line for line in stderr_text.splitlines() if line.strip()]
        return (tail[-1] if tail else ""), None
    where = None
    script_abs = os.path.abspath(script)
    for i, line in enumerate(tb):
        m = re.match(r'\s*File "(.+)", line (\d+), in (.+)$', line)
        if m and os.path.abspath(m.group(1)) == script_abs:
            code = tb[i + 1].strip() if i + 1 < len(tb) and tb[i + 1].startswith("    ") else ""
            where = f"{os.path.basename(script)} line {m.group(2)}: {code}"
    return tb[-1], where


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def failure_summary(failures: Dict[int, object], script: str, logs: Dict[int, str]) -> List[str]:
    """The lines to print for a failed job. `failures`: global rank -> torch's ProcessFailure;
    `logs`: global rank -> its stderr.log."""
    name = os.path.basename(script)
    # Ranks the agent stopped (SIGTERM) because another one failed are not failures of their own.
    stopped = sorted(r for r, f in failures.items() if getattr(f, "exitcode", None) == -15)
    if len(stopped) < len(failures):
        failures = {r: f for r, f in failures.items() if r not in stopped}
    else:
        stopped = []
    described = {}
    for rank, failure in failures.items():
        line, where = describe(_read(logs.get(rank, "")), script)
        if not line:
            code = getattr(failure, "exitcode", "?")
            sig = getattr(failure, "signal_name", lambda: "")()
            line = f"exited with code {code}" + (f" ({sig})" if sig and sig != "<N/A>" else "")
        described[rank] = (line, where)
    first = min(described)
    line, where = described[first]
    out = [f"{name} failed on rank {first}: {line}"]
    if where:
        out.append(f"  at {where}")
    same = [r for r in described if r != first and described[r][0] == line]
    if same:
        out.append(f"{_ranks(same)}: the same error")
    others = sorted(r for r in described if r != first and r not in same)
    for r in others[:3]:
        out.append(f"rank {r}: {described[r][0]}")
    if len(others) > 3:
        out.append(f"{_ranks(others[3:])}: other errors")
    if stopped:
        out.append(f"{_ranks(stopped)}: stopped by the launcher after that")
    dirs = sorted({os.path.dirname(os.path.dirname(p)) for p in logs.values() if p})
    for d in dirs:
        out.append(f"full tracebacks: {d}/<local rank>/stderr.log")
    return out
