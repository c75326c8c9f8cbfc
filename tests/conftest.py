"""The multi-process harness shared by the tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# The suite tests the CPU paths, whose worlds of 2-4 workers would each need a GPU per worker on
# a machine with GPUs: there they are hidden, unless DISTML_TEST_CUDA=1 asks for the CUDA tests
# (tests/parallel/test_cuda.py). Set before anything initialises CUDA, which reads it once.
CUDA_TESTS = os.environ.get("DISTML_TEST_CUDA") == "1"
if not CUDA_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPTS = Path(__file__).resolve().parent / "launch" / "scripts"


def distml_cli(*args: str, timeout: float = 240, cwd: Path | None = None, **popen):
    """Run ``python -m distml ARGS`` and return the CompletedProcess (text, captured)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "distml", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
        **popen,
    )


HELPERS = ("resource_tracker", "forkserver")


def _is_multiprocessing_helper(pid: int) -> bool:
    # Python's multiprocessing keeps one resource tracker and one fork server (distml.launch's
    # workers fork from it) per parent until it exits.
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return any(f"multiprocessing.{name}".encode() in cmdline for name in HELPERS)


def child_pids(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (read from /proc); zombies and multiprocessing's resource
    tracker and fork server excluded."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] == "Z":
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return [p for p in out if not _is_multiprocessing_helper(p)]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield
