"""Serving: throughput and latency of ``distml serve`` under a closed-loop load, in one run.

    python benchmarks/serving.py                       # both parts, 3 interleaved repeats
    python benchmarks/serving.py --part peers          # distml against MLServer and KServe
    python benchmarks/serving.py --requests 2000 --concurrency 32 --repeats 1

Part ``peers``: ``distml serve`` as the README starts it (2 replicas sharing one port, on
Linux), the same behind the router (``--balance router``), one replica alone with batching and
without, against MLServer 1.7 and KServe 0.21's Python server serving the same model class and
weights (``benchmarks/peers/``), each in a virtual environment of its own that this script
makes on first use (their web stacks pin versions that conflict with distml's and with each
other's). Every server runs one thread a process (``OMP_NUM_THREADS=1``); the load and its
client are the same for all. Goals: ``distml serve`` >= 1.2x the requests/s of the best peer
setting; a replica without batching at most the CPU a request of a peer's one forward pass;
the router at most 1.3x the CPU a request of a direct one; 2 replicas >= 0.9 of the CPU ceiling.

Part ``replicas``: 1 vs 2 replicas behind the router, each with dynamic batching (max 32 rows,
no wait) and without (max 1 row); the router's added latency, one request at a time, direct to a
replica vs through the router; and the CPU per request of three HTTP clients against one
replica: httpx and aiohttp, which the router called its replicas with before, and
``distml.serve.upstream``, which it calls them with now. Replicas and router are processes of
their own, as ``distml serve`` starts them. Goal: 2 replicas >= 1.7x the throughput of 1.

In both parts the load generator (aiohttp, ``--concurrency`` clients each sending its next
one-row request when the last one returns) runs in this process, over loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
import torch
from _common import busy_cpu_s, machine_info, print_table, write_json
from safetensors.torch import save_model

from distml.jobs.replicas import ReplicaCommand, ReplicaSet
from distml.models import DigitsCNN
from distml.net import TOKEN_ENV
from distml.net.ports import free_port
from distml.serve.upstream import Upstream

TOKEN = "benchmark-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PATH = "/v2/models/digits-cnn/infer"
WARM_UP = 20  # requests before the timed ones
HEADERS = {**AUTH, "Content-Type": "application/json"}


def request_body() -> bytes:
    """One image of the digits CNN, as an Open Inference Protocol request."""
    x = torch.randn(1, 1, 8, 8).flatten().tolist()
    payload = {"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": x}]}
    return json.dumps(payload).encode()


async def load(url: str, requests: int, concurrency: int) -> dict[str, Any]:
    body = request_body()
    latencies: list[float] = []
    errors = 0
    remaining = requests

    async def post(http: aiohttp.ClientSession) -> int:
        async with http.post(url + PATH, data=body, headers=HEADERS) as r:
            await r.read()
            return r.status

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal remaining, errors
        while remaining > 0:
            remaining -= 1
            start = time.perf_counter()
            status = await post(http)
            latencies.append(time.perf_counter() - start)
            errors += status != 200

    # aiohttp, not httpx: the load generator shares the cores with what it measures, and
    # httpx's AsyncClient took about 3 ms of CPU a request at this concurrency, aiohttp 0.3 ms.
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        for _ in range(WARM_UP):  # connections, first batches
            await post(http)
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=100)
    return {
        "requests": requests,
        "concurrency": concurrency,
        "errors": errors,
        "req_per_s": requests / wall,
        "p50_ms": q[49] * 1000,
        "p99_ms": q[98] * 1000,
    }


async def client_cost(url: str, client: str, requests: int, concurrency: int) -> dict[str, float]:
    """CPU of this process per request, and requests/s, for ``requests`` one-row requests at
    ``concurrency`` through httpx's AsyncClient, aiohttp's ClientSession or the router's own
    ``distml.serve.upstream.Upstream``: what the router spends calling its replicas with each,
    and what a load generator spends."""
    body = request_body()
    if client == "httpx":
        limits = httpx.Limits(max_connections=concurrency)
        session: Any = httpx.AsyncClient(limits=limits, timeout=60)

        async def post() -> None:
            (await session.post(url + PATH, content=body, headers=HEADERS)).raise_for_status()
    elif client == "upstream":
        upstream = Upstream(url, TOKEN)
        session = contextlib.AsyncExitStack()
        session.callback(upstream.close)
        content_type = {"Content-Type": "application/json"}

        async def post() -> None:
            answer = await upstream.request("POST", PATH, body, content_type)
            if answer.status != 200:
                raise RuntimeError(f"the replica answered {answer.status}")
    else:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))

        async def post() -> None:
            async with session.post(url + PATH, data=body, headers=HEADERS) as r:
                r.raise_for_status()
                await r.read()

    async def sender(n: int) -> None:
        for _ in range(n):
            await post()

    async with session:
        await sender(WARM_UP)  # connections
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(sender(requests // concurrency) for _ in range(concurrency)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    sent = requests // concurrency * concurrency
    return {"cpu_ms_per_request": cpu / sent * 1000, "req_per_s": sent / wall}


def cpu_s(pids: list[int]) -> float:
    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


def measured_load(url: str, pids: dict[str, list[int]], requests: int, concurrency: int):
    """``load``, with the CPU each part spent per request: replicas, router, load generator.
    The machine cannot serve more than cores / (CPU per request) requests a second, whatever
    the number of replicas: that ceiling is returned too."""
    before = {part: cpu_s(of_part) for part, of_part in pids.items()}
    own = time.process_time()
    run = asyncio.run(load(url, requests, concurrency))
    cpu = {part: cpu_s(of_part) - before[part] for part, of_part in pids.items()}
    cpu["load generator"] = time.process_time() - own
    sent = requests + WARM_UP
    run["cpu_ms_per_request"] = {part: t / sent * 1000 for part, t in cpu.items()}
    run["cpu_ceiling_req_per_s"] = (os.cpu_count() or 1) * sent / sum(cpu.values())
    return run


def start_router(urls: list[str], port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "distml.cli.serve", "router", "--port", str(port)]
    for url in urls:
        argv += ["--replica", url]
    proc = subprocess.Popen(argv, env={**os.environ, TOKEN_ENV: TOKEN})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", headers=AUTH)
            if r.status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the router did not become ready")


def deployment(checkpoint: Path, replicas: int, max_batch: int, fn) -> dict[str, Any]:
    """``fn(router_url, first_replica_url, pids)`` against a running deployment; ``pids``: the
    router's and the replicas' processes."""
    command = ReplicaCommand(str(checkpoint), "digits-cnn", max_batch_size=max_batch)
    with ReplicaSet(command, replicas, TOKEN) as replica_set:
        replica_set.wait_ready()
        port = free_port()
        router = start_router(replica_set.urls, port)
        pids = {
            "replicas": [p.popen.pid for p in replica_set.processes if p.popen is not None],
            "router": [router.pid],
        }
        try:
            return fn(f"http://127.0.0.1:{port}", replica_set.urls[0], pids)
        finally:
            router.terminate()
            router.wait(30)


PEERS_DIR = Path(__file__).resolve().parent / "peers"
REPO = PEERS_DIR.parents[1]
README_ROW = "distml serve, as the README starts it (2 replicas, one port)"
ROUTER_ROW = "distml serve --balance router (2 replicas)"
ROUTED_ROW = "distml serve --balance router --replicas 1"
DIRECT_ROW = "distml replica, batching"
UNBATCHED_ROW = "distml replica, no batching"


def peer_python(name: str) -> Path:
    """The Python of a virtual environment with ``peers/{name}-requirements.txt`` installed,
    made on first use under ``~/.cache/distml-bench`` and kept, keyed by the file's content."""
    requirements = PEERS_DIR / f"{name}-requirements.txt"
    key = hashlib.sha256(requirements.read_bytes()).hexdigest()[:12]
    venv = Path.home() / ".cache" / "distml-bench" / f"{name}-{key}"
    python = venv / "bin" / "python"
    if not (venv / "complete").exists():
        print(f"making the {name} environment in {venv} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        install = [str(python), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt")]
        subprocess.run([*install, "-r", str(requirements)], check=True)
        (venv / "complete").touch()
    return python


@dataclass
class Setup:
    """One server to measure: its command, the port it serves, and how to get it there."""

    label: str
    argv: list[str]
    port: int
    cwd: Path | None = None
    env: dict[str, str] = field(default_factory=dict)


def peer_setups(checkpoint: Path, tmp: Path) -> list[Setup]:
    """distml's rows and the peers' best single-worker settings, each on a fresh port."""
    distml = [sys.executable, "-m", "distml", "serve"]
    model = [str(checkpoint), "--model", "digits-cnn"]
    setups = []
    for label, extra in (
        (README_ROW, ["--replicas", "2"]),
        (ROUTER_ROW, ["--replicas", "2", "--balance", "router"]),
        (ROUTED_ROW, ["--replicas", "1", "--balance", "router"]),
    ):
        port = free_port()
        setups.append(Setup(label, [*distml, *model, *extra, "--port", str(port)], port))
    for label, extra in (
        (DIRECT_ROW, []),
        (UNBATCHED_ROW, ["--max-batch-size", "1"]),
    ):
        port = free_port()
        setups.append(Setup(label, [*distml, "replica", *model, *extra, "--port", str(port)], port))
    src = {"PYTHONPATH": str(REPO / "src")}  # distml.models: the same model class
    mlserver = peer_python("mlserver").parent / "mlserver"
    # 32 rows as distml's batches; MLServer batches adaptively only with a wait above 0: 2 ms.
    batching = {"max_batch_size": 32, "max_batch_time": 0.002}
    for label, settings, model_settings in (
        ("MLServer 1.7, default", {}, {}),
        ("MLServer 1.7, adaptive batching", {}, batching),
        ("MLServer 1.7, adaptive batching, no worker pool", {"parallel_workers": 0}, batching),
    ):
        port, folder = free_port(), tmp / f"mlserver-{len(setups)}"
        folder.mkdir()
        shutil.copy(PEERS_DIR / "mlserver_runtime.py", folder)
        ports = {"http_port": port, "grpc_port": free_port(), "metrics_port": free_port()}
        (folder / "settings.json").write_text(json.dumps({**ports, **settings}))
        runtime = {"name": "digits-cnn", "implementation": "mlserver_runtime.DigitsRuntime"}
        runtime["parameters"] = {"uri": str(checkpoint)}
        (folder / "model-settings.json").write_text(json.dumps({**runtime, **model_settings}))
        setups.append(Setup(label, [str(mlserver), "start", "."], port, folder, src))
    kserve = [str(peer_python("kserve")), str(PEERS_DIR / "kserve_server.py"), str(checkpoint)]
    for label, extra in (
        ("KServe 0.21, default", []),
        ("KServe 0.21, logging off", ["--enable_latency_logging", "false", "--configure_logging",
                                      "false"]),
    ):  # fmt: skip
        port = free_port()
        ports = ["--http_port", str(port), "--grpc_port", str(free_port())]
        setups.append(Setup(label, [*kserve, *ports, *extra], port, None, src))
    return setups


def process_tree(pid: int) -> list[int]:
    root = psutil.Process(pid)
    return [pid, *(child.pid for child in root.children(recursive=True))]


def serving(setup: Setup, logs: Path, fn):
    """``fn(url, pids)`` against ``setup``'s server once it answers ``/v2/health/ready``; the
    server and its children are stopped after."""
    env = {**os.environ, TOKEN_ENV: TOKEN, "OMP_NUM_THREADS": "1", **setup.env}
    log = logs / f"{setup.label.split(',')[0].replace(' ', '-')}-{setup.port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            setup.argv, cwd=setup.cwd, env=env, stdout=out, stderr=out, start_new_session=True
        )
    url = f"http://127.0.0.1:{setup.port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{setup.label} did not start:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/v2/health/ready", headers=AUTH).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        return fn(url, process_tree(proc.pid))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def peers_part(args: argparse.Namespace, checkpoint: Path, tmp: Path) -> dict[str, Any]:
    setups = peer_setups(checkpoint, tmp)
    logs = tmp / "logs"
    logs.mkdir()
    runs: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(args.repeats):  # interleaved, so that drift falls on every row
        for setup in setups:

            def measure(url: str, pids: list[int]) -> dict[str, Any]:
                busy = busy_cpu_s()
                run = measured_load(url, {"server": pids}, args.requests, args.concurrency)
                cpu = sum(run["cpu_ms_per_request"].values()) * (args.requests + WARM_UP) / 1000
                run["foreign_share"] = max(0.0, busy_cpu_s() - busy - cpu) / (
                    (args.requests / run["req_per_s"]) * (os.cpu_count() or 1)
                )
                return run

            run = serving(setup, logs, measure)
            runs.setdefault(setup.label, []).append(run)
            cpu = run["cpu_ms_per_request"]
            print(f"repeat {repeat} {setup.label}: {run['req_per_s']:,.0f} req/s, "
                  f"server {cpu['server']:.2f} ms CPU a request", flush=True)  # fmt: skip
    rows = {}
    for label, of_label in runs.items():
        mid = functools.partial(_median_of, of_label)
        rows[label] = {
            "req_per_s": mid(lambda r: r["req_per_s"]),
            "req_per_s_all": [r["req_per_s"] for r in of_label],
            "p50_ms": mid(lambda r: r["p50_ms"]),
            "p99_ms": mid(lambda r: r["p99_ms"]),
            "server_cpu_ms": mid(lambda r: r["cpu_ms_per_request"]["server"]),
            "client_cpu_ms": mid(lambda r: r["cpu_ms_per_request"]["load generator"]),
            "ceiling_share": mid(lambda r: r["req_per_s"] / r["cpu_ceiling_req_per_s"]),
            "foreign_share": mid(lambda r: r["foreign_share"]),
            "errors": sum(r["errors"] for r in of_label),
        }
    out: dict[str, Any] = {"rows": rows, "goals": peer_goals(runs)}
    print_table(
        f"Serving the digits CNN against MLServer and KServe, concurrency {args.concurrency}, "
        f"{args.requests} one-row requests, median of {args.repeats}",
        ["setup", "req/s", "p50 ms", "p99 ms", "server CPU ms", "of ceiling", "errors"],
        [
            [label, f"{r['req_per_s']:,.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
             f"{r['server_cpu_ms']:.2f}", f"{r['ceiling_share']:.2f}", str(r["errors"])]
            for label, r in rows.items()
        ],
    )  # fmt: skip
    print_table(
        "Goals, within each repeat (median; each repeat)",
        ["goal", "median", "each repeat"],
        [[g, f"{v['median']:.2f}", ", ".join(f"{x:.2f}" for x in v["each"])]
         for g, v in out["goals"].items()],
    )  # fmt: skip
    return out


def _median_of(runs: list[dict[str, Any]], f) -> float:
    return statistics.median(f(r) for r in runs)


def peer_goals(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The issue's ratios, each computed within a repeat (the rows of one repeat ran back to
    back), then their median."""
    readme, router = README_ROW, ROUTER_ROW
    peers = [k for k in runs if k.startswith(("MLServer", "KServe"))]
    one_pass = [k for k in peers if k.endswith("default")]  # one forward pass a request

    def total(r: dict[str, Any]) -> float:  # CPU a request, load generator included
        return sum(r["cpu_ms_per_request"].values())

    goals: dict[str, list[float]] = {}
    for i in range(len(runs[readme])):
        best_peer = max(runs[k][i]["req_per_s"] for k in peers)
        goals.setdefault("distml serve / best peer (>= 1.2)", []).append(
            runs[readme][i]["req_per_s"] / best_peer
        )
        goals.setdefault("--balance router / best peer", []).append(
            runs[router][i]["req_per_s"] / best_peer
        )
        unbatched = runs[UNBATCHED_ROW][i]["cpu_ms_per_request"]["server"]
        cheapest = min(runs[k][i]["cpu_ms_per_request"]["server"] for k in one_pass)
        goals.setdefault("replica without batching / peers' one pass, CPU (<= 1.0)", []).append(
            unbatched / cheapest
        )
        goals.setdefault("through the router / direct, CPU a request (<= 1.3)", []).append(
            total(runs[ROUTED_ROW][i]) / total(runs[DIRECT_ROW][i])
        )
        for label in (readme, router):
            r = runs[label][i]
            goals.setdefault(f"{label}: of the CPU ceiling (>= 0.9)", []).append(
                r["req_per_s"] / r["cpu_ceiling_req_per_s"]
            )
    return {g: {"median": statistics.median(v), "each": v} for g, v in goals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "peers", "replicas"), default="all")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--latency-requests", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ[TOKEN_ENV] = TOKEN
    out: dict[str, Any] = {"machine": machine_info(), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "model.safetensors"
        save_model(DigitsCNN(), str(checkpoint))
        if args.part in ("all", "peers"):
            out["peers"] = peers_part(args, checkpoint, Path(tmp))
        if args.part in ("all", "replicas"):
            out["replicas"] = replicas_part(args, checkpoint)
    print(f"results: {write_json('serving', out)}")


def replicas_part(args: argparse.Namespace, checkpoint: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": {}}
    repeats: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(args.repeats):  # interleaved, so that drift falls on every row
        for batching, max_batch in (("batched", 32), ("unbatched", 1)):
            for replicas in (1, 2):
                key = f"{replicas}x {batching}"
                run = deployment(
                    checkpoint,
                    replicas,
                    max_batch,
                    lambda router, _, pids: measured_load(
                        router, pids, args.requests, args.concurrency
                    ),
                )
                repeats.setdefault(key, []).append(run)
                print(f"repeat {repeat} {key}", run, flush=True)
    for key, runs_of_key in repeats.items():  # the run of median throughput, whole
        ranked = sorted(runs_of_key, key=lambda r: r["req_per_s"])
        out["runs"][key] = {
            **ranked[len(ranked) // 2],
            "req_per_s_all": [r["req_per_s"] for r in runs_of_key],
            "errors": sum(r["errors"] for r in runs_of_key),  # over every repeat
        }

    def overhead(router: str, replica: str, _pids) -> dict[str, Any]:
        n = args.latency_requests
        return {
            "direct": asyncio.run(load(replica, n, 1)),
            "router": asyncio.run(load(router, n, 1)),
        }

    out["router_overhead"] = deployment(checkpoint, 1, 1, overhead)

    def clients(_router: str, replica: str, _pids) -> dict[str, Any]:
        runs: dict[str, list[dict[str, float]]] = {"httpx": [], "aiohttp": [], "upstream": []}
        for _ in range(args.repeats):
            for name, of_client in runs.items():
                of_client.append(asyncio.run(client_cost(replica, name, 1000, args.concurrency)))
        return {
            name: {k: statistics.median(r[k] for r in of_client) for k in of_client[0]}
            for name, of_client in runs.items()
        }

    out["clients"] = deployment(checkpoint, 1, 32, clients)
    runs = out["runs"]
    for batching in ("batched", "unbatched"):
        one, two = runs[f"1x {batching}"], runs[f"2x {batching}"]
        out[f"speedup_{batching}"] = two["req_per_s"] / one["req_per_s"]
    o = out["router_overhead"]
    out["router_added_p50_ms"] = o["router"]["p50_ms"] - o["direct"]["p50_ms"]
    rows = [
        [k, f"{r['req_per_s']:,.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", str(r["errors"])]
        for k, r in runs.items()
    ]
    rows += [
        [f"1 request at a time, {k}", f"{r['req_per_s']:,.0f}", f"{r['p50_ms']:.2f}",
         f"{r['p99_ms']:.2f}", str(r["errors"])]
        for k, r in o.items()
    ]  # fmt: skip
    print_table(
        "CPU per request (ms) of each part, and the ceiling it sets: cores / total CPU per request",
        ["setup", "replicas", "router", "load generator", "ceiling req/s", "measured req/s"],
        [
            [k, *(f"{r['cpu_ms_per_request'][part]:.2f}" for part in
                  ("replicas", "router", "load generator")),
             f"{r['cpu_ceiling_req_per_s']:,.0f}", f"{r['req_per_s']:,.0f}"]
            for k, r in runs.items()
        ],
    )  # fmt: skip
    print_table(
        f"Serving the digits CNN, concurrency {args.concurrency} "
        f"(2 vs 1 replicas: {out['speedup_batched']:.2f}x batched, "
        f"{out['speedup_unbatched']:.2f}x unbatched; router adds "
        f"{out['router_added_p50_ms']:.2f} ms p50)",
        ["setup", "req/s", "p50 ms", "p99 ms", "errors"],
        rows,
    )
    print_table(
        f"HTTP clients against one replica, concurrency {args.concurrency}, 1,000 requests "
        f"(median of {args.repeats})",
        ["client", "CPU ms per request", "req/s"],
        [
            [name, f"{c['cpu_ms_per_request']:.2f}", f"{c['req_per_s']:,.0f}"]
            for name, c in out["clients"].items()
        ],
    )
    return out


if __name__ == "__main__":
    main()
