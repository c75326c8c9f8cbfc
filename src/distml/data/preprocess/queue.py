"""The coordinator's work queue: which shard goes to which worker, and what happens when a worker
fails, dies or dawdles.

- A worker *claims* work and gets a shard under a lease; its heartbeats renew every lease it
  holds. A lease that runs out (the worker died, or hung) puts the shard back in the queue.
- A shard whose transform raises is retried, up to ``max_attempts`` failures (deaths included);
  then the job fails with that shard's error.
- Speculation (MapReduce's backup tasks, Dean and Ghemawat 2004): once no shard is waiting, an
  idle worker gets a second copy of a shard that has run ``speculate_after`` times longer than
  the median finished shard. The first copy to finish wins; the other is *retired*: its
  report, when it comes, is discarded and counted (as is a lost lease's late report).
- Completion is *committed* by the queue's owner (it moves the worker's file into place and
  records it), so however many copies run, each shard's output is written exactly once.

Pure bookkeeping with an injectable clock: no I/O, no threads; the owner holds the lock.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from distml.data.preprocess.sources import Shard


@dataclass
class Attempt:
    id: str
    shard: int
    worker: str
    started: float
    deadline: float
    backup: bool = False


@dataclass
class QueueStats:
    attempts: int = 0
    retried: int = 0  # failures and lost leases that sent a shard back to the queue
    lost_leases: int = 0
    speculative: int = 0
    discarded: int = 0  # copies that finished after their shard was won or their lease ran out


@dataclass
class ShardQueue:
    shards: list[Shard]
    done: dict[int, float] = field(default_factory=dict)  # shard -> seconds its winner took
    lease_s: float = 30.0
    max_attempts: int = 3
    speculate_after: float = 2.0  # x the median finished shard; 0 turns speculation off
    speculate_min_s: float = 1.0
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.pending = [s["id"] for s in self.shards if s["id"] not in self.done]
        self.running: dict[str, Attempt] = {}
        self.retired: dict[str, Attempt] = {}  # copies that can no longer win, until they report
        self.failures: dict[int, int] = {}
        self.error: str | None = None
        self.stats = QueueStats()
        self._next_attempt = 0

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.shards)

    def claim(self, worker: str) -> Attempt | None:
        """The next attempt for ``worker``, or None (nothing to hand out right now)."""
        self.expire()
        if self.error is not None or self.finished:
            return None
        if self.pending:
            return self._start(self.pending.pop(0), worker, backup=False)
        shard = self._straggler(worker)
        if shard is not None:
            self.stats.speculative += 1
            return self._start(shard, worker, backup=True)
        return None

    def heartbeat(self, worker: str) -> None:
        now = self.clock()
        for attempt in self.running.values():
            if attempt.worker == worker:
                attempt.deadline = now + self.lease_s

    def attempt(self, attempt_id: str) -> Attempt | None:
        """A running attempt, or a retired one that has not reported yet."""
        return self.running.get(attempt_id) or self.retired.get(attempt_id)

    def complete(self, attempt_id: str) -> bool:
        """True when this attempt is the shard's first to finish (its output is to be kept). A
        retired copy's completion is counted as discarded; a repeated report changes nothing."""
        if self.retired.pop(attempt_id, None) is not None:
            self.stats.discarded += 1
            return False
        attempt = self.running.pop(attempt_id, None)
        if attempt is None:
            return False
        self.done[attempt.shard] = self.clock() - attempt.started
        for other in self._active(attempt.shard):
            self._retire(other)
        return True

    def fail(self, attempt_id: str, error: str) -> None:
        attempt = self.running.pop(attempt_id, None)
        if attempt is not None:
            self._give_back(
                attempt.shard, f"shard {attempt.shard} failed on {attempt.worker}: {error}"
            )

    def expire(self) -> None:
        now = self.clock()
        for attempt in [a for a in self.running.values() if a.deadline < now]:
            self._retire(attempt)
            self.stats.lost_leases += 1
            self._give_back(
                attempt.shard,
                f"shard {attempt.shard}: worker {attempt.worker} stopped answering",
            )

    def _start(self, shard: int, worker: str, *, backup: bool) -> Attempt:
        self._next_attempt += 1
        now = self.clock()
        attempt = Attempt(
            f"{shard}.{self._next_attempt}", shard, worker, now, now + self.lease_s, backup
        )
        self.running[attempt.id] = attempt
        self.stats.attempts += 1
        return attempt

    def _retire(self, attempt: Attempt) -> None:
        del self.running[attempt.id]
        self.retired[attempt.id] = attempt

    def _give_back(self, shard: int, error: str) -> None:
        if shard in self.done or self._active(shard):
            return  # another copy is still running, or already won
        self.failures[shard] = self.failures.get(shard, 0) + 1
        if self.failures[shard] >= self.max_attempts:
            self.error = f"{error} (attempt {self.failures[shard]} of {self.max_attempts})"
            return
        self.stats.retried += 1
        self.pending.insert(0, shard)  # retried first: the job's end waits on it

    def _active(self, shard: int) -> Iterable[Attempt]:
        return [a for a in self.running.values() if a.shard == shard]

    def _straggler(self, worker: str) -> int | None:
        """The longest-running shard worth a backup copy on ``worker``, if any."""
        if not self.speculate_after or len(self.done) < 2:
            return None
        threshold = max(
            self.speculate_min_s, self.speculate_after * statistics.median(self.done.values())
        )
        now = self.clock()
        candidates = [
            a
            for a in self.running.values()
            if now - a.started > threshold
            and a.worker != worker
            and len(list(self._active(a.shard))) == 1
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda a: a.started).shard
