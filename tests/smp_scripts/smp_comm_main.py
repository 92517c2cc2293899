"""Run the smp object-communication checks under a launcher (mpirun, torchrun); each rank writes
its summary to `<SMP_RESULT_DIR>/rank<k>.json` (ranks share stdout, whose lines can interleave).
argv[1], if given, is the smp.init config (JSON), used when smp did not initialise on import."""

import json
import os
import sys

from comm_checks import check_all

if __name__ == "__main__":
    config = json.loads(sys.argv[1]) if len(sys.argv) > 1 else None
    summary = check_all(config)
    path = os.path.join(os.environ["SMP_RESULT_DIR"], f"rank{summary['rank']}.json")
    with open(path, "w") as f:
        json.dump(summary, f)
