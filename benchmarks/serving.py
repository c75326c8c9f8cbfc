"""Serving: throughput and latency of ``distml serve`` under a closed-loop load, in one run.

    python benchmarks/serving.py                       # all rows, 3 interleaved repeats
    python benchmarks/serving.py --requests 2000 --concurrency 32 --repeats 1

The digits CNN, one-row requests over loopback. Rows: 1 vs 2 replicas behind the router, each
with dynamic batching (max 32 rows, 2 ms) and without (max 1 row); and the router's added
latency, one request at a time, direct to a replica vs through the router; and the CPU per
request of the two HTTP clients (httpx, which the router used to call its replicas with, and
aiohttp, which it uses now) against one replica. The load generator (aiohttp,
``--concurrency`` clients each sending its next request when the last one
returns) runs in this process; replicas and router are processes of their own, as
``distml serve`` starts them. Goal: 2 replicas >= 1.7x the throughput of 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
import torch
from _common import machine_info, print_table, write_json
from safetensors.torch import save_model

from distml.jobs.replicas import ReplicaCommand, ReplicaSet
from distml.models import DigitsCNN
from distml.net import TOKEN_ENV
from distml.net.ports import free_port

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
    ``concurrency`` through httpx's AsyncClient or aiohttp's ClientSession: what the router
    spends calling its replicas, and what a load generator spends."""
    body = request_body()
    if client == "httpx":
        limits = httpx.Limits(max_connections=concurrency)
        session: Any = httpx.AsyncClient(limits=limits, timeout=60)

        async def post() -> None:
            (await session.post(url + PATH, content=body, headers=HEADERS)).raise_for_status()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--latency-requests", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ[TOKEN_ENV] = TOKEN
    out: dict[str, Any] = {"machine": machine_info(), "args": vars(args), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "model.safetensors"
        save_model(DigitsCNN(), str(checkpoint))
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
            runs: dict[str, list[dict[str, float]]] = {"httpx": [], "aiohttp": []}
            for _ in range(args.repeats):
                for name, of_client in runs.items():
                    of_client.append(
                        asyncio.run(client_cost(replica, name, 1000, args.concurrency))
                    )
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
    print(f"results: {write_json('serving', out)}")


if __name__ == "__main__":
    main()
