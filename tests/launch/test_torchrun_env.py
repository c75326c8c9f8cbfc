"""What a worker sees under ``distml run`` is what it sees under torchrun: every variable
torchrun's agent sets, on a first attempt and after a restart; and torchrun's other flags
(``--role``, ``--log-dir``, ``--redirects``, ``--tee``, ``--no-python``, ``--local-addr``) do
what they do there."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS

pytestmark = pytest.mark.distributed  # every test starts processes

DUMP_ENV = SCRIPTS / "dump_env.py"


def _env() -> dict[str, str]:
    """This process's environment without OMP_NUM_THREADS: each launcher sets its own."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return {**env, "PYTHONUNBUFFERED": "1"}


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=cwd, env=_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def _seen(out: Path) -> dict[tuple[int, int], dict[str, str]]:
    """What each worker saw, by (attempt, rank)."""
    found = {}
    for path in out.glob("env-*.json"):
        attempt, rank = map(int, path.stem.split("-")[1:])
        found[attempt, rank] = json.loads(path.read_text())
    assert set(found) == {(0, 0), (0, 1), (1, 0), (1, 1)}, sorted(found)
    return found


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, dict[tuple[int, int], dict[str, str]]]:
    """dump_env.py (rank 1 fails on attempt 0) under torchrun and under distml run, with 2
    workers, one restart and the rendezvous id X. torchrun's rendezvous is --standalone's (c10d
    on a port of its own) with our id, which --standalone would replace by a random one."""
    tmp = tmp_path_factory.mktemp("torchrun_env")
    common = ["--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-id", "X"]
    seen = {}
    for name, launcher in [
        ("torchrun", [sys.executable, "-m", "torch.distributed.run", *common,
                      "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]),
        ("distml", [sys.executable, "-m", "distml", "run", *common, "--runs-dir", str(tmp),
                    "--run-name", "run"]),
    ]:  # fmt: skip
        out = tmp / name
        out.mkdir()
        _run([*launcher, str(DUMP_ENV), str(out)], cwd=tmp)
        seen[name] = _seen(out)
    seen["run_dir"] = tmp / "run"  # type: ignore[assignment]
    return seen


@pytest.mark.parametrize("attempt", [0, 1])
def test_every_torchrun_variable_is_set_as_torchrun_sets_it(launched, attempt):
    torchrun, distml, run_dir = launched["torchrun"], launched["distml"], launched["run_dir"]
    cores_each = str(max(1, (os.cpu_count() or 1) // 2))
    for rank in (0, 1):
        ours, theirs = distml[attempt, rank], torchrun[attempt, rank]
        assert set(ours) == set(theirs), set(ours) ^ set(theirs)
        assert theirs["TORCHELASTIC_RUN_ID"] == "X"
        assert theirs["TORCHELASTIC_RESTART_COUNT"] == str(attempt)
        assert theirs["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        # Where they must differ, the same form:
        differ = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS"}
        same = set(ours) - differ
        assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
        # torchrun names this host by its FQDN (the rendezvous has no --local-addr); distml by
        # the loopback, which a node of one always reaches
        assert theirs["MASTER_ADDR"] == socket.getfqdn() and ours["MASTER_ADDR"] == "127.0.0.1"
        assert all(0 < int(env["MASTER_PORT"]) < 65536 for env in (ours, theirs))
        # Each under its log dir, in the same folders: <log_dir>/X_<random>/attempt_<k>/<rank>/
        tail = rf"/X_[^/]+/attempt_{attempt}/{rank}/error\.json"
        assert re.fullmatch(r"/.*/torchelastic_[^/]+" + tail, theirs["TORCHELASTIC_ERROR_FILE"])
        logs = re.escape(str((run_dir / "logs").resolve()))
        assert re.fullmatch(logs + tail, ours["TORCHELASTIC_ERROR_FILE"])
        # torchrun gives each worker one thread, distml a share of the cores (README)
        assert theirs["OMP_NUM_THREADS"] == "1" and ours["OMP_NUM_THREADS"] == cores_each


def test_master_port_is_kept_by_torchrun_and_fresh_per_attempt_under_distml(launched):
    """torchrun's one agent keeps its store (and port) across restarts; distml starts each
    attempt with a fresh agent and store (the gloo restart bug), so the port moves."""
    ports = {
        name: [launched[name][attempt, 0]["MASTER_PORT"] for attempt in (0, 1)]
        for name in ("torchrun", "distml")
    }
    assert ports["torchrun"][0] == ports["torchrun"][1]
    assert ports["distml"][0] != ports["distml"][1]


def test_torchruns_launch_flags_in_one_run(tmp_path):
    """An executable wrapper started with --no-python (the workers get the run's restart
    count and id as a Python script does), --role, --log-dir, --redirects 2 (stderr into the
    logs only), --tee 1 (stdout into the logs and to the console, under torch's prefix
    [role+local rank]), --local-addr and torchrun's underscore spellings."""
    wrapper = tmp_path / "train.sh"
    wrapper.write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(DUMP_ENV))} "$@"\n'
    )
    wrapper.chmod(0o755)
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    done = _run(
        [sys.executable, "-m", "distml", "run", "--nproc_per_node", "2", "--max_restarts", "1",
         "--no_python", "--role", "trainer", "--log_dir", str(logs), "-r", "2", "--tee", "1",
         "--local_addr", "localhost", "--monitor_interval", "0.05", "--rdzv_id", "job7",
         "--runs-dir", str(tmp_path / "runs"), str(wrapper), str(out)],
        cwd=tmp_path,
    )  # fmt: skip
    (run_logs,) = logs.glob("job7_*")  # torchrun's folder: the rendezvous id and a random part
    for (attempt, rank), env in _seen(out).items():
        assert env["ROLE_NAME"] == "trainer" and env["ROLE_WORLD_SIZE"] == "2"
        assert env["TORCHELASTIC_RUN_ID"] == "job7"
        assert env["TORCHELASTIC_RESTART_COUNT"] == str(attempt)
        assert env["MASTER_ADDR"] == "localhost"
        folder = run_logs / f"attempt_{attempt}" / str(rank)
        assert env["TORCHELASTIC_ERROR_FILE"] == str(folder / "error.json")
        line = f"of rank {rank} attempt {attempt}"
        assert (folder / "stdout.log").read_text() == f"stdout {line}\n"
        assert (folder / "stderr.log").read_text() == f"stderr {line}\n"
        assert f"[trainer{rank}]:stdout {line}" in done.stdout
        assert f"stderr {line}" not in done.stdout + done.stderr
