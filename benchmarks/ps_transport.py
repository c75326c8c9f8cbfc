"""Parameter-server transport: a worker's push and pull, in parts, against a plain socket.

    python benchmarks/ps_transport.py                    # both models, 3 interleaved repeats
    python benchmarks/ps_transport.py --model cnn --repeats 5 --exchanges 400

One shard (``distml.ps.app`` on uvicorn, ASP, one worker) in a process of its own, and a worker
in this one, for the digits CNN (153 KB of parameters) and an MLP of 8.4 M parameters (34 MB).
A step is the worker's whole exchange: encode its gradient, send it, the shard applies it and
answers the parameters, the worker decodes them and copies them into its model.

Rows, interleaved in every repeat:
- ``socket floor``: the same bytes both ways through a plain TCP socket on loopback, to a
  process that reads the push and writes back an answer of the parameters' size.
- ``distml step``: what the worker does now, one ``POST /v1/step`` with ``KeepAliveClient``.
- ``distml push + pull``: the same client, the push and the pull as two requests.
- ``httpx push + pull``: the worker before, httpx's sync ``Client`` and two requests.
- ``httpx``/``urllib3``/``aiohttp step``: the other clients on the one-exchange protocol
  (aiohttp from a sync worker: an event loop in a thread, as a worker would have to run it).
- ``distml step, 2 shards``: the parameters split over two shards (as the job places them),
  the two requests sent before either answer is read (what the worker does), or each from a
  thread of its own (a pool of two).
- with ``--server-stacks``, ``distml step`` against a shard whose step route is answered
  behind ASGI (``distml.net.hot_path``, the way before ``distml.net.hot_protocol``); against a
  shard on uvicorn's pure-Python stack (h11, asyncio), for the cost of running it without
  httptools and uvloop; and against a shard whose process has glibc's default malloc (not the
  job's ``PROCESS_ENV``).

Per step: wall time, this process's CPU (every thread) and the shard's (from /proc). Then the
parts of one ``distml step``: the worker's encode, send, answer (the shard's work, the transfer
back and reading it), decode and copy, timed in the worker; the shard's decode, check and
apply, encode, timed on the same code in a process of their own (with the shard's
environment); and the shard's CPU that is none of those (HTTP and ASGI). Last, the CPU
of the step's forward and backward pass (digits: batch 32; the MLP: batch 4), and the share of
a step's CPU, both sides, that the exchange is; and the codec against safetensors' own
``save`` and ``load``. Medians over repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import httpx
import psutil
import torch
import urllib3
from _common import machine_info, print_table, write_json
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from distml.models import MLP, DigitsCNN
from distml.net import TOKEN_ENV, decode_tensors, encode_tensors
from distml.net.client import KeepAliveClient
from distml.net.ports import free_port
from distml.net.tensors import tensor_parts
from distml.ps.optimizer_spec import describe_optimizer
from distml.ps.placement import place_parameters
from distml.ps.shard import PROCESS_ENV, ParameterShard, ShardSettings

TOKEN = "benchmark-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "cnn": DigitsCNN,
    "8m": lambda: MLP((1024, 2048, 2048, 1024, 10)),
}
EXCHANGES = {"cnn": 200, "8m": 8}  # timed steps per row and repeat
BATCHES = {"cnn": (32, (1, 8, 8)), "8m": (4, (1024,))}  # the batch of a step: size, sample shape
WARM_UP = 3
CLOSE: list[Callable[[], Any]] = []  # what the rows opened, closed at the end


# -- the processes on the other side ---------------------------------------------------------
def serve_shard(port: int, http: str, loop: str) -> None:
    """One ASP shard for one worker, on uvicorn with the given HTTP parser and event loop;
    ``auto`` serves as distml does, the step route in uvicorn's protocol
    (``distml.net.hot_protocol``)."""
    import uvicorn  # only the shard's process serves

    from distml.net.hot_protocol import http_protocol
    from distml.ps.app import create_shard_app

    torch.set_num_threads(1)
    shard = ParameterShard(ShardSettings(consistency="asp", workers=1, heartbeat_timeout_s=3600))
    app = create_shard_app(shard, os.environ[TOKEN_ENV])
    protocol = http_protocol(app) if http == "auto" else http
    uvicorn.run(app, host="127.0.0.1", port=port, http=protocol, loop=loop, log_level="warning")


def serve_floor(port: int) -> None:
    """Read a push of the announced size, write back an answer of the announced size."""
    listener = socket.create_server(("127.0.0.1", port))
    answer, inbox = bytearray(), bytearray()
    while True:  # one connection at a time, each until its client closes it
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while head := _read_exactly(conn, 16):
            push, size = int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little")
            if len(inbox) < push:
                inbox = bytearray(push)
            _read_into(conn, memoryview(inbox)[:push])
            if len(answer) != size:
                answer = bytearray(size)
            conn.sendall(answer)
        conn.close()


def _read_exactly(conn: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    return buf if _read_into(conn, memoryview(buf)) else None


def _read_into(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


class Child:
    """A server process of this benchmark, and its CPU time."""

    def __init__(self, *argv: str, malloc: dict[str, str] = PROCESS_ENV):
        self.port = free_port()
        # The shard's process environment, as the parameter-server job sets it.
        env = {**os.environ, TOKEN_ENV: TOKEN, "OMP_NUM_THREADS": "1", **malloc}
        cmd = [sys.executable, __file__, *argv, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, env=env)
        self.ps = psutil.Process(self.proc.pid)
        self.url = f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        times = self.ps.cpu_times()
        return times.user + times.system

    def wait_listening(self) -> None:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server on port {self.port} did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class Shards:
    """Several shard processes, as one server of the rows (their CPU time added up)."""

    def __init__(self, children: list[Child]):
        self.children = children

    def cpu_s(self) -> float:
        return sum(child.cpu_s() for child in self.children)


# -- the worker's side ---------------------------------------------------------------------
class Worker:
    """A model, its gradients, and the shard it talks to (the shard initialised by it)."""

    def __init__(self, model_name: str, *shards: Child):
        torch.manual_seed(0)
        self.model = MODELS[model_name]()
        self.params = dict(self.model.named_parameters())
        self.grads = {n: torch.randn_like(p) * 1e-4 for n, p in self.params.items()}
        self.url = shards[0].url
        self.urls = [shard.url for shard in shards]
        self.placement = place_parameters(self.params, len(shards))
        self.step = 0
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        spec = json.dumps(describe_optimizer(optimizer, {id(p): n for n, p in self.params.items()}))
        for url, names in zip(self.urls, self.placement, strict=True):
            body = encode_tensors({n: self.params[n].detach() for n in names}, {"optimizer": spec})
            httpx.post(f"{url}/v1/init", params={"worker": 0}, content=body, headers=AUTH)

    def grads_of(self, k: int) -> dict[str, torch.Tensor]:
        return {n: self.grads[n] for n in self.placement[k]}

    def next_query(self, **extra: Any) -> dict[str, Any]:
        self.step += 1
        return {"worker": 0, "step": self.step - 1, "version": 0, **extra}

    def take(self, body: bytes | bytearray | memoryview) -> None:
        tensors, _ = decode_tensors(body)
        with torch.no_grad():
            for name, value in tensors.items():
                self.params[name].copy_(value)


def distml_step(w: Worker) -> Callable[[], None]:
    client, buffer = KeepAliveClient(w.url, TOKEN), bytearray()
    CLOSE.append(client.close)

    def step() -> None:
        query = w.next_query(wait_s=30)
        body = tensor_parts(w.grads)
        w.take(client.request("POST", "/v1/step", params=query, content=body, into=buffer).content)

    return step


def distml_push_pull(w: Worker) -> Callable[[], None]:
    client = KeepAliveClient(w.url, TOKEN)
    CLOSE.append(client.close)

    def step() -> None:
        client.request("POST", "/v1/push", params=w.next_query(), content=tensor_parts(w.grads))
        w.take(client.request("GET", "/v1/params", params={"worker": 0}).content)

    return step


def httpx_push_pull(w: Worker) -> Callable[[], None]:
    client = httpx.Client(base_url=w.url, headers=AUTH, timeout=60)
    CLOSE.append(client.close)

    def step() -> None:
        client.post("/v1/push", params=w.next_query(), content=encode_tensors(w.grads))
        w.take(client.get("/v1/params", params={"worker": 0}).content)

    return step


def httpx_step(w: Worker) -> Callable[[], None]:
    client = httpx.Client(base_url=w.url, headers=AUTH, timeout=60)
    CLOSE.append(client.close)

    def step() -> None:
        query = w.next_query(wait_s=30)
        w.take(client.post("/v1/step", params=query, content=encode_tensors(w.grads)).content)

    return step


def urllib3_step(w: Worker) -> Callable[[], None]:
    pool = urllib3.HTTPConnectionPool("127.0.0.1", int(w.url.rsplit(":", 1)[1]), headers=AUTH)
    CLOSE.append(pool.close)

    def step() -> None:
        query = "&".join(f"{k}={v}" for k, v in w.next_query(wait_s=30).items())
        answer = pool.request("POST", f"/v1/step?{query}", body=encode_tensors(w.grads))
        w.take(answer.data)

    return step


def aiohttp_step(w: Worker) -> Callable[[], None]:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="aiohttp").start()

    async def open_session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(headers=AUTH)

    session = asyncio.run_coroutine_threadsafe(open_session(), loop).result()
    CLOSE.append(lambda: asyncio.run_coroutine_threadsafe(session.close(), loop).result())

    async def exchange(query: dict[str, Any], body: bytes) -> bytes:
        async with session.post(f"{w.url}/v1/step", params=query, data=body) as answer:
            return await answer.read()

    def step() -> None:
        query = w.next_query(wait_s=30)
        body = encode_tensors(w.grads)
        w.take(asyncio.run_coroutine_threadsafe(exchange(query, body), loop).result())

    return step


def sharded_together(w: Worker) -> Callable[[], None]:
    clients = [KeepAliveClient(url, TOKEN) for url in w.urls]
    buffers = [bytearray() for _ in w.urls]
    CLOSE.extend(client.close for client in clients)

    def step() -> None:
        query = w.next_query(wait_s=30)
        pending = [
            c.send("POST", "/v1/step", params=query, content=tensor_parts(w.grads_of(k)))
            for k, c in enumerate(clients)
        ]
        for client, p, buffer in zip(clients, pending, buffers, strict=True):
            w.take(client.receive(p, into=buffer).content)

    return step


def sharded_threads(w: Worker) -> Callable[[], None]:
    clients = [KeepAliveClient(url, TOKEN) for url in w.urls]
    buffers = [bytearray() for _ in w.urls]
    pool = ThreadPoolExecutor(len(clients))
    CLOSE.extend([*(client.close for client in clients), pool.shutdown])

    def step() -> None:
        query = w.next_query(wait_s=30)

        def one(k: int) -> None:
            body = tensor_parts(w.grads_of(k))
            answer = clients[k].request(
                "POST", "/v1/step", params=query, content=body, into=buffers[k]
            )
            w.take(answer.content)

        list(pool.map(one, range(len(clients))))

    return step


def floor_step(w: Worker, floor: Child) -> Callable[[], None]:
    push = len(encode_tensors(w.grads))
    size = len(encode_tensors({n: p.detach() for n, p in w.params.items()}))
    conn = socket.create_connection(("127.0.0.1", floor.port))
    CLOSE.append(conn.close)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = bytes(push)
    answer = bytearray(size)

    def step() -> None:
        conn.sendall(push.to_bytes(8, "little") + size.to_bytes(8, "little"))
        conn.sendall(body)
        _read_into(conn, memoryview(answer))

    return step


ROWS: dict[str, Callable[[Worker], Callable[[], None]]] = {
    "distml step": distml_step,
    "distml push + pull": distml_push_pull,
    "httpx push + pull": httpx_push_pull,
    "httpx step": httpx_step,
    "urllib3 step": urllib3_step,
    "aiohttp step": aiohttp_step,
}


def timed(step: Callable[[], None], server: Child | Shards, n: int) -> dict[str, float]:
    """Per step, in ms: wall time, this process's CPU, the server's CPU."""
    for _ in range(WARM_UP):
        step()
    server0, cpu0, t0 = server.cpu_s(), time.process_time(), time.perf_counter()
    for _ in range(n):
        step()
    wall, cpu, server_cpu = (
        time.perf_counter() - t0,
        time.process_time() - cpu0,
        server.cpu_s() - server0,
    )
    return {
        "wall_ms": wall / n * 1e3,
        "cpu_ms": cpu / n * 1e3,
        "server_cpu_ms": server_cpu / n * 1e3,
    }


def client_parts(w: Worker, n: int) -> dict[str, float]:
    """The worker's side of ``distml step``, part by part (ms per step)."""
    client, buffer = KeepAliveClient(w.url, TOKEN), bytearray()
    parts = dict.fromkeys(["encode", "send", "answer", "decode", "copy"], 0.0)
    for i in range(WARM_UP + n):
        marks = [time.perf_counter()]
        body = tensor_parts(w.grads)
        marks.append(time.perf_counter())
        pending = client.send("POST", "/v1/step", params=w.next_query(wait_s=30), content=body)
        marks.append(time.perf_counter())
        answer = client.receive(pending, into=buffer)
        marks.append(time.perf_counter())
        tensors, _ = decode_tensors(answer.content)
        marks.append(time.perf_counter())
        with torch.no_grad():
            for name, value in tensors.items():
                w.params[name].copy_(value)
        marks.append(time.perf_counter())
        if i >= WARM_UP:
            for key, a, b in zip(parts, marks, marks[1:], strict=False):
                parts[key] += (b - a) * 1e3 / n
    client.close()
    return parts


def server_parts(model_name: str, n: int) -> dict[str, float]:
    """The shard's own work for one step (ms), on the shard's code, in a process with the
    shard's environment: decode the body, check and apply the gradient, encode the
    parameters."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **PROCESS_ENV}
    cmd = [sys.executable, __file__, "--server-parts", model_name, "--exchanges", str(n)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def time_server_parts(model_name: str, n: int) -> dict[str, float]:
    torch.set_num_threads(1)
    model = MODELS[model_name]()
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    spec = describe_optimizer(optimizer, {id(p): n for n, p in params.items()})
    shard = ParameterShard(ShardSettings(consistency="asp", workers=1, heartbeat_timeout_s=3600))
    body = encode_tensors({n: torch.randn_like(p) * 1e-4 for n, p in params.items()})
    parts = {"decode": 0.0, "check + apply": 0.0, "encode": 0.0}

    async def run() -> None:
        await shard.initialize({k: p.detach() for k, p in params.items()}, spec)
        for i in range(WARM_UP + n):
            buffer = bytearray(body)  # what the shard reads the body into
            t0 = time.perf_counter()
            grads, _ = decode_tensors(buffer)
            t1 = time.perf_counter()
            await shard.push(0, i, shard.version, grads)
            t2 = time.perf_counter()
            async with shard.lock:
                shard.encoded_params()
            t3 = time.perf_counter()
            if i >= WARM_UP:
                for key, a, b in zip(parts, (t0, t1, t2), (t1, t2, t3), strict=True):
                    parts[key] += (b - a) * 1e3 / n

    asyncio.run(run())
    return parts


def codec_us(model_name: str, n: int) -> dict[str, float]:
    """Encoding and decoding a model's tensors (us): distml's codec and safetensors' own."""
    tensors = {k: p.detach() for k, p in MODELS[model_name]().named_parameters()}
    body = encode_tensors(tensors)
    cases = {
        "safetensors save": lambda: safetensors_save(tensors),
        "distml encode_tensors": lambda: encode_tensors(tensors),
        "distml tensor_parts (no copy)": lambda: tensor_parts(tensors),
        "safetensors load": lambda: safetensors_load(body),
        "distml decode_tensors, bytes (one copy)": lambda: decode_tensors(body),
        "distml decode_tensors, bytearray (views)": lambda: decode_tensors(buffer),
    }
    buffer = bytearray(body)
    times = {}
    for name, case in cases.items():
        case()
        start = time.perf_counter()
        for _ in range(n):
            case()
        times[name] = (time.perf_counter() - start) / n * 1e6
    return times


def compute_ms(model_name: str, n: int) -> float:
    """CPU time of one step's forward and backward pass (one thread), for the share of a step
    that the exchange is."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    size, shape = BATCHES[model_name]
    x, y = torch.randn(size, *shape), torch.randint(0, 10, (size,))
    for i in range(WARM_UP + n):
        if i == WARM_UP:
            start = time.process_time()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)
    return (time.process_time() - start) / n * 1e3


def measure(model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    n = args.exchanges or EXCHANGES[model_name]
    shard, floor = Child("--serve", "auto", "auto"), Child("--floor")
    pair = Shards([Child("--serve", "auto", "auto"), Child("--serve", "auto", "auto")])
    stacks = {"auto": shard}
    if args.server_stacks:
        stacks["ASGI hot path"] = Child("--serve", "httptools", "uvloop")
        stacks["h11/asyncio"] = Child("--serve", "h11", "asyncio")
        stacks["default malloc"] = Child("--serve", "auto", "auto", malloc={})
    children = [*stacks.values(), floor, *pair.children]
    try:
        for child in children:
            child.wait_listening()
        workers = {name: Worker(model_name, child) for name, child in stacks.items()}
        w = workers["auto"]
        rows: dict[str, tuple[Callable[[], None], Child | Shards]]
        rows = {"socket floor": (floor_step(w, floor), floor)}
        rows |= {name: (make(w), shard) for name, make in ROWS.items()}
        two = Worker(model_name, *pair.children)
        rows["distml step, 2 shards, sent together"] = (sharded_together(two), pair)
        rows["distml step, 2 shards, a thread each"] = (sharded_threads(two), pair)
        for stack, worker in workers.items():
            if stack != "auto":
                rows[f"distml step, {stack} shard"] = (distml_step(worker), stacks[stack])
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in rows}
        parts: list[dict[str, float]] = []
        for repeat in range(args.repeats):
            for name, (step, server) in rows.items():
                samples[name].append(timed(step, server, n))
            parts.append(client_parts(w, n))
            print(f"{model_name}: repeat {repeat + 1} of {args.repeats}", file=sys.stderr)
        stats = httpx.get(f"{shard.url}/v1/stats", headers=AUTH).json()
    finally:
        while CLOSE:
            CLOSE.pop()()
        for child in children:
            child.stop()
    medians = {
        name: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
        for name, runs in samples.items()
    }
    worker_parts = {key: statistics.median(p[key] for p in parts) for key in parts[0]}
    compute = compute_ms(model_name, max(n, 20))
    codec = codec_us(model_name, max(n, 20))
    transport = medians["distml step"]["cpu_ms"] + medians["distml step"]["server_cpu_ms"]
    shard_parts = server_parts(model_name, n)
    shard_parts["queue (lock)"] = stats["queue_s"]["median"] * 1e3
    shard_parts["HTTP and ASGI (the rest of its CPU)"] = max(
        0.0, medians["distml step"]["server_cpu_ms"] - sum(shard_parts.values())
    )
    return {
        "model": model_name,
        "param_bytes": stats["param_bytes"],
        "exchanges": n,
        "rows": medians,
        "samples": samples,
        "worker_parts": worker_parts,
        "shard_parts": shard_parts,
        "compute_cpu_ms": compute,
        "codec_us": codec,
        "transport_cpu_share": transport / (transport + compute),
    }


def report(result: dict[str, Any]) -> None:
    rows, floor = result["rows"], result["rows"]["socket floor"]
    mb = result["param_bytes"] / 1e6
    print_table(
        f"{result['model']} ({mb:.2f} MB each way): one step, median of repeats (ms)",
        ["path", "wall", "worker CPU", "server CPU", "CPU, both", "wall vs floor"],
        [
            [
                name,
                f"{r['wall_ms']:.3f}",
                f"{r['cpu_ms']:.3f}",
                f"{r['server_cpu_ms']:.3f}",
                f"{r['cpu_ms'] + r['server_cpu_ms']:.3f}",
                f"{r['wall_ms'] / floor['wall_ms']:.2f}",
            ]
            for name, r in rows.items()
        ],
    )
    parts = [("worker", k, v) for k, v in result["worker_parts"].items()]
    parts += [("shard", k, v) for k, v in result["shard_parts"].items()]
    print_table(
        f"{result['model']}: the parts of one distml step (ms)",
        ["side", "part", "ms"],
        [[side, part, f"{ms:.3f}"] for side, part, ms in parts],
    )
    print_table(
        f"{result['model']}: encoding and decoding the parameters (us)",
        ["codec", "us"],
        [[name, f"{us:,.1f}"] for name, us in result["codec_us"].items()],
    )
    size = BATCHES[result["model"]][0]
    print(
        f"{result['model']}: forward and backward of a batch of {size}: "
        f"{result['compute_cpu_ms']:.3f} ms CPU; a distml step's exchange is "
        f"{result['transport_cpu_share']:.0%} of the step's CPU, both sides"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--exchanges", type=int, default=0, help="timed steps per row; 0: default")
    parser.add_argument(
        "--server-stacks", action="store_true", help="also a shard on h11 and asyncio"
    )
    parser.add_argument("--serve", nargs=2, metavar=("HTTP", "LOOP"), help=argparse.SUPPRESS)
    parser.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--server-parts", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve_shard(args.port, *args.serve)
    if args.floor:
        return serve_floor(args.port)
    if args.server_parts:
        n = args.exchanges or EXCHANGES[args.server_parts]
        return print(json.dumps(time_server_parts(args.server_parts, n)))
    torch.set_num_threads(1)
    out: dict[str, Any] = {"machine": machine_info(), "args": vars(args), "models": []}
    for model_name in MODELS if args.model == "both" else [args.model]:
        result = measure(model_name, args)
        report(result)
        out["models"].append(result)
    print(f"results: {write_json('ps_transport', out)}")


if __name__ == "__main__":
    main()
