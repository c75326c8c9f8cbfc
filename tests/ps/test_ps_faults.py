"""Faults with real processes: a worker SIGKILLed mid-run, a shard SIGKILLed mid-run.
Nothing lost, nothing applied twice: under ASP and SSP every applied push is one version, so
the final version counts exactly the pushes the shard kept."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import child_pids, cmdline, distml_cli, wait_for

pytestmark = pytest.mark.distributed  # every test starts processes

SCRIPT = str(Path(__file__).parent / "scripts" / "ps_train.py")
TOKEN = "fault-test-token-0123456789"


def ps_run(tmp_path, name: str, *flags: str, steps: int, script_args=()) -> dict:
    result = distml_cli(
        "run", "--strategy", "ps", "--runs-dir", str(tmp_path), "--run-name", name, *flags,
        SCRIPT, str(steps), *script_args, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((tmp_path / name / "summary.json").read_text())


@pytest.mark.parametrize("consistency", ["asp", "ssp:1"])
def test_async_workers_carry_on_when_one_is_killed(tmp_path, consistency):
    steps = 30
    summary = ps_run(
        tmp_path, "lost", "--nproc", "3", "--consistency", consistency,
        "--config", str(_config(tmp_path, every=50, heartbeat_s=2.0)),
        steps=steps, script_args=["--kill", "2:5"],
    )  # fmt: skip
    ps = summary["ps"]
    assert ps["lost_workers"] == [2]
    assert [w["pushed"] for w in ps["workers"]] == [steps, steps, 5]
    assert [w["steps"] for w in ps["workers"]] == [steps, steps, 0]  # it wrote no records
    # Every push applied once: the two survivors' and the 5 the lost worker made.
    assert ps["versions"] == [2 * steps + 5]
    assert ps["shards"][0]["pushes"] == {"applied": 2 * steps + 5}


def test_bsp_drops_a_silent_worker_and_readmits_it_after_restart(tmp_path):
    steps = 40
    summary = ps_run(
        tmp_path, "readmit", "--nproc", "2", "--consistency", "bsp", "--max-restarts", "1",
        "--config", str(_config(tmp_path, every=50, heartbeat_s=1.0)),
        steps=steps, script_args=["--kill", "1:4", "--delay", "0.1"],
    )  # fmt: skip
    ps = summary["ps"]
    assert ps["worker_restarts"] == {"1": 1} and ps["lost_workers"] == []
    # The restarted worker resumed at its clock: 4 pushes before the kill, the other 36 after
    # (the killed incarnation left no step records).
    assert [w["pushed"] for w in ps["workers"]] == [steps, steps]
    assert [w["steps"] for w in ps["workers"]] == [steps, steps - 4]
    pushes = ps["shards"][0]["pushes"]
    assert pushes.get("accepted", 0) + pushes.get("dropped", 0) == 2 * steps
    assert "duplicate" not in pushes
    # Worker 0 went on alone while worker 1 was away, so there were more steps than either made.
    assert ps["versions"][0] > steps


def _shard_port(parent: int) -> int:
    for pid in child_pids(parent):
        cmd = cmdline(pid).split(b"\0")
        if b"serve" in cmd and b"--port" in cmd:
            return int(cmd[cmd.index(b"--port") + 1])
    raise LookupError("no shard process yet")


def _shard_pid(parent: int) -> int:
    for pid in child_pids(parent):
        if b"serve" in cmdline(pid).split(b"\0"):
            return pid
    raise LookupError("no shard process")


def test_a_killed_shard_restarts_from_its_snapshot_and_training_completes(tmp_path):
    steps, every = 60, 10
    env = {**os.environ, "DISTML_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(
        [sys.executable, "-m", "distml", "run", "--strategy", "ps", "--nproc", "2",
         "--consistency", "asp", "--runs-dir", str(tmp_path), "--run-name", "shard",
         "--config", str(_config(tmp_path, every)), SCRIPT, str(steps), "--delay", "0.05"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = None

        def version() -> int:
            nonlocal port
            try:
                port = port or _shard_port(job.pid)
                r = httpx.get(
                    f"http://127.0.0.1:{port}/v1/status",
                    headers={"Authorization": f"Bearer {TOKEN}"},
                    timeout=2,
                )
                return r.json()["version"]
            except (LookupError, httpx.HTTPError, ValueError, KeyError):
                return -1

        wait_for(lambda: version() >= 35, 120, "the shard to apply 35 pushes")
        os.kill(_shard_pid(job.pid), signal.SIGKILL)
        _, stderr = job.communicate(timeout=240)
    finally:
        job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert re.search(r"shard 0 exited \(-9\); restarting from its snapshot", stderr)
    summary = json.loads((tmp_path / "shard" / "summary.json").read_text())
    ps = summary["ps"]
    assert ps["server_restarts"] == {"shard 0": 1}
    restored = ps["shards"][0]["restored_version"]
    assert restored >= 35 - every  # a snapshot at most `every` versions before the kill
    # Each applied push is one version: what the final version lacks of all the pushes the
    # workers made is what the crash lost -- at most one snapshot interval.
    lost = 2 * steps - ps["versions"][0]
    print(f"shard restored at version {restored}; pushes lost to the crash: {lost}")
    assert 0 <= lost <= every
    assert [w["steps"] for w in ps["workers"]] == [steps, steps]


def _config(tmp_path: Path, every: int, heartbeat_s: float = 5.0) -> Path:
    path = tmp_path / "ps.toml"
    path.write_text(f"[ps]\nsnapshot_every = {every}\nheartbeat_timeout_s = {heartbeat_s}\n")
    return path
