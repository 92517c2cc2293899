"""Trampoline each launched worker goes through: `python -m smshim.launcher.worker script args...`.

Sets the per-process variables a SageMaker container would (SMDATAPARALLEL_LOCAL_RANK, which
Hugging Face reads, from torchrun's LOCAL_RANK), then replaces itself with `python script args`
so the script runs exactly as if started directly (its own __main__, sys.path[0], argv).
"""

import os
import sys


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m smshim.launcher.worker script [args...]")
    if "LOCAL_RANK" in os.environ:
        os.environ["SMDATAPARALLEL_LOCAL_RANK"] = os.environ["LOCAL_RANK"]
    os.execv(sys.executable, [sys.executable, "-u", *sys.argv[1:]])


if __name__ == "__main__":
    main()
