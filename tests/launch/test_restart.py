"""Fault tolerance: a worker killed (SIGKILL) or hung (SIGSTOP) mid-run is restarted, and the job
ends with the parameters of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import EXAMPLES, SCRIPTS, child_pids, distml_cli, wait_for, worker_pids

pytestmark = pytest.mark.distributed  # every test starts processes

TORCHRUN_SCRIPT = SCRIPTS / "torchrun_ckpt.py"
DIGITS = EXAMPLES / "digits" / "train.py"
STEPS = 30
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def assert_same_params(a: Path, b: Path) -> None:
    left, right = load_file(a), load_file(b)
    assert left.keys() == right.keys()
    for k in left:
        torch.testing.assert_close(left[k], right[k], rtol=1e-6, atol=1e-7)


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "distml", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*child_pids(proc.pid), proc.pid]:
            os.kill(pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, out[-4000:]
    return out


def ckpt_step(path: Path) -> int:
    try:
        return int(torch.load(path, weights_only=True)["step"])
    except Exception:  # not written yet, or being replaced
        return -1


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory) -> Path:
    """The plain script, uninterrupted, under plain torchrun."""
    out = tmp_path_factory.mktemp("torchrun_ref")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(TORCHRUN_SCRIPT),
            str(out),
            str(STEPS),
        ],
        check=True,
        capture_output=True,
        env=ENV,
        timeout=180,
    )
    return out / "final.safetensors"


def test_torchrun_script_runs_unchanged_and_gives_the_same_result(tmp_path, torchrun_reference):
    proc = distml_cli(
        "run",
        "--nproc",
        "2",
        "--runs-dir",
        str(tmp_path / "runs"),
        str(TORCHRUN_SCRIPT),
        str(tmp_path),
        str(STEPS),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_params(tmp_path / "final.safetensors", torchrun_reference)


def test_sigkilled_worker_of_a_plain_torchrun_script_is_restarted(tmp_path, torchrun_reference):
    proc = start(
        [
            "run",
            "--nproc",
            "2",
            "--max-restarts",
            "1",
            "--runs-dir",
            str(tmp_path / "r"),
            str(TORCHRUN_SCRIPT),
            str(tmp_path),
            str(STEPS),
            "0.1",
        ]
    )
    wait_for(lambda: ckpt_step(tmp_path / "ckpt.pt") >= 5, 120, "a checkpoint at step 5")
    victim = next((tmp_path / "pids").glob("rank1.*"))
    os.kill(int(victim.suffix[1:]), signal.SIGKILL)
    killed_at = ckpt_step(tmp_path / "ckpt.pt")
    out = finish(proc)
    assert killed_at < STEPS, "the job ended before the kill"
    assert "restarting" in out
    assert len(list((tmp_path / "pids").glob("rank1.*"))) == 2  # one process per attempt
    assert_same_params(tmp_path / "final.safetensors", torchrun_reference)


def digits_args(runs: Path, name: str, *extra: str) -> list[str]:
    return [
        "run",
        "--nproc",
        "2",
        "--runs-dir",
        str(runs),
        "--run-name",
        name,
        "--simulate-straggler",
        "1:20",
        *extra,
        str(DIGITS),
        "--max-steps",
        "40",
        "--checkpoint-every",
        "5",
    ]


@pytest.fixture(scope="module")
def digits_reference(tmp_path_factory) -> dict:
    runs = tmp_path_factory.mktemp("digits_ref")
    finish(start(digits_args(runs, "ref")))
    return json.loads((runs / "ref" / "summary.json").read_text())


def latest_step(run_dir: Path) -> int:
    marker = run_dir / "checkpoint" / "latest"
    return int(marker.read_text().split("_")[1]) if marker.exists() else -1


def sigterm_pending(pid: int) -> bool:
    """SIGTERM is pending on process ``pid`` (its own or its thread group's pending set)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # gone: nothing to wait for
    masks = [int(line.split()[1], 16) for line in status.splitlines()
             if line.startswith(("SigPnd:", "ShdPnd:"))]  # fmt: skip
    return any(mask & (1 << (signal.SIGTERM - 1)) for mask in masks)


@pytest.mark.parametrize("how", ["sigkill", "hang"])
def test_distml_script_survives_a_lost_worker(tmp_path, digits_reference, how):
    # A killed worker is seen by the agent at once; a hung one only by the survivor's collective
    # timing out. That timeout is short against torch's 30 minutes, yet long enough that a busy
    # machine never trips it on a healthy rank (rank 0 writes the checkpoints while rank 1 waits).
    extra = ["--max-restarts", "1"] + (["--timeout", "20"] if how == "hang" else [])
    proc = start(digits_args(tmp_path, "faulty", *extra))
    wait_for(lambda: latest_step(tmp_path / "faulty") >= 10, 120, "a checkpoint at step 10")
    victim = max(worker_pids(proc.pid))
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
    if how == "hang":
        # A stopped process holds the SIGTERM the agent sends once the survivor's collective
        # times out, and the agent waits 30 s before SIGKILL. A worker hung in a collective takes
        # SIGTERM at once: let the stopped one do so too.
        wait_for(lambda: sigterm_pending(victim), 240, "SIGTERM sent to the hung worker")
        os.kill(victim, signal.SIGCONT)
    out = finish(proc)
    summary = json.loads((tmp_path / "faulty" / "summary.json").read_text())
    assert "restarting" in out
    assert summary["attempt"] == 1
    assert summary["steps"] < 40  # the second attempt resumed from a checkpoint
    assert summary["param_norm"] == pytest.approx(digits_reference["param_norm"], rel=1e-6)
    assert_same_params(Path(summary["export"]), Path(digits_reference["export"]))
    if how == "hang":  # a 20 s timeout, not torch's 30-minute default
        assert time.monotonic() - t0 < 300


def test_a_script_that_decides_by_its_restart_count_sees_torchruns_values(tmp_path):
    """torchrun gives attempt k of K restarts TORCHELASTIC_RESTART_COUNT=k, MAX_RESTARTS=K and
    one run id: a script that injects a fault on attempt 0 only then succeeds on attempt 1."""
    out = tmp_path / "out"
    out.mkdir()
    proc = distml_cli(
        "run", "--nproc", "2", "--max-restarts", "2", "--runs-dir", str(tmp_path / "runs"),
        "--run-name", "faulty", str(SCRIPTS / "torchrun_restart.py"), str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = {p.stem: json.loads(p.read_text()) for p in out.glob("env-*.json")}
    assert set(seen) == {"env-0-0", "env-1-0", "env-0-1", "env-1-1"}  # no third attempt
    for name, env in seen.items():
        rank, attempt = name.split("-")[1:]
        assert env["TORCHELASTIC_RESTART_COUNT"] == attempt
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert env["TORCHELASTIC_RUN_ID"] == "faulty"  # one id for the run, as torchrun's
        assert env["ROLE_NAME"] == "default"  # torchrun's --role
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (rank, rank, "2")
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"


def test_torchruns_flags_and_pet_variables_name_the_same_settings(tmp_path):
    """torchrun's spellings (``--nproc_per_node``, ``--max-restarts``...) and the ``PET_*``
    variables Kubeflow's PyTorchJob hands over start the same world as distml's flags."""
    script = str(SCRIPTS / "torchrun_restart.py")
    for name, args, env in [
        ("flags", ["--nproc_per_node", "3", "--standalone", "--max_restarts", "1"], {}),
        ("pet", [], {"PET_NPROC_PER_NODE": "3", "PET_MAX_RESTARTS": "1", "PET_NNODES": "1"}),
    ]:
        out = tmp_path / name
        out.mkdir()
        proc = distml_cli(
            "run", *args, "--runs-dir", str(tmp_path / "runs"), "--run-name", name, script,
            str(out), env=env,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen = [json.loads(p.read_text()) for p in sorted(out.glob("env-*-1.json"))]
        assert [e["WORLD_SIZE"] for e in seen] == ["3"] * 3  # attempt 1 of at most 1 restart
        assert {e["TORCHELASTIC_MAX_RESTARTS"] for e in seen} == {"1"}
