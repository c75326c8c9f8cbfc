"""Tuning on a real PostgreSQL server: a throwaway cluster on a loopback port, created by the
test itself (skipped where PostgreSQL's ``initdb`` and ``pg_ctl`` or the driver are missing)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from distml.net.ports import free_port
from distml.tune import open_storage, tune
from distml.tune.liveness import WORKER

pytestmark = [
    pytest.mark.skipif(
        not (shutil.which("initdb") and shutil.which("pg_ctl")),
        reason="needs PostgreSQL's initdb and pg_ctl on PATH",
    ),
    pytest.mark.distributed,  # a PostgreSQL server and tune's workers
]
QUADRATIC = f"{Path(__file__).resolve().parent / 'objectives.py'}:quadratic"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    pytest.importorskip("psycopg", reason="needs the PostgreSQL driver: distml[postgres]")
    run_as: dict[str, int] = {}
    if os.geteuid() == 0:  # initdb refuses to run as root: run the server as its own user
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root, and there is no postgres user to run the server as")
        run_as = {"user": user.pw_uid, "group": user.pw_gid}
    # Not under pytest's tmp_path, whose parent only root may enter.
    folder = Path(tempfile.mkdtemp(prefix="distml-pg-"))
    if run_as:
        os.chown(folder, run_as["user"], run_as["group"])
    data, port = folder / "data", free_port()
    server = f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories=''"

    def pg(*args: str, check: bool = True) -> None:
        subprocess.run(args, check=check, capture_output=True, cwd=folder, timeout=120, **run_as)

    try:
        pg(
            "initdb",
            "-D",
            str(data),
            "-U",
            "distml",
            "--auth=trust",
            "--no-sync",
            "--locale=C",
            "-E",
            "UTF8",
        )
        pg("pg_ctl", "-D", str(data), "-l", str(folder / "log"), "-o", server, "-w", "start")
        yield f"postgresql+psycopg://distml@127.0.0.1:{port}/postgres"
    finally:
        pg("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(folder, ignore_errors=True)


def test_two_workers_tune_on_postgresql(postgres_url):
    result = tune(QUADRATIC, n_trials=12, workers=2, storage=postgres_url, study_name="pg", seed=3)
    assert (result.finished, result.failed) == (12, 0)
    study = optuna.load_study(study_name="pg", storage=open_storage(postgres_url))
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 12 and len({t.user_attrs[WORKER]["pid"] for t in complete}) == 2
    # What the server stored is what the objective computed: (x - 2)^2 of each trial's x.
    assert all(t.value == pytest.approx((t.params["x"] - 2.0) ** 2) for t in complete)
    assert result.best_value == min(t.value for t in complete)
