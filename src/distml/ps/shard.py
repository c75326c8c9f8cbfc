"""One parameter-server shard: its parameters, its optimizer, and the consistency rule that
decides when a worker's gradient is applied and when a worker may read.

- **BSP** (bulk synchronous): the gradients of one version are averaged and applied once
  ``quorum`` workers have pushed; with ``backup_workers = b`` of ``workers = N + b``, the quorum
  is N and later pushes for that version are dropped (Chen et al. 2016, "Revisiting
  distributed synchronous SGD"). A worker that finishes or goes silent uses up a backup first;
  with fewer than N live workers the quorum is all of them. A worker reads version v + 1 after
  pushing for version v.
- **ASP** (asynchronous): every push is applied at once; reads never wait.
- **SSP** with bound s (stale synchronous, Ho et al. 2013): pushes are applied at once; a worker
  whose clock (pushes made) is c reads only when the slowest live worker's clock is >= c - s,
  and it reads the parameters as they were when the slowest clock last advanced: every update
  of the clocks below it, as the bound promises, and the same view for every reader of a clock.
  With s = 0 every worker reads, after all have pushed clock c - 1, exactly their updates: BSP.

In ASP and SSP each push is scaled by 1 / workers, so that one push from each worker moves the
parameters as far as one BSP step does (exactly as far, for plain SGD). With ``staleness_lr`` the
learning rate of a push is divided by 1 + its staleness (Zhang et al. 2016).

Under ASP and SSP a shard also hands out the training batches (:meth:`ParameterShard.claim`): a
counter per epoch gives each batch of the epoch's order to the first worker that asks, so a fast
worker trains on more of the data instead of idling while a straggler finishes a fixed share.
BSP's barrier takes one batch from every worker each step; its workers keep fixed shards.

A worker that has not been heard from for ``heartbeat_timeout_s`` leaves the barrier (BSP) and the
slowest-clock rule (SSP); it is admitted again when it registers. Pushes carry the worker's own
step counter and are applied at most once: a retried push gets the first answer again. A push
is counted only once its optimizer step has succeeded: a step that fails leaves the clocks, the
version and the gradients waiting for a barrier as they were, so the same push, sent again, is
applied.

A reader gets the parameters as safetensors bytes, encoded once per version under the lock
(one copy of the parameters, as a snapshot of them needs anyway) and shared by every reader of
that version: BSP's N readers of a step, SSP's readers of one view.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from distml.config import Consistency
from distml.net.tensors import encode_tensors
from distml.ps.optimizer_spec import FLOAT_DTYPES, build_optimizer, validate_optimizer_spec

log = logging.getLogger("distml.ps")


class PushRejected(ValueError):
    """A push that does not fit this shard (names, shapes, dtypes, values); nothing applied."""


class ClaimRejected(ValueError):
    """A batch claim for an epoch of another length than the job's."""


class NotInitialized(RuntimeError):
    """The shard has no parameters yet: the first worker has not sent them."""


class StepFailed(RuntimeError):
    """The optimizer step failed; no clock, version or waiting gradient changed (send again)."""


# The environment of a shard's process. glibc's malloc hands a freed block past its adaptive
# threshold (32 MiB at most) back to the kernel, and trims the top of its heap past twice that:
# a shard of a large model then has every page of each body it reads and of each answer it
# encodes faulted in afresh, step after step, which costs more CPU than the rest of its work
# (benchmarks/ps_transport.py). With these, its freed memory is kept for the next step.
PROCESS_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**32)}

# Below this many bytes of parameters an optimizer step takes less time than handing it to a
# thread and back (tens of microseconds with the wake-ups); above it, the event loop stays free
# to take requests while a step runs.
INLINE_STEP_BYTES = 2**20


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite. A sum is finite only when every element
    is (a NaN or an infinity carries through it), and a sum is one fast pass; only a tensor
    whose sum is not finite (a bad value, or finite values whose sum overflows) is checked
    element by element."""
    if not tensors:
        return True
    sums = torch.stack([t.sum() for t in tensors])
    if bool(sums.isfinite().all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@dataclass
class WorkerState:
    clock: int = 0  # pushes made; a push with a step below it is a retry
    last_seen: float = field(default_factory=time.monotonic)
    done: bool = False
    last_answer: dict[str, Any] = field(default_factory=dict)
    last_claim: list | None = None  # [epoch, position, batch]: a retried claim gets it again


@dataclass
class ShardSettings:
    consistency: Consistency = "bsp"
    staleness: int = 0
    backup_workers: int = 0
    workers: int = 1
    staleness_lr: bool = False
    heartbeat_timeout_s: float = 10.0


class ParameterShard:
    """The state of one shard; the web app (:mod:`distml.ps.app`) is a thin layer over it."""

    def __init__(self, settings: ShardSettings):
        self.settings = settings
        self.generation = uuid.uuid4().hex[:12]  # changes when the shard restarts
        self.params: dict[str, torch.nn.Parameter] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_spec: dict[str, Any] | None = None
        self.version = 0
        self.workers: dict[int, WorkerState] = {}
        self.restored_version: int | None = None
        self._since = time.monotonic()  # workers not yet registered are presumed starting
        self._pending: dict[int, dict[str, torch.Tensor]] = {}  # BSP: gradients of `version`
        # SSP: the parameters (encoded) when the slowest clock last advanced, its version and
        # that clock.
        self._view: tuple[bytes, int, int] | None = None
        # The parameters encoded at a version, for every reader of it: (params, version, body).
        self._encoded: tuple[dict[str, torch.nn.Parameter], int, bytes] | None = None
        self._cond = asyncio.Condition()
        # Batches handed out: per epoch, how many of its `epoch_batches` are taken.
        self.claims: dict[int, int] = {}
        self.epoch_batches: int | None = None
        # Telemetry: what a run's summary reports about its servers.
        self.staleness = Counter()
        self.pushes = Counter()  # applied, accepted, dropped, duplicate
        self.queue_s: list[float] = []
        self.apply_s: list[float] = []
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self.claimed = Counter()  # batches per worker

    @property
    def lock(self) -> asyncio.Condition:
        """Held while the state changes; hold it to read a consistent snapshot."""
        return self._cond

    # -- membership -------------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return self.optimizer is not None

    def _live(self, now: float | None = None) -> list[int]:
        now = time.monotonic() if now is None else now
        timeout = self.settings.heartbeat_timeout_s
        return [w for w, s in self.workers.items() if not s.done and now - s.last_seen < timeout]

    def _absent(self, now: float | None = None) -> int:
        """Expected workers that have not registered yet and are still presumed starting (for
        one heartbeat timeout after the shard got its parameters)."""
        now = time.monotonic() if now is None else now
        if now - self._since >= self.settings.heartbeat_timeout_s:
            return 0
        return max(0, self.settings.workers - len(self.workers))

    def _seen(self, worker: int) -> WorkerState:
        state = self.workers.setdefault(worker, WorkerState())
        state.last_seen = time.monotonic()
        return state

    async def register(self, worker: int) -> dict[str, Any]:
        """Admit ``worker`` (again, after a restart): it resumes at its clock."""
        async with self._cond:
            state = self._seen(worker)
            state.done = False
            self._cond.notify_all()
            return self.status() | {"clock": state.clock}

    async def heartbeat(self, worker: int) -> None:
        async with self._cond:
            self._seen(worker)

    async def done(self, worker: int) -> None:
        """``worker`` has finished: it no longer holds back a barrier or the slowest clock."""
        async with self._cond:
            self._seen(worker).done = True
            await self._settle()

    async def check_liveness(self) -> None:
        """Called periodically: a worker that went silent leaves the barrier."""
        async with self._cond:
            await self._settle()

    async def _settle(self) -> None:
        """Complete the BSP step the live workers have all pushed for, and wake the readers
        (also when that step fails: membership changed all the same)."""
        try:
            await self._maybe_complete_step()
        finally:
            self._advance_view()
            self._cond.notify_all()

    def finished(self) -> bool:
        """Every worker that registered is done, or gone silent."""
        return bool(self.workers) and not self._live() and not self._absent()

    async def claim(self, worker: int, epoch: int, position: int, batches: int) -> int | None:
        """The next batch of ``epoch``, which has ``batches``, for ``worker``, whose ``position``-th
        claim of that epoch this is; None once they are all handed out. Each batch goes out
        once; a retried claim (the same epoch and position again) gets the first answer."""
        async with self._cond:
            if self.epoch_batches is None:
                self.epoch_batches = batches
            elif batches != self.epoch_batches:
                raise ClaimRejected(
                    f"an epoch of {batches} batches, but this job's have {self.epoch_batches}: "
                    "the workers must claim from one training loader, of the same dataset and "
                    "batch size"
                )
            state = self._seen(worker)
            if state.last_claim is not None and state.last_claim[:2] == [epoch, position]:
                return state.last_claim[2]
            taken = self.claims.get(epoch, 0)
            index = taken if taken < batches else None
            if index is not None:
                self.claims[epoch] = taken + 1
                self.claimed[worker] += 1
            state.last_claim = [epoch, position, index]
            return index

    # -- parameters -------------------------------------------------------------------------
    async def initialize(self, tensors: dict[str, torch.Tensor], spec: Any) -> bool:
        """Take the first worker's parameters and optimizer; False if already initialised (a
        second worker's, or a retried, initialisation changes nothing)."""
        async with self._cond:
            if self.initialized:
                return False
            for name, value in tensors.items():
                if value.dtype not in FLOAT_DTYPES:
                    raise PushRejected(
                        f"initial value of {name[:200]!r} is {value.dtype}; a shard holds "
                        f"{', '.join(str(d) for d in FLOAT_DTYPES)}"
                    )
                if not all_finite([value]):
                    raise PushRejected(f"initial value of {name[:200]!r} is not finite")
            params = {
                n: torch.nn.Parameter(t.clone(), requires_grad=True) for n, t in tensors.items()
            }
            spec = validate_optimizer_spec(spec)
            self.optimizer = build_optimizer(spec, params)
            self.params = params
            self.optimizer_spec = spec
            self._since = time.monotonic()
            self._advance_view()  # SSP: clock 0 reads the initial parameters
            self._cond.notify_all()
            return True

    def _check(self, grads: dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(grads) - set(self.params))
        missing = sorted(set(self.params) - set(grads))
        if unknown or missing:
            raise PushRejected(f"unknown parameters {unknown[:5]}, missing {missing[:5]}")
        for name, grad in grads.items():
            param = self.params[name]
            if grad.shape != param.shape or grad.dtype != param.dtype:
                raise PushRejected(
                    f"{name}: got {grad.dtype} {tuple(grad.shape)}, "
                    f"expected {param.dtype} {tuple(param.shape)}"
                )
        if not all_finite(list(grads.values())):
            bad = next(n for n, g in grads.items() if not torch.isfinite(g).all())
            raise PushRejected(f"{bad}: the gradient has non-finite values")

    async def push(
        self, worker: int, step: int, version: int, grads: dict[str, torch.Tensor], nbytes: int = 0
    ) -> dict[str, Any]:
        """``worker``'s gradient of its step ``step``, computed on parameters of ``version``.

        Answers ``status`` (applied, accepted, dropped or duplicate) and ``read_version``: the
        version the worker should read next (BSP waits for it; ASP and SSP never look).

        The shard takes ``grads`` over: an asynchronous push is scaled in place (a push whose
        step fails is sent again, decoded afresh)."""
        if not self.initialized:
            raise NotInitialized("the shard has no parameters yet")
        self._check(grads)
        arrived = time.perf_counter()
        async with self._cond:
            state = self._seen(worker)
            if step < state.clock:
                self.pushes["duplicate"] += 1
                return {**state.last_answer, "status": "duplicate"}
            queued = time.perf_counter() - arrived
            if self.settings.consistency == "bsp":
                answer = await self._push_bsp(worker, version, grads)
            else:
                staleness = max(0, self.version - version)
                await self._apply([grads], scale=1.0 / self.settings.workers, staleness=staleness)
                answer = {"status": "applied", "read_version": self.version}
            # Counted only now: a push whose step failed (StepFailed) is sent again, not a retry.
            self.pushes[answer["status"]] += 1
            self.queue_s.append(queued)
            self.bytes_pushed += nbytes
            state.clock = step + 1
            state.last_answer = answer
            self._advance_view()
            self._cond.notify_all()
            return answer

    async def _push_bsp(
        self, worker: int, version: int, grads: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        if version < self.version:  # that step is complete: a backup worker's late gradient
            return {"status": "dropped", "read_version": self.version}
        # version > self.version: this shard restarted from a snapshot older than the worker's
        # parameters; the gradient counts toward the step the shard is at.
        target = self.version
        before = self._pending.get(worker)
        self._pending[worker] = grads
        try:
            await self._maybe_complete_step()
        except StepFailed:
            if before is None:
                del self._pending[worker]
            else:
                self._pending[worker] = before
            raise
        return {"status": "accepted", "read_version": target + 1}

    def quorum(self) -> int:
        """How many gradients complete a BSP step: N of N + b while N are live, else all."""
        live = len(self._live()) + self._absent()
        return max(1, min(self.settings.workers - self.settings.backup_workers, live))

    async def _maybe_complete_step(self) -> None:
        if self.settings.consistency != "bsp" or not self._pending:
            return
        quorum = self.quorum()
        if len(self._pending) < quorum:
            return
        first = list(self._pending.values())[:quorum]
        await self._apply(first, scale=1.0 / len(first), staleness=0)
        self._pending.clear()

    async def _apply(
        self, grads: list[dict[str, torch.Tensor]], scale: float, staleness: int
    ) -> None:
        """One optimizer step on the scaled sum of ``grads`` (in a thread when the parameters
        are large: the event loop keeps taking requests, which queue on the lock this coroutine
        holds; small ones step at once, for less than the hand-over to a thread costs).
        :class:`StepFailed` if the step raises: the version and the telemetry stay as they
        were. One gradient is scaled in place; several are summed into new tensors, so that the
        BSP gradients waiting for a step that failed are kept as they came."""
        factor = 1.0 / (1 + staleness) if self.settings.staleness_lr else 1.0

        def step() -> None:
            saved = [g["lr"] for g in self.optimizer.param_groups]
            names = list(self.params)
            try:
                total = [grads[0][n] for n in names]
                if len(grads) > 1:
                    total = torch._foreach_add(total, [grads[1][n] for n in names])
                    for more in grads[2:]:
                        torch._foreach_add_(total, [more[n] for n in names])
                if scale != 1.0:
                    torch._foreach_mul_(total, scale)
                for param, grad in zip(self.params.values(), total, strict=True):
                    param.grad = grad
                for g in self.optimizer.param_groups:
                    g["lr"] = g["lr"] * factor
                self.optimizer.step()
            finally:
                for g, lr in zip(self.optimizer.param_groups, saved, strict=True):
                    g["lr"] = lr
                self.optimizer.zero_grad(set_to_none=True)

        start = time.perf_counter()
        try:
            if self._param_bytes() >= INLINE_STEP_BYTES:
                await asyncio.to_thread(step)
            else:
                step()
        except Exception as exc:
            log.exception("the optimizer step after version %d failed", self.version)
            raise StepFailed(
                f"the optimizer step failed ({type(exc).__name__}: {str(exc)[:200]}); nothing "
                "was counted: send the push again"
            ) from exc
        self.apply_s.append(time.perf_counter() - start)
        self.staleness[staleness] += len(grads)
        self.version += 1

    def _param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def encoded_params(self) -> bytes:
        """The parameters as safetensors bytes, encoded once per version (hold the lock)."""
        cached = self._encoded
        if cached is None or cached[0] is not self.params or cached[1] != self.version:
            cached = self._encoded = (self.params, self.version, encode_tensors(self.params))
        return cached[2]

    def _slowest_clock(self) -> int | None:
        """The lowest clock of the workers still training (None when none is)."""
        clocks = [self.workers[w].clock for w in self._live()] + [0] * self._absent()
        return min(clocks) if clocks else None

    def _advance_view(self) -> None:
        if self.settings.consistency != "ssp" or not self.initialized:
            return
        slowest = self._slowest_clock()
        if slowest is None:
            self._view = None  # nobody is training: readers get the parameters as they are
        elif self._view is None or slowest > self._view[2]:
            self._view = (self.encoded_params(), self.version, slowest)

    def _may_read(self, worker: int, min_version: int) -> bool:
        if not self.initialized:
            return False
        mode = self.settings.consistency
        if mode == "bsp":
            return self.version >= min_version
        if mode == "asp":
            return True
        clock = self.workers[worker].clock
        others = [self.workers[w].clock for w in self._live() if w != worker]
        others += [0] * self._absent()
        return not others or min(others) >= clock - self.settings.staleness

    async def pull(
        self, worker: int, min_version: int = 0, wait_s: float = 10.0, generation: str = ""
    ) -> tuple[bytes, int, float] | None:
        """The parameters (safetensors bytes) once ``worker`` may read them, their version and
        the seconds the rule held the reader; None if it could not read within ``wait_s`` (it
        asks again: a long poll).

        A reader that knew another ``generation`` of this shard (it restarted from a snapshot
        since) reads at once: the version it waits for may be one the shard lost."""
        if generation and generation != self.generation:
            min_version = 0
        start = time.perf_counter()
        async with self._cond:
            self._seen(worker)
            try:
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: self._may_read(worker, min_version)), wait_s
                )
            except TimeoutError:
                return None
            self._seen(worker)
            self._advance_view()
            if self._view is not None:
                body, version, _ = self._view
                return body, version, time.perf_counter() - start
            return self.encoded_params(), self.version, time.perf_counter() - start

    async def push_pull(
        self,
        worker: int,
        step: int,
        version: int,
        grads: dict[str, torch.Tensor],
        nbytes: int = 0,
        wait_s: float = 10.0,
        generation: str = "",
    ) -> tuple[dict[str, Any], tuple[bytes, int, float] | None]:
        """A worker's step in one exchange: :meth:`push`, then :meth:`pull` of the version the
        push answered (the answer, and what the pull got)."""
        answer = await self.push(worker, step, version, grads, nbytes)
        return answer, await self.pull(worker, answer["read_version"], wait_s, generation)

    async def read(self) -> tuple[bytes, int]:
        """The parameters as they are now (safetensors bytes), for an observer (no worker, no
        rule)."""
        async with self._cond:
            return self.encoded_params(), self.version

    # -- telemetry --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        live = set(self._live())
        return {
            "generation": self.generation,
            "initialized": self.initialized,
            "version": self.version,
            "consistency": self.settings.consistency,
            "restored_version": self.restored_version,
            "workers": {
                str(w): {"clock": s.clock, "live": w in live, "done": s.done}
                for w, s in sorted(self.workers.items())
            },
            "finished": self.finished(),
        }

    def stats(self) -> dict[str, Any]:
        def median(xs: list[float]) -> float:
            return statistics.median(xs) if xs else 0.0

        return {
            **self.status(),
            "parameters": list(self.params),
            "param_bytes": sum(p.numel() * p.element_size() for p in self.params.values()),
            "pushes": dict(self.pushes),
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "queue_s": {"median": median(self.queue_s), "total": sum(self.queue_s)},
            "apply_s": {"median": median(self.apply_s), "total": sum(self.apply_s)},
            "bytes_pushed": self.bytes_pushed,
            "bytes_pulled": self.bytes_pulled,
            "batches_claimed": {str(w): n for w, n in sorted(self.claimed.items())},
        }
