"""N replica processes on this machine, each on its own port, watched by a thread that restarts
any that dies (on the same port, so the router's list of replicas never changes). The router
takes a dead replica out of rotation on its own; restarting it is this file's only job.

With a shared address (``ReplicaCommand.shared``), every replica also serves one common port,
bound with ``SO_REUSEPORT``: the kernel spreads the clients' connections over the replicas, with
no router between them, and each replica's own port stays for its health and metrics.

With a gRPC port P, replica i also serves the KServe v2 gRPC API on port P + i (and again there
when restarted): the router speaks HTTP only, so gRPC clients reach the replicas directly or
through a gRPC load balancer of their own.

>>> with ReplicaSet(ReplicaCommand("runs/digits", model="digits-cnn"), 2, token) as replicas:
...     replicas.wait_ready(60)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from distml.launch.children import ChildProcess, stop_all
from distml.net import TOKEN_ENV
from distml.net.ports import listening_socket
from distml.serve.batching import MAX_BATCH_ROWS


@dataclass(frozen=True)
class ReplicaCommand:
    """What every replica serves, as ``distml serve replica`` options."""

    checkpoint: str
    model: str | None = None
    name: str | None = None
    max_batch_size: int = 32
    max_delay_ms: float = 0.0
    max_batch_rows: int = MAX_BATCH_ROWS
    grpc_port: int | None = None  # the first replica's; the others count up from it
    grpc_host: str = "127.0.0.1"
    shared: tuple[str, int] | None = None  # (host, port) every replica also serves

    def argv(self, port: int, grpc_port: int | None = None) -> list[str]:
        argv = [sys.executable, "-m", "distml.cli.serve", "replica", str(self.checkpoint)]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        if self.shared is not None:
            argv += ["--shared-host", self.shared[0], "--shared-port", str(self.shared[1])]
        if grpc_port is not None:
            argv += ["--grpc-port", str(grpc_port), "--grpc-host", self.grpc_host]
        argv += ["--max-batch-size", str(self.max_batch_size)]
        argv += ["--max-delay-ms", str(self.max_delay_ms)]
        argv += ["--max-batch-rows", str(self.max_batch_rows)]
        if self.model:
            argv += ["--model", self.model]
        if self.name:
            argv += ["--name", self.name]
        return argv


@dataclass(eq=False, kw_only=True)
class ReplicaProcess(ChildProcess):
    port: int = 0  # the port of the socket it is first handed
    grpc_port: int | None = None  # bound by the replica itself (gRPC binds its own port)

    def __post_init__(self) -> None:
        if self.listen:
            self.port = self.listen[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self, command: ReplicaCommand) -> list[str]:
        return command.argv(self.port, self.grpc_port)


class ReplicaSet:
    def __init__(
        self,
        command: ReplicaCommand,
        replicas: int,
        token: str,
        *,
        log_dir: Path | None = None,
        max_restarts: int = 100,
    ):
        if replicas < 1:
            raise ValueError("serve at least one replica")
        self.command = command
        self.max_restarts = max_restarts
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="distml-serve-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        first = command.grpc_port
        if first is not None and first + replicas - 1 > 65535:
            raise ValueError(f"{replicas} gRPC ports from {first} go past port 65535")
        shared = _shared_sockets(command.shared, replicas)
        self.processes = [
            ReplicaProcess(
                log_dir / f"replica-{i}.log",
                listen=[listening_socket(), *shared[i : i + 1]],
                grpc_port=None if first is None else first + i,
            )
            for i in range(replicas)
        ]
        if command.shared is not None:  # a free port chosen: the one a restart binds again
            self.command = replace(command, shared=(command.shared[0], shared[0].getsockname()[1]))
        # Replicas split the cores between them rather than each taking all of them.
        threads = max(1, (os.cpu_count() or 1) // replicas)
        self._env = {
            **os.environ,
            TOKEN_ENV: token,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
        }
        self._token = token
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._supervise, daemon=True)

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.processes]

    @property
    def shared_url(self) -> str | None:
        """The address every replica serves, when they share one (``ReplicaCommand.shared``)."""
        if self.command.shared is None:
            return None
        host, port = self.command.shared
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    @property
    def grpc_targets(self) -> list[str]:
        """``host:port`` of each replica's gRPC service; empty without a gRPC port."""
        host = self.command.grpc_host
        host = f"[{host}]" if ":" in host else host
        return [f"{host}:{p.grpc_port}" for p in self.processes if p.grpc_port is not None]

    def start(self) -> ReplicaSet:
        try:
            for p in self.processes:
                p.start(p.argv(self.command), self._env)
            self._watch.start()
        except BaseException:  # Ctrl-C halfway, say: those started stop (no __exit__ follows)
            stop_all(self.processes, 30.0)
            raise
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until every replica answers a real inference (``/v2/health/ready``)."""
        deadline = time.monotonic() + timeout_s
        headers = {"Authorization": f"Bearer {self._token}"}
        for p in self.processes:
            while True:
                if len(p.exits) >= 2:  # a replica that cannot start will not start
                    raise RuntimeError(f"replica on port {p.port} keeps exiting:\n{p.log_tail()}")
                try:
                    r = httpx.get(p.url + "/v2/health/ready", headers=headers, timeout=5)
                    if r.status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica on port {p.port} not ready:\n{p.log_tail()}")
                time.sleep(0.1)

    def _supervise(self) -> None:
        while not self._stop.wait(0.1):
            for p in self.processes:
                assert p.popen is not None
                code = p.popen.poll()
                if code is None or self._stop.is_set():
                    continue
                p.exits.append(code)
                if p.restarts >= self.max_restarts:
                    continue
                p.restarts += 1
                print(
                    f"replica on port {p.port} exited ({code}); restart {p.restarts}",
                    file=sys.stderr,
                )
                p.start(p.argv(self.command), self._env)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every replica (uvicorn finishes its requests in flight), then SIGKILL."""
        self._stop.set()
        if self._watch.is_alive():
            self._watch.join()
        stop_all(self.processes, timeout_s)

    def __enter__(self) -> ReplicaSet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _shared_sockets(shared: tuple[str, int] | None, replicas: int) -> list[socket.socket]:
    """A socket a replica on the shared address, bound here so that the port is taken (or
    found taken) before any replica starts; port 0: a free one, the same for every replica."""
    if shared is None:
        return []
    host, port = shared
    first = listening_socket(host, port, reuse_port=True)
    port = first.getsockname()[1]
    return [first, *(listening_socket(host, port, reuse_port=True) for _ in range(replicas - 1))]
