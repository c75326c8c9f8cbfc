"""A parameter-server job on this machine: K shard processes and N worker processes, each
watched on its own.

Workers of a parameter server share no collective, so one that dies does not stop the others
(as it would in a torchrun world): a dead shard is restarted from its snapshot, a dead worker is
restarted up to ``max_restarts`` times and is re-admitted by the shards. A worker killed by a
signal and not restarted is a lost worker -- the job finishes without it and says so; a worker that
raised fails the job.

Each worker writes its step records to ``runs/<name>/workers/``; when the workers are done, this
process reads the final parameters from the shards and writes the run's summary and report.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from distml.config import CONFIG_ENV, RunConfig, save_config
from distml.launch.children import ChildProcess, stop_all
from distml.launch.elastic import ATTEMPT_ENV, LaunchError, WorkerFailure
from distml.net import TOKEN_ENV, ServiceClient, ServiceError, decode_tensors
from distml.net.ports import listening_socket
from distml.ps.shard import PROCESS_ENV
from distml.ps.worker import SERVERS_ENV
from distml.telemetry.console import print_summary
from distml.telemetry.metrics_stream import write_metrics
from distml.telemetry.mlflow_log import target_for
from distml.telemetry.report import write_report
from distml.telemetry.summary import summarize
from distml.train.checkpoint import export_state, norm_of

MAX_SERVER_RESTARTS = 10


@dataclass(eq=False)
class Process(ChildProcess):
    """One shard or worker: how to start it, and its current incarnation."""

    name: str = ""
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    url: str = ""  # a shard's

    def start(self, attempt: int | None = None, inherit_output: bool = False) -> None:
        env = {**os.environ, **self.env}
        if attempt is not None:
            env[ATTEMPT_ENV] = str(attempt)
        super().start(self.argv, env, inherit_output)


def shard_argv(config_path: Path, port: int, snapshot: Path) -> list[str]:
    """The ``distml ps serve`` command of one shard of the job whose config is at
    ``config_path``: the shard reads its settings from there."""
    argv = [sys.executable, "-m", "distml", "ps", "serve", "--config", str(config_path)]
    return argv + ["--host", "127.0.0.1", "--port", str(port), "--snapshot", str(snapshot)]


def wait_healthy(clients: list[ServiceClient], servers: list[Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for client, server in zip(clients, servers or [None] * len(clients), strict=True):
        while True:
            if server is not None and server.poll() is not None:
                raise LaunchError(
                    [WorkerFailure(-1, server.poll(), f"{server.name}:\n{server.log_tail()}")], 1
                )
            try:
                client.request("GET", "/healthz")
                break
            except ServiceError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def run_ps_job(config: RunConfig, argv: list[str]) -> dict[str, Any]:
    """Run the worker command ``argv`` (``python script.py ...``) as a parameter-server job."""
    run_dir = config.run_dir
    config_path = run_dir / "config.toml"
    save_config(config, config_path)
    external = config.ps.addresses
    # The servers' token: the user's (DISTML_TOKEN) when given, a fresh one otherwise.
    token = os.environ.get(TOKEN_ENV) or (None if external else secrets.token_urlsafe(32))
    if not token:
        raise LaunchError([WorkerFailure(-1, 2, f"set {TOKEN_ENV} to the servers' token")], 0)
    logs = config.log_dir or run_dir / "logs"  # --log-dir, as torchrun's workers' logs
    servers: list[Process] = []
    if external is None:
        for k in range(config.ps.servers):
            listen = listening_socket()
            port = listen.getsockname()[1]
            snapshot = run_dir / "ps" / f"shard-{k}.safetensors"
            servers.append(
                Process(
                    logs / f"ps-shard-{k}.log",
                    name=f"shard {k}",
                    argv=shard_argv(config_path, port, snapshot),
                    env={TOKEN_ENV: token, **PROCESS_ENV},
                    url=f"http://127.0.0.1:{port}",
                    listen=[listen],
                )
            )
        urls = [s.url for s in servers]
    else:
        urls = [u.rstrip("/") for u in external]
    clients = [ServiceClient(u, token, retry_s=config.timeout_s) for u in urls]
    threads = max(1, (os.cpu_count() or 1) // config.nproc)
    first = (config.node_rank or 0) * config.nproc
    workers = [
        Process(
            logs / f"worker-{rank}.log",
            name=f"worker {rank}",
            argv=list(argv),
            env={
                CONFIG_ENV: str(config_path.resolve()),
                SERVERS_ENV: ",".join(urls),
                TOKEN_ENV: token,
                "RANK": str(rank),
                "WORLD_SIZE": str(config.world_size),
                "LOCAL_RANK": str(rank - first),
                "LOCAL_WORLD_SIZE": str(config.nproc),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
            },
        )
        for rank in range(first, first + config.nproc)
    ]
    try:
        for server in servers:
            server.start()
        wait_healthy(clients, servers, config.timeout_s)
        for worker in workers:
            worker.start(attempt=0, inherit_output=worker.name == "worker 0")
        failures, lost = _supervise(config, servers, workers)
        if failures and all(0 not in w.exits for w in workers):
            raise LaunchError(failures, config.max_restarts + 1)
        summary = write_job_files(config, clients, workers, servers, lost)
    finally:
        stop_all(workers, timeout_s=10)
        stop_all(servers, timeout_s=10)
        for client in clients:
            client.close()
    if failures:
        raise LaunchError(failures, config.max_restarts + 1)
    return summary


def _supervise(
    config: RunConfig, servers: list[Process], workers: list[Process]
) -> tuple[list[WorkerFailure], list[int]]:
    """Restart what dies until every worker has exited; the failures and the lost workers."""
    failures: list[WorkerFailure] = []
    lost: list[int] = []
    running = set(range(len(workers)))
    while running:
        time.sleep(0.1)
        for server in servers:
            code = server.poll()
            if code is not None:
                if server.restarts >= MAX_SERVER_RESTARTS:
                    raise LaunchError([WorkerFailure(-1, code, server.log_tail())], server.restarts)
                server.exits.append(code)
                server.restarts += 1
                print(
                    f"distml: {server.name} exited ({code}); restarting from its snapshot",
                    file=sys.stderr,
                )
                server.start()
        for i in sorted(running):
            worker = workers[i]
            code = worker.poll()
            if code is None:
                continue
            worker.exits.append(code)
            if code == 0:
                running.discard(i)
            elif worker.restarts < config.max_restarts:
                worker.restarts += 1
                print(
                    f"distml: {worker.name} exited ({code}); restarting "
                    f"({worker.restarts}/{config.max_restarts})",
                    file=sys.stderr,
                )
                worker.start(attempt=worker.restarts)
            else:
                running.discard(i)
                rank = int(worker.env["RANK"])
                if code < 0:  # killed: a lost worker, the job goes on without it
                    lost.append(rank)
                    print(
                        f"distml: {worker.name} was killed ({signal.Signals(-code).name}); "
                        "the job goes on without it",
                        file=sys.stderr,
                    )
                else:
                    failures.append(WorkerFailure(rank, code, worker.log_tail()))
    return failures, lost


# -- run files ------------------------------------------------------------------------------
def _read_workers(run_dir: Path, world: int) -> tuple[list[list[dict]], dict[str, Any]]:
    """Every worker's step records (all its attempts, in order), and the evaluation of the
    lowest rank that made one."""
    per_rank: list[list[dict]] = [[] for _ in range(world)]
    evals: dict[int, dict[str, Any]] = {}
    source = "estimated:none"
    files = (json.loads(p.read_text()) for p in (run_dir / "workers").glob("rank-*.json"))
    for data in sorted(files, key=lambda d: (d["rank"], d["attempt"])):
        per_rank[data["rank"]].extend(data["records"])
        if data["eval"]:
            evals[data["rank"]] = data["eval"]
        source = data["energy_source"]
    return per_rank, {"eval": evals[min(evals)] if evals else {}, "energy_source": source}


def _final_state(clients: list[ServiceClient]) -> tuple[dict[str, torch.Tensor], list[int]]:
    state: dict[str, torch.Tensor] = {}
    versions = []
    for client in clients:
        response = client.request("GET", "/v1/state")
        tensors, _ = decode_tensors(response.content)
        state.update(tensors)
        versions.append(int(response.headers["X-Version"]))
    return state, versions


def ps_summary(per_rank: list[list[dict]], stats: list[dict[str, Any]]) -> dict[str, Any]:
    """What a parameter-server run adds: staleness, per-worker throughput, the shards' queue and
    apply times and bytes."""
    staleness: Counter[int] = Counter()
    for shard in stats:
        staleness.update({int(k): v for k, v in shard["staleness"].items()})
    throughput = []
    for rank, records in enumerate(per_rank):
        busy = sum(r["step_s"] for r in records)
        samples = sum(r["samples"] for r in records)
        # Steps recorded by the worker's incarnations that finished; pushes as the shards
        # counted them (a killed worker's too).
        pushed = max(s["workers"].get(str(rank), {}).get("clock", 0) for s in stats)
        throughput.append(
            {
                "rank": rank,
                "steps": len(records),
                "pushed": pushed,
                "samples_per_s": samples / busy if busy > 0 else 0.0,
            }
        )
    keep = (
        "version",
        "restored_version",
        "pushes",
        "queue_s",
        "apply_s",
        "param_bytes",
        "bytes_pushed",
        "bytes_pulled",
        "batches_claimed",
    )
    return {
        "staleness": {str(k): v for k, v in sorted(staleness.items())},
        "workers": throughput,
        "shards": [{k: s[k] for k in keep} for s in stats],
    }


def write_job_files(
    config: RunConfig,
    clients: list[ServiceClient],
    workers: list[Process],
    servers: list[Process],
    lost: list[int],
) -> dict[str, Any]:
    run_dir = config.run_dir
    per_rank, extra = _read_workers(run_dir, config.world_size)
    stats = [c.request("GET", "/v1/stats").json() for c in clients]
    summary: dict[str, Any] = {
        "run_name": config.run_name,
        "world_size": config.world_size,
        "strategy": config.strategy.model_dump(),
        "mesh": {"dp": config.world_size},
        "attempt": max((w.restarts for w in workers), default=0),
        **summarize(
            [r for r in per_rank if r],
            config.telemetry.straggler_factor,
            measured_waits=True,
            lockstep=False,  # no collective: workers may take different numbers of steps
        ),
        **extra,
    }
    state, versions = _final_state(clients)
    names = sorted(state)
    summary["param_norm"] = norm_of(state[n] for n in names)
    summary["export"] = str(export_state(state, run_dir / "model.safetensors"))
    summary["ps"] = {
        "consistency": config.ps.model_dump(exclude={"addresses"}),
        "versions": versions,
        "lost_workers": lost,
        "worker_restarts": {w.env["RANK"]: w.restarts for w in workers if w.restarts},
        "server_restarts": {s.name: s.restarts for s in servers if s.restarts},
        **ps_summary(per_rank, stats),
    }
    mlflow = target_for(config, kind="parameter-server")
    write_metrics(run_dir, per_rank, summary.get("eval"), mlflow=mlflow)  # jsonl, tb/, MLflow
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    summary["report"] = str(write_report(run_dir, [r for r in per_rank if r], summary))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if config.telemetry.progress:
        print_summary(summary)
    return summary
