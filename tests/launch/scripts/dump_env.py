"""Writes every variable torchrun's agent gives a worker, one JSON file per (attempt, rank):
OUT/env-<attempt>-<rank>.json, and one line to each of stdout and stderr. Rank 1 exits non-zero
on attempt 0 (unless given --no-fault), so that a launcher with ``--max-restarts 1`` restarts; no
process group is made, so nothing but the launcher is tested.

    torchrun --nproc-per-node 2 --max-restarts 1 dump_env.py OUT [--no-fault]
"""

import json
import os
import sys
import time
from pathlib import Path

# What torch's elastic agent sets (local_elastic_agent.py's _start_workers, the logs spec's
# error file) and torchrun's OMP_NUM_THREADS; any other TORCHELASTIC_* or TORCH_* is kept too.
NAMES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
)  # fmt: skip

out = Path(sys.argv[1])
seen = {
    k: v for k, v in os.environ.items() if k in NAMES or k.startswith(("TORCHELASTIC_", "TORCH_"))
}
attempt, rank = seen["TORCHELASTIC_RESTART_COUNT"], seen["RANK"]
path = out / f"env-{attempt}-{rank}.json"
path.with_suffix(".tmp").write_text(json.dumps(seen, sort_keys=True))
path.with_suffix(".tmp").replace(path)  # whole, before a launcher may stop this worker
print(f"stdout of rank {rank} attempt {attempt}", flush=True)
print(f"stderr of rank {rank} attempt {attempt}", file=sys.stderr, flush=True)
if rank == "1" and attempt == "0" and "--no-fault" not in sys.argv[2:]:
    # The launcher stops every worker when one fails: fail once rank 0 has written its own.
    deadline = time.monotonic() + 120
    while not (out / "env-0-0.json").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(3)
