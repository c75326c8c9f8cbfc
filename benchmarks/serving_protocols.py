"""Serving: the Open Inference Protocol's three encodings, side by side, in one run.

    python benchmarks/serving_protocols.py                  # 3 interleaved repeats
    python benchmarks/serving_protocols.py --requests 400 --repeats 1

One replica of the digits CNN (a process of its own, as ``distml serve`` starts it, batching on,
computing on one thread so that the clients have the other core of a 2-core machine; set
``OMP_NUM_THREADS`` to change it) answers Triton's standard clients: ``tritonclient.http``
with JSON tensors, the same client in its default binary mode, and ``tritonclient.grpc``. For
a one-row request and a 64-row one: requests/s, p50 and p99 latency, and the CPU per request of
the replica and of the client, with ``--concurrency`` client threads each sending its next
request when the last one returns.
Goal: binary >= 3x JSON's requests/s on the 64-row input.

Beside them, in the same run: the model's forward pass alone on one thread, in the layout a
replica serves a convolutional model in (channels-last) and in the default one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from _common import machine_info, print_table, write_json
from safetensors.torch import save_model

from distml.jobs.replicas import ReplicaCommand, ReplicaSet
from distml.models import DigitsCNN
from distml.net import TOKEN_ENV
from distml.net.ports import free_port
from distml.serve.model import load_served_model

TOKEN = "benchmark-token-0123456789"
MODEL = "digits-cnn"
PROTOCOLS = ("json", "binary", "grpc")
WARM_UP = 10  # requests per client thread before the timed ones


def infer_once(protocol: str, client: Any, x: np.ndarray) -> None:
    """One request as the protocol's client sends it by default (JSON: binary turned off)."""
    if protocol == "grpc":
        tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        client.infer(MODEL, [tensor], headers={"authorization": f"Bearer {TOKEN}"})
        return
    binary = protocol == "binary"
    tensor = httpclient.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    output = httpclient.InferRequestedOutput("logits", binary_data=binary)
    # a fresh dict each call: the client writes its length header into the one it is given
    client.infer(MODEL, [tensor], outputs=[output], headers={"Authorization": f"Bearer {TOKEN}"})


def new_client(protocol: str, http_url: str, grpc_target: str) -> Any:
    if protocol == "grpc":
        return grpcclient.InferenceServerClient(grpc_target)
    return httpclient.InferenceServerClient(http_url.removeprefix("http://"))


def measure(
    protocol: str, rows: int, urls: tuple[str, str], replica_pid: int, args: argparse.Namespace
) -> dict[str, float]:
    x = np.random.default_rng(0).standard_normal((rows, 1, 8, 8), dtype=np.float32)
    per_thread = args.requests // args.concurrency
    latencies: list[float] = []
    lock = threading.Lock()
    started = threading.Barrier(args.concurrency + 1)

    def run() -> None:
        client = new_client(protocol, *urls)
        for _ in range(WARM_UP):
            infer_once(protocol, client, x)
        started.wait()
        mine = []
        for _ in range(per_thread):
            t = time.perf_counter()
            infer_once(protocol, client, x)
            mine.append(time.perf_counter() - t)
        with lock:
            latencies.extend(mine)
        client.close()

    threads = [threading.Thread(target=run) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    started.wait()
    replica = psutil.Process(replica_pid)
    replica_cpu, own_cpu = sum(replica.cpu_times()[:2]), time.process_time()
    wall = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - wall
    replica_cpu = sum(replica.cpu_times()[:2]) - replica_cpu
    own_cpu = time.process_time() - own_cpu
    n = len(latencies)
    q = statistics.quantiles(latencies, n=100)
    return {
        "req_per_s": n / wall,
        "p50_ms": q[49] * 1000,
        "p99_ms": q[98] * 1000,
        "replica_cpu_ms": replica_cpu / n * 1000,
        "client_cpu_ms": own_cpu / n * 1000,  # warm-up excluded; thread start-up included
    }


def forward_ms(checkpoint: Path, rows: int, repeats: int = 200) -> dict[str, float]:
    """The median forward time of ``rows`` rows on one thread, as served (channels-last) and as
    the plain module runs it (contiguous)."""
    served = load_served_model(checkpoint, MODEL)
    plain = DigitsCNN().eval()
    plain.load_state_dict(served.module.state_dict())
    x = torch.randn(rows, 1, 8, 8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"served_ms": [], "contiguous_ms": []}
    try:
        with torch.inference_mode():
            for _ in range(20):
                served.predict(x), plain(x)
            for _ in range(repeats):  # interleaved, so that drift falls on both
                for key, run in (("served_ms", served.predict), ("contiguous_ms", plain)):
                    t = time.perf_counter()
                    run(x)
                    times[key].append((time.perf_counter() - t) * 1000)
    finally:
        torch.set_num_threads(threads)
    return {key: statistics.median(ts) for key, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ[TOKEN_ENV] = TOKEN
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the replica's threads (ReplicaSet reads it)
    runs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "model.safetensors"
        save_model(DigitsCNN(), str(checkpoint))
        layouts = {rows: forward_ms(checkpoint, rows) for rows in (1, 64)}
        command = ReplicaCommand(str(checkpoint), MODEL, grpc_port=free_port())
        with ReplicaSet(command, 1, TOKEN) as replicas:
            replicas.wait_ready()
            urls = (replicas.urls[0], replicas.grpc_targets[0])
            pid = next(p.popen.pid for p in replicas.processes if p.popen is not None)
            for repeat in range(args.repeats):  # interleaved, so that drift falls on every row
                for rows in (1, 64):
                    for protocol in PROTOCOLS:
                        run = measure(protocol, rows, urls, pid, args)
                        runs.setdefault(f"{protocol} x{rows}", []).append(run)
                        print(f"repeat {repeat} {protocol} {rows} rows", run, flush=True)
    medians = {
        key: {field: statistics.median(r[field] for r in rs) for field in rs[0]}
        for key, rs in runs.items()
    }
    rows_out = []
    for key, m in medians.items():
        protocol, rows = key.split(" x")
        vs_json = m["req_per_s"] / medians[f"json x{rows}"]["req_per_s"]
        rows_out.append(
            [protocol, rows, f"{m['req_per_s']:,.0f}", f"{m['p50_ms']:.2f}", f"{m['p99_ms']:.2f}",
             f"{m['replica_cpu_ms']:.2f}", f"{m['client_cpu_ms']:.2f}", f"{vs_json:.2f}"]
        )  # fmt: skip
    print_table(
        "One replica, Triton's clients: JSON vs binary vs gRPC",
        ["protocol", "rows", "req/s", "p50 ms", "p99 ms", "replica CPU ms", "client CPU ms",
         "vs JSON"],
        rows_out,
    )  # fmt: skip
    print_table(
        "The model alone, one thread: the served layout against the default",
        ["rows", "channels-last ms", "contiguous ms", "speed-up"],
        [[str(r), f"{m['served_ms']:.3f}", f"{m['contiguous_ms']:.3f}",
          f"{m['contiguous_ms'] / m['served_ms']:.2f}"] for r, m in layouts.items()],
    )  # fmt: skip
    write_json(
        "serving_protocols",
        {"machine": machine_info(), "args": vars(args), "replica_threads":
         os.environ["OMP_NUM_THREADS"], "medians": medians, "runs": runs, "forward": layouts},
    )  # fmt: skip


if __name__ == "__main__":
    main()
