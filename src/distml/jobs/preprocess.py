"""``preprocess()``: a coordinator in this process, N local worker processes, one output folder.

>>> from distml.data.preprocess import CsvSource, preprocess
>>> result = preprocess(CsvSource(path="rows.csv"), "features.py:transform", "out/", workers=2)
... # doctest: +SKIP
>>> result.manifest["rows"]                                                   # doctest: +SKIP

The local workers are restarted when they die, and a shard they held is handed out again once its
lease runs out; workers on other machines can join the same job (``distml preprocess worker``)
while it runs. A rerun of a job that stopped (killed, or failed on one bad shard) with the same
source and transform skips every shard already committed.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from distml.data.preprocess.coordinator import Coordinator, create_coordinator_app
from distml.data.preprocess.output import TMP, OutputDir
from distml.data.preprocess.queue import ShardQueue
from distml.data.preprocess.sources import SQL_PASSWORD_ENV, Source, SqlSource, plan
from distml.data.preprocess.worker import worker_name
from distml.launch.children import ChildProcess, stop_all
from distml.net import TOKEN_ENV, BackgroundServer


class PreprocessError(RuntimeError):
    """The job stopped before every shard was done; the shards committed so far are kept."""


@dataclass
class PreprocessResult:
    manifest: dict[str, Any]
    seconds: float
    skipped: int  # shards an earlier run had already committed
    worker_restarts: int

    @property
    def stats(self) -> dict[str, Any]:
        return self.manifest["stats"]


def describe_job(source: Source, transform: str, shards: list[dict]) -> dict[str, Any]:
    """What ``_job.json`` records. The fingerprint covers the plan itself, so a changed input
    (another size, other row groups) is a different job; a SQL password is hashed, never written."""
    record = source.model_dump()
    if isinstance(source, SqlSource):
        record["url"] = source.safe_url()
    digest = hashlib.sha256(json.dumps([transform, shards], sort_keys=True).encode()).hexdigest()
    return {"source": record, "transform": transform, "shards": len(shards), "fingerprint": digest}


def preprocess(
    source: Source,
    transform: str,
    out: Path | str,
    *,
    workers: int = 2,
    lease_s: float = 30.0,
    max_attempts: int = 3,
    speculate_after: float = 2.0,
    host: str = "127.0.0.1",
    port: int | None = None,
    token: str | None = None,
    on_started: Any = None,
) -> PreprocessResult:
    """Run ``transform`` (``module:function`` or ``file.py:function``) over every shard of
    ``source`` into Parquet files in ``out``. ``workers=0`` starts only the coordinator, for
    workers on other machines (they need ``token``)."""
    started = time.monotonic()
    shards = plan(source)
    output = OutputDir(out, describe_job(source, transform, shards))
    done = output.open()
    skipped = len(done)
    queue = ShardQueue(
        shards, done, lease_s=lease_s, max_attempts=max_attempts, speculate_after=speculate_after
    )
    coordinator = Coordinator(queue, output, transform)
    restarts = 0
    if not queue.finished:
        token = token or secrets.token_urlsafe(24)
        app = create_coordinator_app(coordinator, token)
        with BackgroundServer(app, port or 0, host) as server:
            if on_started is not None:
                on_started(server.url)
            pool = LocalWorkers(
                workers, server.url, token, transform, output.path, _worker_secrets(source)
            )
            try:
                restarts = pool.supervise(coordinator, max_restarts=max_attempts * max(workers, 1))
            finally:
                pool.stop()
            coordinator.drain(gone=pool.names)
    if queue.error is not None:
        raise PreprocessError(
            f"{queue.error}; {len(queue.done)} of {len(shards)} shards are done and kept in "
            f"{output.path}: rerun the same job to finish it"
        )
    stats = {**asdict(queue.stats), "skipped": skipped, "worker_restarts": restarts}
    manifest = output.finalize(len(shards), stats)
    return PreprocessResult(manifest, time.monotonic() - started, skipped, restarts)


def _worker_secrets(source: Source) -> dict[str, str]:
    """What local workers need in their environment besides the token: the database password
    the coordinator was given (shards name their database without it)."""
    password = source.password() if isinstance(source, SqlSource) else None
    return {SQL_PASSWORD_ENV: password} if password else {}


class LocalWorkers:
    """Worker processes on this machine, each with its share of the cores. They die with this
    process (Linux), so a coordinator killed outright leaves none behind."""

    def __init__(
        self, n: int, url: str, token: str, transform: str, out: Path, extra_env: dict[str, str]
    ):
        self.argv = [
            sys.executable, "-m", "distml.data.preprocess.worker",
            "--coordinator", url, "--transform", transform, "--out", str(out),
        ]  # fmt: skip
        log_dir = out / TMP
        threads = str(max(1, (os.cpu_count() or 1) // max(n, 1)))
        self.env = {
            **os.environ,
            **extra_env,
            TOKEN_ENV: token,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads),
        }
        self.names: set[str] = set()  # as the coordinator knows them, restarts included
        self.procs = [ChildProcess(log_dir / f"worker-{i}.log") for i in range(n)]
        for i in range(n):
            self._start(i)

    def _start(self, i: int) -> None:
        proc = self.procs[i]
        proc.start([*self.argv, "--worker-id", f"local-{i}"], self.env)
        self.names.add(worker_name(f"local-{i}", proc.popen.pid))

    def supervise(self, coordinator: Coordinator, max_restarts: int) -> int:
        """Until the job ends: restart workers that die while work remains. A worker that exits
        with 2 (it cannot import the transform) stops the job with its message."""
        while not coordinator.wait(0.25):
            for i, proc in enumerate(self.procs):
                code = proc.poll()
                if code is None or coordinator.queue.error is not None:
                    continue  # running, or told the job failed: it ends now, not restarted
                restarts = sum(p.restarts for p in self.procs)
                if code == 2 or restarts >= max_restarts:
                    with coordinator.lock:
                        coordinator.queue.error = (
                            f"local worker {i} exited with {code}: {self.tail(i)}"
                        )
                    return restarts
                proc.restarts += 1
                self._start(i)
        deadline = time.monotonic() + 10  # they are told to stop at their next claim
        for proc in self.procs:
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return sum(p.restarts for p in self.procs)

    def tail(self, i: int, lines: int = 5) -> str:
        return " | ".join(self.procs[i].log_tail(lines).splitlines()) or "(no output)"

    def stop(self) -> None:
        stop_all(self.procs, timeout_s=10)
