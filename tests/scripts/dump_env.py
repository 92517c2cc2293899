"""Used by the launcher tests: record what the launched process sees (env and argv)."""
import json
import os
import sys

keys = [k for k in os.environ if k.startswith(("SM_", "SMDATAPARALLEL_", "RANK", "WORLD_SIZE",
                                                "LOCAL_RANK", "MASTER_", "OMP_NUM_THREADS"))]
out = os.environ["DUMP_DIR"]
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"env": {k: os.environ[k] for k in keys}, "argv": sys.argv[1:]}, f)
if os.environ.get("FAIL_ON_RANK") == os.environ["RANK"]:
    raise SystemExit("worker fails on purpose")
