"""A torchrun script that decides by its restart count: rank 1 fails on the first attempt only,
as a script that injects one fault does. Every rank writes the torchrun variables it was given,
one JSON file per attempt, under OUT."""

import json
import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
seen = {k: v for k, v in os.environ.items() if k.startswith("TORCHELASTIC_") or k in (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)}  # fmt: skip
attempt = seen["TORCHELASTIC_RESTART_COUNT"]
path = out / f"env-{seen['RANK']}-{attempt}.json"
path.with_suffix(".tmp").write_text(json.dumps(seen))
path.with_suffix(".tmp").replace(path)  # whole, before a launcher may stop this worker
if seen["RANK"] == "1" and attempt == "0":
    # The launcher stops every worker when one fails: fail once the others have written theirs.
    world = int(seen["WORLD_SIZE"])
    deadline = time.monotonic() + 120
    while len(list(out.glob("env-*-0.json"))) < world and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(3)  # the injected fault
