"""The parameter server from the command line: shards started on their own (``distml ps
serve``, as on other machines) with workers pointed at them, the digits example, and usage
errors that exit 2 before anything starts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import EXAMPLES, distml_cli, distml_invoke, wait_for
from distml.net.ports import free_port

TOKEN = "standalone-token-0123456789"
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.distributed
def test_workers_train_against_standalone_shards(tmp_path):
    env = {**os.environ, "DISTML_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    ports = [free_port(), free_port()]
    shards = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distml",
                "ps",
                "serve",
                "--port",
                str(port),
                "--workers",
                "2",
                "--consistency",
                "ssp:2",
                "--snapshot",
                str(tmp_path / f"shard{k}.safetensors"),
            ],
            env=env,
        )  # fmt: skip
        for k, port in enumerate(ports)
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:

        def up() -> bool:
            try:
                return all(
                    httpx.get(
                        f"{u}/healthz", headers={"Authorization": f"Bearer {TOKEN}"}
                    ).status_code
                    == 200
                    for u in urls
                )
            except httpx.HTTPError:
                return False

        wait_for(up, 60, "the shards to listen")
        # A worker set to another rule than the servers' is refused before it trains: its data
        # loading depends on the rule (claimed batches under ASP and SSP, fixed shards under BSP).
        wrong = subprocess.run(
            [sys.executable, "-m", "distml", "run", "--strategy", "ps", "--nproc", "1",
             "--ps-servers", ",".join(urls), "--consistency", "bsp", "--runs-dir",
             str(tmp_path), "--run-name", "wrong", str(EXAMPLES / "digits" / "train.py"),
             "--max-steps", "1"],
            env=env, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert wrong.returncode != 0
        assert "applies 'ssp', but this job is set to 'bsp'" in wrong.stderr, wrong.stderr[-2000:]
        result = subprocess.run(
            [sys.executable, "-m", "distml", "run", "--strategy", "ps", "--nproc", "2",
             "--ps-servers", ",".join(urls), "--consistency", "ssp:2", "--runs-dir",
             str(tmp_path), "--run-name", "standalone", str(EXAMPLES / "digits" / "train.py"),
             "--epochs", "1", "--max-steps", "15", "--lr", "0.2"],
            env=env, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    finally:
        for shard in shards:
            shard.terminate()
            shard.wait(10)
    summary = json.loads((tmp_path / "standalone" / "summary.json").read_text())
    ps = summary["ps"]
    assert [w["pushed"] for w in ps["workers"]] == [15, 15]
    assert sum(ps["versions"]) == 2 * 2 * 15  # SSP: each push one version, on both shards
    # Trained: 15 steps leave accuracy noisy (0.09-0.46 across runs), but the held-out loss
    # reliably below that of a model that guesses (ln 10, where every model starts).
    assert summary["eval"]["loss"] < math.log(10) and summary["export"]
    assert all((tmp_path / f"shard{k}.safetensors").exists() for k in range(2))
    report = (tmp_path / "standalone" / "report.html").read_text()
    assert "<h2>Parameter server</h2>" in report and 'alt="staleness"' in report


@pytest.mark.distributed
def test_digits_example_under_bsp_with_a_backup_worker(tmp_path):
    result = distml_cli(
        "run", "--strategy", "ps", "--nproc", "3", "--backup-workers", "1", "--servers", "2",
        "--runs-dir", str(tmp_path), "--run-name", "backup", "--log-dir", str(tmp_path / "logs"),
        str(EXAMPLES / "digits" / "train.py"), "--epochs", "1", "--max-steps", "12",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    # --log-dir holds the shards' and the workers' logs (worker 0 writes to the terminal).
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["ps-shard-0.log", "ps-shard-1.log", "worker-1.log", "worker-2.log"]
    assert not (tmp_path / "backup" / "logs").exists()
    summary = json.loads((tmp_path / "backup" / "summary.json").read_text())
    ps = summary["ps"]
    for shard, version in zip(ps["shards"], ps["versions"], strict=True):
        pushes = shard["pushes"]
        assert pushes["accepted"] + pushes.get("dropped", 0) == 3 * 12
        # A step takes the first two gradients of three, or the one left once two workers are
        # done: at least as many steps as a worker made, each of one or two accepted gradients.
        assert 12 <= version <= pushes["accepted"] <= 2 * version
    assert summary["param_norm"] > 0 and "ps_push" in summary["comm_bytes"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--consistency", "asp"], "need --strategy ps"),
        (["--strategy", "ps", "--consistency", "ssp"], "expected bsp, asp or ssp:S"),
        (["--strategy", "ps", "--nproc", "2", "--backup-workers", "2"], "leaves no worker"),
        (["--strategy", "ps", "--consistency", "asp", "--backup-workers", "1"], "BSP option"),
        (["--strategy", "ps", "--ps-servers", "ftp://x"], "is not http(s)://HOST:PORT"),
        (["--strategy", "ps:bsp"], "takes no options"),
    ],
)
def test_bad_ps_flags_exit_2_before_anything_starts(tmp_path, args, message):
    result = distml_invoke(
        "run", *args, "--runs-dir", str(tmp_path), str(EXAMPLES / "digits" / "train.py"),
        cwd=tmp_path,
    )  # fmt: skip
    assert result.exit_code == 2 and message in result.stderr, (result.stderr, result.exception)
    assert not list(tmp_path.iterdir())


@pytest.mark.distributed
def test_ps_serve_refuses_a_missing_or_short_token():
    env = {k: v for k, v in os.environ.items() if k != "DISTML_TOKEN"}
    result = subprocess.run(
        [sys.executable, "-m", "distml", "ps", "serve", "--port", "1"],
        env={**env, "DISTML_TOKEN": "short"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "DISTML_TOKEN" in result.stderr


@pytest.mark.distributed
@pytest.mark.parametrize("consistency", ["asp", "ssp:1"])
def test_asynchronous_workers_claim_batches_so_a_straggler_takes_fewer(tmp_path, consistency):
    """Each epoch every sample is used once, as with fixed shards, but the slowed worker trains
    on fewer of them instead of holding the others back (SSP: as many as its bound allows)."""
    out = tmp_path / "seen"
    result = distml_cli(
        "run", "--strategy", "ps", "--consistency", consistency, "--nproc", "2",
        "--runs-dir", str(tmp_path), "--run-name", "claims",
        str(SCRIPTS / "ps_claims.py"), "2", str(out), "--slow", "1:0.05",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    fast, slow = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(fast) == len(slow) == 2
    for epoch in range(2):
        assert sorted(fast[epoch] + slow[epoch]) == list(range(640))  # each sample once
    taken = [sum(map(len, fast)) // 16, sum(map(len, slow)) // 16]
    summary = json.loads((tmp_path / "claims" / "summary.json").read_text())
    assert summary["ps"]["shards"][0]["batches_claimed"] == {"0": taken[0], "1": taken[1]}
    if consistency == "asp":
        assert taken[0] >= 2 * taken[1]  # rank 1 sleeps 50 ms a step; rank 0 computes in few
    else:
        assert abs(taken[0] - taken[1]) <= 2  # never more than s + 1 claims ahead
