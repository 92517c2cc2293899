"""Trampoline each launched worker goes through: `python -m smshim.launcher.worker script args...`.

Sets the per-process variables a SageMaker container would (SMDATAPARALLEL_LOCAL_RANK, which
Hugging Face reads, from torchrun's LOCAL_RANK) and SMSHIM_WORKER (the start-up hook then destroys
the script's process groups at exit, as smp scripts get anyway), then replaces itself with
`python script args` so the script runs exactly as if started directly (its own __main__,
sys.path[0], argv).
"""

import os
import sys


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m smshim.launcher.worker script [args...]")
    # The script's start-up hook (smshim/_alias.py) tears its process groups down at exit.
    os.environ["SMSHIM_WORKER"] = "1"
    if "LOCAL_RANK" in os.environ:
        os.environ["SMDATAPARALLEL_LOCAL_RANK"] = os.environ["LOCAL_RANK"]
    if os.environ.get("SMSHIM_CPU") and "smshim._alias" not in sys.modules:
        # CPU mode is installed by the start-up hook (smshim_alias.pth) in the script's
        # interpreter; without it (smshim used from a source tree) nothing would be mapped.
        print("smshim: SMSHIM_CPU is set but smshim's start-up hook (smshim_alias.pth) is not "
              "installed, so CPU mode cannot apply: pip install smshim (or -e .)", file=sys.stderr)
    os.execv(sys.executable, [sys.executable, "-u", *sys.argv[1:]])


if __name__ == "__main__":
    main()
