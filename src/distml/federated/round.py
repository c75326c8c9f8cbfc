"""One federated round as the server holds it while it is open, and what the history says of it
once it has closed: who was asked and who answered, the bytes both ways, and for a completed
round the clients' own figures (training loss, the wait for the slowest, energy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from distml.federated.strategy import ClientUpdate, RoundStages

# No hardware counter is read on a client: its training CPU time at a typical figure per core.
ENERGY_SOURCE = "estimated: clients' training CPU time x 10 W/core"


@dataclass
class Round:
    number: int
    attempt: int  # rounds opened so far, failed ones included: a rerun of a round is new
    selected: list[str]
    config: dict[str, Any]
    deadline: float
    started: float = field(default_factory=time.perf_counter)
    updates: dict[str, ClientUpdate] = field(default_factory=dict)
    open: bool = True
    bytes_down: int = 0
    bytes_up: int = 0
    secure: RoundStages | None = None  # the stages the strategy opened (secure aggregation)
    arrivals: list[float] = field(default_factory=list)  # when each update came in
    left: set[str] = field(default_factory=set)  # selected, then said they are gone

    def pending(self) -> set[str]:
        """The selected clients the round still waits for."""
        return set(self.selected) - set(self.updates) - self.left

    def answered(self) -> int:
        """Clients whose answer counts: plain updates, or the inputs in a secure sum."""
        return len(self.updates) if self.secure is None else self.secure.survivors()

    def entry(self) -> dict[str, Any]:
        """What every round's history entry says, completed or not: who answered, the bytes."""
        answered = self.answered()
        record: dict[str, Any] = {
            "round": self.number,
            "selected": len(self.selected),
            "participants": answered,
            "dropped": len(self.selected) - answered,
            "bytes_down": self.bytes_down,
            "bytes_up": self.bytes_up,
        }
        if self.secure is not None:
            record["secure"] = True
        return record

    def failed(self, reason: str | None) -> dict[str, Any]:
        record = self.entry() | {"status": "failed", "duration_s": self.duration_s()}
        if reason:
            record["reason"] = reason
        return record

    def client_figures(self) -> dict[str, Any]:
        """The clients' mean training loss, how long the first update waited for the last (the
        round's synchronisation overhead) and their energy; empty without plain updates."""
        updates = list(self.updates.values())
        if not updates:
            return {}
        losses = [u.metrics.get("train_loss", 0.0) for u in updates]
        energy = [u.metrics["energy_j"] for u in updates if "energy_j" in u.metrics]
        return {
            "train_loss": sum(losses) / len(losses),
            "straggler_wait_s": max(self.arrivals) - min(self.arrivals),
            "energy_j": sum(energy) if energy else None,
        }

    def duration_s(self) -> float:
        return time.perf_counter() - self.started


def summarize(history: list[dict[str, Any]], completed: int, late: int) -> dict[str, Any]:
    """A federation's totals from its rounds' history."""
    done = [h for h in history if h["status"] == "completed"]
    last = done[-1] if done else {}
    return {
        "rounds": completed,
        "accuracy": last.get("accuracy"),
        "loss": last.get("loss"),
        "epsilon": last.get("epsilon"),
        "failed_rounds": len(history) - len(done),
        "late_updates": late,
        "bytes_down": sum(h["bytes_down"] for h in history),
        "bytes_up": sum(h["bytes_up"] for h in history),
        "straggler_wait_s": sum(h.get("straggler_wait_s", 0.0) for h in done),
        "energy_j": sum(h.get("energy_j") or 0.0 for h in done),
        "energy_source": ENERGY_SOURCE,
    }
