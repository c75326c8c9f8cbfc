"""The rendezvous of a run: the backend and options torch's agent gets, the one rendezvous id
every node agrees on (a node with another one fails at once, and so do the nodes waiting for
it), and the workers' log folders, torchrun's across restarts."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from conftest import SCRIPTS, wait_for
from distml.config import ConfigError, build_config
from distml.launch.elastic import logs_specs
from distml.launch.rendezvous import Rendezvous, agree_on_id, plan_rendezvous
from distml.net.ports import free_port

SAME_ID = "give every node of a run the same --rdzv-id (or --run-name)"


def test_the_backend_is_static_with_a_node_rank_else_c10d_unless_named():
    one = plan_rendezvous(build_config(run_name="r"), attempt=0, local_addr="127.0.0.1")
    assert (one.backend, one.name, one.configs) == ("c10d", "r-attempt0", {"timeout": 120})
    fixed = build_config(
        run_name="r", rdzv_id="job", min_nodes=2, max_nodes=2, node_rank=1,
        rdzv_endpoint="10.0.0.1:29400", rdzv_conf={"timeout": 45},
    )  # fmt: skip
    static = plan_rendezvous(fixed, attempt=2, local_addr="10.0.0.2")
    assert static.backend == "static" and static.name == "job-attempt2"
    assert static.endpoint == "10.0.0.1:29402"  # a fresh store each attempt
    assert static.configs == {"timeout": 45, "rank": 1}
    c10d = plan_rendezvous(
        fixed.model_copy(update={"rdzv_backend": "c10d"}), attempt=2, local_addr="10.0.0.1"
    )
    assert c10d.backend == "c10d" and c10d.endpoint == "10.0.0.1:29400"
    assert c10d.configs["is_host"] is True  # this node has the endpoint's address
    given = fixed.model_copy(update={"rdzv_backend": "c10d", "rdzv_conf": {"is_host": False}})
    assert plan_rendezvous(given, 0, "10.0.0.1").configs["is_host"] is False  # the option wins


def _rdzv(port: int, hosts: bool) -> Rendezvous:
    return Rendezvous("c10d", f"127.0.0.1:{port}", {"is_host": hosts}, "x-attempt0")


def _store(port: int, hosts: bool) -> TCPStore:
    return TCPStore(
        "127.0.0.1", port, is_master=hosts, multi_tenant=True, wait_for_workers=False,
        timeout=timedelta(seconds=30),
    )  # fmt: skip


def _join_in_thread(port: int, rdzv_id: str, hosts: bool) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def join() -> None:
        try:
            agree_on_id(_store(port, hosts), _rdzv(port, hosts), rdzv_id, 0, nodes=2)
            outcome["joined"] = True
        except ConfigError as exc:
            outcome["error"] = str(exc)

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    return thread, outcome


def test_nodes_with_the_same_id_meet():
    port = free_port()
    host = _store(port, hosts=True)  # the node that hosts the store, as the agent's shares it
    thread, first = _join_in_thread(port, "job", hosts=False)
    agree_on_id(host, _rdzv(port, True), "job", 0, nodes=2)
    thread.join(30)
    assert first == {"joined": True}


@pytest.mark.parametrize("refused_hosts_the_store", [False, True])
def test_a_node_with_another_id_fails_at_once_and_so_does_the_one_waiting(
    refused_hosts_the_store,
):
    """The first node's id is the rendezvous's; the next with another one is refused, and the
    waiting node is told (a refused host keeps its store up until it is)."""
    port = free_port()
    waiting, outcome = _join_in_thread(port, "job-a", hosts=not refused_hosts_the_store)
    store = _store(port, hosts=refused_hosts_the_store)
    joined = lambda: store.add("distml/rdzv/attempt0/joined", 0) >= 1  # noqa: E731
    wait_for(joined, 30, "the first node to join")
    with pytest.raises(ConfigError) as refused:
        agree_on_id(store, _rdzv(port, refused_hosts_the_store), "job-b", 0, nodes=2)
    waiting.join(30)
    assert str(refused.value) == (
        f"this node's rendezvous id 'job-b' differs from 'job-a', the id of the nodes already "
        f"at 127.0.0.1:{port}: {SAME_ID}"
    )
    assert outcome["error"] == (
        f"a node with rendezvous id 'job-b' came to this node's rendezvous 'job-a' at "
        f"127.0.0.1:{port}, and was refused: {SAME_ID}"
    )


def test_the_workers_log_folders_are_torchruns_one_per_run_and_attempt(tmp_path):
    """torch's logs spec, given the run's values of torchrun's variables on every attempt:
    ``<log_dir>/<rdzv_id>_<random>/attempt_<k>/<local_rank>/``, as torchrun's one agent."""
    config = build_config(run_name="r", rdzv_id="job", log_dir=tmp_path, redirects="1")
    spec = logs_specs(config)
    dests = []
    for attempt in (0, 1):
        spec.run_env = {"TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_RUN_ID": "job"}
        # What a fresh agent sets for each attempt's workers: its own count and rendezvous
        envs = {r: {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "job-attempt"}
                for r in (0, 1)}  # fmt: skip
        dests.append(spec.reify(envs))
        assert {e["TORCHELASTIC_RESTART_COUNT"] for e in envs.values()} == {str(attempt)}
        assert {e["TORCHELASTIC_RUN_ID"] for e in envs.values()} == {"job"}
    (run_dir,) = tmp_path.iterdir()
    assert run_dir.name.startswith("job_")
    for attempt, dest in enumerate(dests):
        for rank in (0, 1):
            folder = run_dir / f"attempt_{attempt}" / str(rank)
            assert dest.error_files[rank] == str(folder / "error.json")
            assert dest.stdouts[rank] == str(folder / "stdout.log")  # --redirects 1
            assert dest.stderrs[rank] == ""  # to the console


def _distml_run(tmp: Path, name: str, *args: str) -> subprocess.Popen:
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115  (closed with the process)
    proc = subprocess.Popen(
        [sys.executable, "-m", "distml", "run", "--nproc", "1", "--runs-dir", str(tmp / name),
         *args, str(SCRIPTS / "dump_env.py"), str(tmp), "--no-fault"],
        stdout=log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _outcome(proc: subprocess.Popen, tmp: Path, name: str) -> tuple[int, str]:
    code = proc.wait(timeout=240)
    proc.log.close()  # type: ignore[attr-defined]
    return code, " ".join((tmp / f"{name}.log").read_text().split())


@pytest.mark.distributed
def test_two_nodes_on_loopback_with_different_ids_fail_at_once(tmp_path):
    """Two nodes of this machine (the first to bind the endpoint hosts the store, the other
    joins it): each fails with both ids named, long before any rendezvous timeout."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = {}
    for rdzv_id in ("job-a", "job-b"):
        procs[rdzv_id] = _distml_run(
            tmp_path, rdzv_id, "--nnodes", "2", "--rdzv-endpoint", endpoint,
            "--rdzv-id", rdzv_id, "--rdzv-conf", "join_timeout=600",
        )  # fmt: skip
    for rdzv_id, proc in procs.items():
        code, out = _outcome(proc, tmp_path, rdzv_id)
        assert code == 2, out
        assert "'job-a'" in out and "'job-b'" in out and SAME_ID in out, out
    assert not list(tmp_path.glob("env-*.json"))  # no worker started


@pytest.mark.distributed
def test_two_nodes_on_loopback_with_one_id_make_one_world(tmp_path):
    """With c10d both nodes find the endpoint's address theirs; the second joins the first's
    store, as torch's c10d backend does when it guesses. ``--run-path`` wins over
    ``--no-python``, as in torchrun: dump_env.py is not executable, and runs."""
    endpoint = f"127.0.0.1:{free_port()}"
    names = ("node-a", "node-b")
    procs = [
        _distml_run(
            tmp_path,
            name,
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            "job",
            "--no-python",
            "--run-path",
        )  # fmt: skip
        for name in names
    ]
    for name, proc in zip(names, procs, strict=True):
        code, out = _outcome(proc, tmp_path, name)
        assert code == 0, out
    seen = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("env-0-*.json"))]
    assert [(e["RANK"], e["WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) for e in seen] == [
        ("0", "2", "2"),
        ("1", "2", "2"),
    ]
    assert {e["TORCHELASTIC_RUN_ID"] for e in seen} == {"job"}
