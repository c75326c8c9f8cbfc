"""A node's place in a Slurm job step, read from the environment ``srun`` gives each task.

Under ``srun``, ``distml run --nproc 8 train.py`` is the whole line: the node count is
``SLURM_JOB_NUM_NODES`` (``SLURM_NNODES`` in a step of fewer nodes), this node's rank
``SLURM_NODEID``, and the rendezvous runs on the first host of ``SLURM_JOB_NODELIST``, at
``MASTER_PORT`` if set and torchrun's default port 29400 otherwise. Flags given on the command
line still win.

Slurm writes node lists in a compact form, ``gpu[01-03,07],login-a[1-2]b[3-4]``, which
``scontrol show hostnames`` expands; this module expands it itself, so that it needs no Slurm
command on the node: a name is a prefix, bracketed ranges and text between them; each bracket
group multiplies the names (``a[1-2]b[3-4]`` is four hosts), and a range keeps the zero-padding of
its lower bound (``[08-11]`` is 08, 09, 10, 11).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

from distml.config import ConfigError

RDZV_PORT = 29400  # torchrun's default port for the c10d rendezvous
MAX_RANGE = 100_000  # hosts in one bracketed range: more is a malformed list, not a cluster
_PIECE = re.compile(r"\[([^\[\]]*)\]|([^\[\]]+)")


def expand_hostlist(text: str) -> list[str]:
    """Every host of a Slurm node list, in order: ``"n[1-3],m"`` -> n1, n2, n3, m."""
    hosts: list[str] = []
    for name in _split_top_level(text.strip()):
        choices = []
        position = 0
        for match in _PIECE.finditer(name):
            if match.start() != position:
                break
            group, literal = match.groups()
            choices.append([literal] if literal is not None else _expand_ranges(group, text))
            position = match.end()
        if position != len(name) or not name:
            raise ConfigError(f"SLURM_JOB_NODELIST {text!r}: cannot read {name!r}")
        hosts += ["".join(parts) for parts in itertools.product(*choices)]
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    names, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ConfigError(f"SLURM_JOB_NODELIST {text!r}: unbalanced brackets")
        if char == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"SLURM_JOB_NODELIST {text!r}: unbalanced brackets")
    return [*names, text[start:]]


def _expand_ranges(group: str, text: str) -> list[str]:
    """``"01-03,7"`` -> 01, 02, 03, 7."""
    out = []
    for item in group.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ConfigError(f"SLURM_JOB_NODELIST {text!r}: cannot read the range {item!r}")
        low, high = m.group(1), m.group(2) or m.group(1)
        if int(high) - int(low) > MAX_RANGE:
            raise ConfigError(f"SLURM_JOB_NODELIST {text!r}: the range {item!r} is too long")
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def slurm_settings(environ: Mapping[str, str]) -> list[tuple[str, Any]]:
    """The run settings a task of a Slurm job step implies (dotted key, value), or none outside
    ``srun`` or in a job of one node."""
    if "SLURM_NODEID" not in environ or "SLURM_JOB_NODELIST" not in environ:
        return []
    nodes_text = environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or "1"
    if not nodes_text.isdigit() or not environ["SLURM_NODEID"].isdigit():
        raise ConfigError(
            f"SLURM_NNODES/SLURM_JOB_NUM_NODES {nodes_text!r} and SLURM_NODEID "
            f"{environ['SLURM_NODEID']!r} must be numbers"
        )
    nodes = int(nodes_text)
    if nodes == 1:
        return []
    first = expand_hostlist(environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"])[0]
    port = environ.get("MASTER_PORT") or str(RDZV_PORT)
    settings: list[tuple[str, Any]] = [
        ("min_nodes", nodes),
        ("max_nodes", nodes),
        ("node_rank", int(environ["SLURM_NODEID"])),
        ("rdzv_endpoint", f"{first}:{port}"),
    ]
    if environ.get("SLURM_JOB_ID"):  # one id for every node of the job, as the rendezvous needs
        settings.append(("rdzv_id", f"slurm-{environ['SLURM_JOB_ID']}"))
    return settings
