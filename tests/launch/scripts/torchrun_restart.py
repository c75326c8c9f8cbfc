"""A torchrun script that decides by its restart count: rank 1 fails on the first attempt only,
as a script that injects one fault does. Every rank writes the torchrun variables it was given,
one JSON file per attempt, under OUT."""

import json
import os
import sys
from pathlib import Path

out = Path(sys.argv[1])
seen = {k: v for k, v in os.environ.items() if k.startswith("TORCHELASTIC_") or k in (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)}  # fmt: skip
attempt = seen["TORCHELASTIC_RESTART_COUNT"]
(out / f"env-{seen['RANK']}-{attempt}.json").write_text(json.dumps(seen))
if seen["RANK"] == "1" and attempt == "0":
    sys.exit(3)  # the injected fault
