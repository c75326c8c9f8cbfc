"""Multi-node, for real: two hosts in two network namespaces on one switch (a testbed).

Each "host" is a network namespace with its own veth address. They share this machine's hostname,
which resolves to the loopback here, as it does on many real machines (Debian's 127.0.1.1 entry,
containers): the launcher must find each node's address on the route to the rendezvous rather
than trust the hostname. One ``distml run --nnodes 2`` starts in each, and the job must train to
the same parameters as ``distml run --nproc 2`` on one host.

Needs root and ``ip`` (iproute2) with ``ip netns``; skipped otherwise.
Nothing outside the two namespaces is addressed, and everything is torn down on exit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import outputs, wait_all
from distml.testbed import Host, Testbed

pytestmark = [pytest.mark.netns, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "digits" / "train.py"
TRAIN_ARGS = ("--max-steps", "20", "--epochs", "1")
RUN_TIMEOUT_S = 180
SUBNET = "10.213.77"  # exists only inside the test's own namespaces
PORT = 29531


def _env() -> dict[str, str]:
    # The same environment for the reference and the multi-node run, so that the numerics match.
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@dataclass
class Run:
    """A finished run's folder, summary.json and exported parameters."""

    run_dir: Path
    summary: dict = field(repr=False)
    params: dict[str, torch.Tensor] = field(repr=False)


@pytest.fixture
def lan(testbed_factory) -> Testbed:
    """Two hosts on one switch, unshaped."""
    return testbed_factory(2, subnet=SUBNET)


def _distml(*args: str) -> list[str]:
    return [sys.executable, "-m", "distml", "run", *args, str(TRAIN), *TRAIN_ARGS]


def _start(argv: list[str], log: Path, lan: Testbed | None = None, host: Host | None = None):
    """``argv`` on ``host`` of ``lan`` (or here), its output in ``log``."""
    if lan is not None:
        return lan.popen(host, argv, log=log, env=_env(), cwd=ROOT), log
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=ROOT, env=_env(), start_new_session=True,
        )  # fmt: skip
    return proc, log


def _load_run(run_dirs: list[Path], context: str) -> Run:
    """The one run folder (of ``run_dirs``) holding summary.json and the exported model."""
    found = [d for d in run_dirs if (d / "summary.json").is_file()]
    assert len(found) == 1, f"expected one summary.json in {run_dirs}, found {found}\n{context}"
    summary = json.loads((found[0] / "summary.json").read_text())
    assert summary.get("export"), f"no exported model in {found[0]}\n{context}"
    return Run(found[0], summary, load_file(summary["export"]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    """The single-host run: ``distml run --nproc 2`` on loopback."""
    tmp = tmp_path_factory.mktemp("single-host")
    argv = _distml("--nproc", "2", "--run-name", "ref", "--runs-dir", str(tmp))
    procs = {"single-host": _start(argv, tmp / "out.log")}
    codes = wait_all(procs, RUN_TIMEOUT_S)
    context = outputs(procs, codes)
    assert codes == {"single-host": "exit code 0"}, f"single-host run failed\n{context}"
    return _load_run([tmp / "ref"], context)


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def pytorchjob_manifest() -> dict:
    """The PyTorchJob manifest of the README's "Across machines" section."""
    text = (ROOT / "README.md").read_text()
    block = re.search(
        r"```yaml\n(apiVersion: kubeflow.org/v1\nkind: PyTorchJob\n.*?)```", text, re.S
    )
    assert block, "the README has no PyTorchJob manifest"
    return yaml.safe_load(block.group(1))


def pytorchjob_commands(lan: Testbed) -> list[tuple[list[str], list[str]]]:
    """Each replica's container command, and the variables training-operator gives it: the
    master's address and port, the node count and rank, and nprocPerNode, with the container's
    own (the rendezvous id)."""
    spec = pytorchjob_manifest()["spec"]
    out = []
    for replica in ("Master", "Worker"):
        container = spec["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"][0]
        env = [
            f"PET_MASTER_ADDR={lan.hosts[0].addr}", f"PET_MASTER_PORT={PORT}", "PET_NNODES=2",
            f"PET_NODE_RANK={len(out)}", f"PET_NPROC_PER_NODE={spec['nprocPerNode']}",
            *(f"{var['name']}={var['value']}" for var in container.get("env", [])),
        ]  # fmt: skip
        out.append((container["command"], env))
    return out


@pytest.mark.parametrize("rendezvous", ["c10d", "static", "slurm", "pytorchjob"])
def test_two_hosts_train_like_one(lan: Testbed, tmp_path: Path, reference: Run, rendezvous: str):
    endpoint = f"{lan.hosts[0].addr}:{PORT}"  # node a hosts the rendezvous
    # As srun sets it for each task: the node list in Slurm's compact form, as "10.213.77.[1,2]"
    octets = ",".join(h.addr.rsplit(".", 1)[1] for h in lan.hosts)
    nodelist = f"{lan.hosts[0].addr.rsplit('.', 1)[0]}.[{octets}]"
    procs = {}
    for node_rank, host in enumerate(lan.hosts):
        args = [
            "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", endpoint,
            "--run-name", "two-hosts", "--runs-dir", str(tmp_path / host.name),
        ]  # fmt: skip
        if rendezvous == "static":
            args += ["--node-rank", str(node_rank)]
        slurm: list[str] = []  # variables set before the command, as srun or an operator does
        if rendezvous == "slurm":  # the node count, rank and rendezvous come from Slurm alone
            args = ["--nproc", "1", *args[6:]]
            slurm = [
                "env", f"SLURM_JOB_NODELIST={nodelist}", "SLURM_JOB_NUM_NODES=2",
                f"SLURM_NODEID={node_rank}", f"MASTER_PORT={PORT}", "SLURM_JOB_ID=1",
            ]  # fmt: skip
        argv = _distml(*args)
        if rendezvous == "pytorchjob":  # the README manifest's command, in the operator's env
            command, env = pytorchjob_commands(lan)[node_rank]
            assert command[:2] == ["distml", "run"] and command[3:] == list(TRAIN_ARGS)
            # No --run-name: each replica names its run itself; the manifest's id joins them.
            folders = ["--runs-dir", str(tmp_path / host.name)]
            slurm = ["env", *env]
            argv = [sys.executable, "-m", "distml", "run", *folders, *command[2:]]
        procs[host.name] = _start([*slurm, *argv], tmp_path / f"{host.name}.log", lan, host)
    codes = wait_all(procs, RUN_TIMEOUT_S)
    context = outputs(procs, codes)
    assert codes == {h.name: "exit code 0" for h in lan.hosts}, f"a node failed\n{context}"

    # With c10d the node ranks follow the join order: rank 0 (and the run files) may be on
    # either host. With static rendezvous node a has rank 0.
    run_dirs = [tmp_path / h.name / "two-hosts" for h in lan.hosts]
    if rendezvous == "pytorchjob":  # each node's one run folder, whatever its name
        run_dirs = [next((tmp_path / h.name).iterdir()) for h in lan.hosts]
    run = _load_run(run_dirs, context)
    if rendezvous != "c10d":  # static rendezvous: node a has rank 0
        assert run.run_dir == run_dirs[0], context
    summary, params = run.summary, run.params
    ref_summary, ref_params = reference.summary, reference.params

    assert summary["world_size"] == 2, context
    assert ref_summary["world_size"] == 2
    assert summary["steps"] == ref_summary["steps"] == 20
    assert summary["param_norm"] == pytest.approx(ref_summary["param_norm"], rel=1e-5, abs=0)
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_two_hosts_with_different_rdzv_ids_fail_at_once(lan: Testbed, tmp_path: Path):
    """Two hosts started with different --rdzv-id: each fails with both ids named and what
    to do, instead of waiting out the rendezvous to fail with a store error."""
    endpoint = f"{lan.hosts[0].addr}:{PORT}"
    procs = {}
    for host, rdzv_id in zip(lan.hosts, ("job-a", "job-b"), strict=True):
        args = [
            "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
            "--runs-dir", str(tmp_path / host.name),
        ]  # fmt: skip
        procs[host.name] = _start(_distml(*args), tmp_path / f"{host.name}.log", lan, host)
    codes = wait_all(procs, RUN_TIMEOUT_S)
    context = outputs(procs, codes)
    assert codes == {h.name: "exit code 2" for h in lan.hosts}, context
    for _, log in procs.values():
        text = " ".join(log.read_text().split())
        assert "'job-a'" in text and "'job-b'" in text, context
        assert "give every node of a run the same --rdzv-id (or --run-name)" in text, context
