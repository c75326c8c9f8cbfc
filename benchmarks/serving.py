"""Serving: throughput and latency of ``distml serve`` under a closed-loop load, in one run.

    python benchmarks/serving.py                       # all rows, 3 interleaved repeats
    python benchmarks/serving.py --requests 2000 --concurrency 32 --repeats 1

The digits CNN, one-row requests over loopback. Rows: 1 vs 2 replicas behind the router, each
with dynamic batching (max 32 rows, 2 ms) and without (max 1 row); and the router's added
latency, one request at a time, direct to a replica vs through the router. The load generator
(httpx.AsyncClient, ``--concurrency`` clients each sending its next request when the last one
returns) runs in this process; replicas and router are processes of their own, as
``distml serve`` starts them. Goal: 2 replicas >= 1.7x the throughput of 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from _common import machine_info, print_table, write_json
from safetensors.torch import save_model

from distml.launch.elastic import free_port
from distml.models import DigitsCNN
from distml.net import TOKEN_ENV
from distml.serve.supervisor import ReplicaCommand, ReplicaSet

TOKEN = "benchmark-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PATH = "/v2/models/digits-cnn/infer"


async def load(url: str, requests: int, concurrency: int) -> dict[str, Any]:
    x = torch.randn(1, 1, 8, 8).flatten().tolist()
    payload = {"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": x}]}
    latencies: list[float] = []
    errors = 0
    remaining = requests

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal remaining, errors
        while remaining > 0:
            remaining -= 1
            start = time.perf_counter()
            r = await http.post(PATH, json=payload)
            latencies.append(time.perf_counter() - start)
            errors += r.status_code != 200

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, limits=limits, timeout=60) as http:
        for _ in range(20):  # warm-up: connections, first batches
            await http.post(PATH, json=payload)
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
    command = ReplicaCommand(str(checkpoint), "digits-cnn", max_batch_size=max_batch)
    with ReplicaSet(command, replicas, TOKEN) as replica_set:
        replica_set.wait_ready()
        port = free_port()
        router = start_router(replica_set.urls, port)
        try:
            return fn(f"http://127.0.0.1:{port}", replica_set.urls[0])
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
                        lambda router, _: asyncio.run(
                            load(router, args.requests, args.concurrency)
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

        def overhead(router: str, replica: str) -> dict[str, Any]:
            n = args.latency_requests
            return {
                "direct": asyncio.run(load(replica, n, 1)),
                "router": asyncio.run(load(router, n, 1)),
            }

        out["router_overhead"] = deployment(checkpoint, 1, 1, overhead)
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
        f"Serving the digits CNN, concurrency {args.concurrency} "
        f"(2 vs 1 replicas: {out['speedup_batched']:.2f}x batched, "
        f"{out['speedup_unbatched']:.2f}x unbatched; router adds "
        f"{out['router_added_p50_ms']:.2f} ms p50)",
        ["setup", "req/s", "p50 ms", "p99 ms", "errors"],
        rows,
    )
    print(f"results: {write_json('serving', out)}")


if __name__ == "__main__":
    main()
