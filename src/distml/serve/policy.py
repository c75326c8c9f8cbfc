"""Which replica takes the next request: a policy object the router asks, replaceable on its
own. The default is the power of two choices (Mitzenmacher 2001): sample two replicas, send to
the one with fewer requests in flight -- nearly the balance of "least loaded of all" without
every request looking at every replica, and without herding onto one that just emptied.

>>> a, b = ReplicaState("http://a"), ReplicaState("http://b", in_flight=3)
>>> PowerOfTwoChoices(random.Random(0)).choose([a, b]).url
'http://a'
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(eq=False)
class ReplicaState:
    """What the router knows of one replica."""

    url: str
    in_flight: int = 0
    healthy: bool = True
    failures: int = 0  # consecutive failed health checks or requests


class RoutingPolicy(Protocol):
    def choose(self, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """One of ``candidates`` (never empty)."""
        ...


class PowerOfTwoChoices:
    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def choose(self, candidates: Sequence[ReplicaState]) -> ReplicaState:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self.rng.sample(list(candidates), 2)
        return a if a.in_flight <= b.in_flight else b


class RoundRobin:
    """The peer a benchmark compares against: blind to load."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[ReplicaState]) -> ReplicaState:
        self._next += 1
        return candidates[self._next % len(candidates)]
