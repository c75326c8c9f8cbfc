"""The coordinator: the one process that knows the plan. It hands shards to workers over the
shared web stack (bearer token, validated JSON bodies) and commits their output.

Routes (all POST bodies are JSON, declared by the models of :mod:`.protocol`; all need the token):
  GET  /v1/job        the transform every worker must run, the job's fingerprint, the lease length
  POST /v1/claim      {"worker"} -> work (an attempt ID and its shard) | wait | stop
  POST /v1/heartbeat  {"worker"}: renews the worker's leases
  POST /v1/complete   {"worker", "attempt"} -> {"kept": true|false}; 409 while the attempt's
                      file is not a Parquet file of the job's schema (the attempt stays the
                      worker's, to write again or report failed; its lease runs out otherwise)
  POST /v1/fail       {"worker", "attempt", "error"}
  GET  /healthz, /metrics

A worker names its file itself, in the output folder's ``.tmp/``, from the attempt's ID. Leases
run out in a background loop of the service (``app.state.loops``), so a dead worker's shard goes
back even while no one calls.

After the last shard it keeps answering (:meth:`Coordinator.drain`) until every worker it has
seen is told to stop, so that a worker on another machine exits as done, not as cut off.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from prometheus_client import Counter, Gauge

from distml.data.preprocess.output import OutputDir, OutputError
from distml.data.preprocess.protocol import MAX_ERROR, AttemptBody, FailBody, WorkerBody
from distml.data.preprocess.queue import ShardQueue
from distml.net import create_app


class Coordinator:
    """The queue and the output folder under one lock, as the routes (threads) use them."""

    def __init__(self, queue: ShardQueue, output: OutputDir, transform: str):
        self.queue = queue
        self.output = output
        self.transform = transform
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.started = time.monotonic()
        self.workers: dict[str, float] = {}  # workers heard from lately -> when they last called
        self.stopped: set[str] = set()  # the workers answered "stop"

    def claim(self, worker: str, wait_s: float = 0.0) -> dict[str, Any]:
        """Work for ``worker``, or stop. With nothing to hand out yet, the answer waits up to
        ``wait_s`` for a shard to free up or the job to end (a long poll), so that a worker idle
        at the job's end hears "stop" the moment the last shard is in, not a sleep later."""
        deadline = time.monotonic() + wait_s
        with self.changed:
            while True:
                self.workers[worker] = now = time.monotonic()
                attempt = self.queue.claim(worker)
                if attempt is not None:
                    break
                if self.queue.error is not None or self.queue.finished:
                    self.stopped.add(worker)
                    self.changed.notify_all()
                    error = self.queue.error
                    return {"action": "stop", "error": error and error[-MAX_ERROR:]}
                if now >= deadline:
                    return {"action": "wait", "seconds": 0.0}
                # Woken by a completion or a failure; and every 0.1 s, since time alone makes a
                # lease run out or a slow shard worth a backup copy.
                self.changed.wait(min(deadline - now, 0.1))
            return {
                "action": "work",
                "attempt": attempt.id,
                "shard": self.queue.shards[attempt.shard],
            }

    def heartbeat(self, worker: str) -> None:
        with self.lock:
            self.workers[worker] = time.monotonic()
            self.queue.heartbeat(worker)

    def complete(self, worker: str, attempt_id: str) -> bool:
        """Whether ``worker``'s attempt is its shard's output (True: committed). A report that is
        not the worker's to make, or that of a copy which lost, keeps nothing; a file that is not
        a Parquet file of the job's schema is refused with :class:`OutputError`, and then
        nothing has changed."""
        with self.changed:
            attempt = self.queue.attempt(attempt_id)
            if attempt is None or attempt.worker != worker:
                return False  # not this worker's attempt: nothing to keep, nothing to delete
            if attempt_id not in self.queue.running:
                self.queue.complete(attempt_id)  # a copy that lost, or a lease that ran out
                self.output.discard(attempt_id)
                return False
            checked = self.output.check(attempt.shard, attempt_id, worker)
            self.queue.complete(attempt_id)
            self.changed.notify_all()
            seconds = self.queue.done[attempt.shard]
            try:
                self.output.commit(attempt.shard, attempt_id, seconds, worker, checked)
            except (OSError, OutputError) as exc:  # the coordinator's disk: retrying cannot help
                self.queue.error = f"shard {attempt.shard} could not be committed: {exc}"
                return False
            return True

    def fail(self, worker: str, attempt_id: str, error: str) -> None:
        with self.changed:
            attempt = self.queue.running.get(attempt_id)
            if attempt is not None and attempt.worker == worker:
                self.queue.fail(attempt_id, error)
                self.output.discard(attempt_id)
            self.changed.notify_all()

    def expire(self) -> None:
        """Put back the shards of leases that ran out (their workers died or hung), and wake the
        claims waiting for work."""
        with self.changed:
            lost = self.queue.stats.lost_leases
            self.queue.expire()
            if self.queue.stats.lost_leases != lost:
                self.changed.notify_all()
            self._forget_silent_workers()

    def _forget_silent_workers(self) -> None:
        """Forget workers silent for two leases: the table holds the workers alive, not every
        name a caller ever made up."""
        cutoff = time.monotonic() - 2 * self.queue.lease_s
        for worker in [w for w, t in self.workers.items() if t < cutoff]:
            del self.workers[worker]
            self.stopped.discard(worker)

    def wait(self, timeout: float) -> bool:
        """Block until the job is finished or failed (True), or ``timeout`` passes (False)."""
        with self.changed:
            if self.queue.finished or self.queue.error is not None:
                return True
            self.changed.wait(timeout)
            return self.queue.finished or self.queue.error is not None

    def drain(self, gone: set[str]) -> None:
        """After the job: keep answering until every worker still alive, but those in ``gone``,
        has been told to stop, for one lease at most. A worker elsewhere that found the port
        closed would retry for a minute and fail, not stop. One silent for a lease is taken for
        dead, as its shards are."""
        lease = self.queue.lease_s
        deadline = time.monotonic() + lease
        with self.changed:
            while (now := time.monotonic()) < deadline:
                told = self.stopped | gone
                alive = [t for w, t in self.workers.items() if w not in told and now - t < lease]
                if not alive:
                    return
                self.changed.wait(min(deadline, min(alive) + lease) - now)

    def progress(self) -> dict[str, Any]:
        with self.lock:
            q = self.queue
            return {
                "shards": len(q.shards),
                "done": len(q.done),
                "running": len(q.running),
                "pending": len(q.pending),
                "workers": len(self.workers),
                "error": q.error,
            }


def create_coordinator_app(coordinator: Coordinator, token: str) -> FastAPI:
    """The coordinator's service. While it is served, a background loop puts back the shards
    of leases that ran out, ten times a lease (at least once a second)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        every_s = min(1.0, coordinator.queue.lease_s / 10)
        app.state.loops.start(
            "lease expiry", lambda: asyncio.to_thread(coordinator.expire), every_s
        )
        yield
        await app.state.loops.stop()

    app = create_app("distml preprocess coordinator", token, health=coordinator.progress)
    app.router.lifespan_context = lifespan
    registry = app.state.registry
    shards_done = Gauge("distml_preprocess_shards_done", "shards committed", registry=registry)
    attempts = Counter("distml_preprocess_attempts", "attempts handed out", registry=registry)
    shards_done.set_function(lambda: len(coordinator.queue.done))

    @app.get("/v1/job")
    def job() -> dict[str, Any]:
        return {
            "transform": coordinator.transform,
            "fingerprint": coordinator.output.job["fingerprint"],
            "lease_s": coordinator.queue.lease_s,
        }

    # Plain (not async) handlers: FastAPI runs them in its thread pool, where the lock may block.
    @app.post("/v1/claim")
    def claim(body: WorkerBody) -> dict[str, Any]:
        # A long poll holds one of the pool's threads (40 by default) for at most a second.
        answer = coordinator.claim(body.worker, wait_s=min(1.0, coordinator.queue.lease_s / 4))
        if answer["action"] == "work":
            attempts.inc()
        return answer

    @app.post("/v1/heartbeat")
    def heartbeat(body: WorkerBody) -> dict[str, Any]:
        coordinator.heartbeat(body.worker)
        return {"ok": True}

    @app.post("/v1/complete", responses={409: {"description": "the attempt's file is refused"}})
    def complete(body: AttemptBody) -> dict[str, Any]:
        try:
            return {"kept": coordinator.complete(body.worker, body.attempt)}
        except OutputError as exc:
            raise HTTPException(409, str(exc)) from None

    @app.post("/v1/fail")
    def fail(body: FailBody) -> dict[str, Any]:
        coordinator.fail(body.worker, body.attempt, body.error)
        return {"ok": True}

    return app
