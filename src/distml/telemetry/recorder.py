"""Per-step, per-rank measurements taken inside a worker.

A step's wall time splits into *compute* (forward, backward up to the moment the last gradient
bucket is handed to the network, and the optimizer) and *exposed communication* (from that moment
until the gradients are reduced). The exposed part is itself communication plus synchronisation
wait: a rank that finishes early waits for the slowest. That split needs every rank's compute time,
so it is made once at the end of the run (:mod:`distml.telemetry.summary`).
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from distml.telemetry.energy import EnergyMeter


@dataclass
class StepRecord:
    step: int
    rank: int
    loss: float
    samples: int
    step_s: float
    compute_s: float
    exposed_comm_s: float
    comm_bytes: dict[str, int] = field(default_factory=dict)
    wire_bytes: dict[str, int] = field(default_factory=dict)
    comm_calls: dict[str, int] = field(default_factory=dict)
    energy_j: float = 0.0
    peak_mem_bytes: int = 0
    # Under a model-parallel layout: bytes of params, grads, optimizer state, peak activations;
    # and, with a pipeline, the seconds the schedule ran and this rank's stages computed in it.
    memory_bytes: dict[str, int] = field(default_factory=dict)
    stage_busy_s: float | None = None
    schedule_s: float | None = None
    # False where the step's collectives were not intercepted but repeat the last sampled step's.
    comm_measured: bool = True
    # Filled in at the end of the run, when every rank's compute time is known.
    sync_wait_s: float = 0.0
    comm_s: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class StepRecorder:
    """Collects one :class:`StepRecord` per optimizer step on this rank."""

    def __init__(self, rank: int, device: torch.device, energy: EnergyMeter):
        self.rank = rank
        self.device = device
        self.energy = energy
        self.records: list[StepRecord] = []
        self._t0 = 0.0
        self._energy0 = 0.0
        self._last_launch: float | None = None
        self._exposed_extra = 0.0
        self._wait = 0.0
        self._bytes: dict[str, int] = defaultdict(int)
        self._wire: dict[str, int] = defaultdict(int)
        self._calls: dict[str, int] = defaultdict(int)
        self._measured = True

    def begin_step(self) -> None:
        self._t0 = time.perf_counter()
        self._energy0 = self.energy.read()
        self._last_launch = None
        self._exposed_extra = 0.0
        self._wait = 0.0
        self._bytes.clear()
        self._wire.clear()
        self._calls.clear()
        self._measured = True

    def grads_ready(self) -> None:
        """This rank's gradients (so far) are computed and handed to the network."""
        self._last_launch = time.perf_counter()

    def add_comm(self, collective: str, nbytes: int, wire_bytes: int) -> None:
        """A collective with ``nbytes`` of payload from this rank took place in this step."""
        self._bytes[collective] += nbytes
        self._wire[collective] += wire_bytes
        self._calls[collective] += 1

    def repeat_comm(self, sample: StepRecord, now: float) -> None:
        """This step moved what ``sample`` (a step whose collectives were measured) moved, and
        was blocked in communication for the same share of its time so far."""
        for collective, nbytes in sample.comm_bytes.items():
            self._bytes[collective] += nbytes
            self._wire[collective] += sample.wire_bytes.get(collective, 0)
            self._calls[collective] += sample.comm_calls.get(collective, 0)
        share = sample.exposed_comm_s / sample.step_s if sample.step_s > 0 else 0.0
        self._exposed_extra += share * (now - self._t0)
        self._measured = False

    def last_measured(self) -> StepRecord:
        """The last step whose collectives were measured, not repeated from a sample."""
        return next(r for r in reversed(self.records) if r.comm_measured)

    def add_exposed(self, seconds: float) -> None:
        """Communication outside backward (a Local SGD sync) that this step waited for."""
        self._exposed_extra += seconds

    def add_sync_wait(self, seconds: float) -> None:
        """Of the exposed communication, time a server's consistency rule held this worker (a
        parameter server measures it; an all-reduce's wait is derived at the end instead)."""
        self._wait += seconds

    def end_step(
        self,
        step: int,
        loss: float,
        samples: int,
        backward_done: float,
        memory: dict[str, int] | None = None,
        pipeline: tuple[float, float] | None = None,
    ) -> StepRecord:
        end = time.perf_counter()
        local_done = self._last_launch if self._last_launch is not None else backward_done
        exposed = max(0.0, backward_done - local_done) + self._exposed_extra
        record = StepRecord(
            step=step,
            rank=self.rank,
            loss=loss,
            samples=samples,
            step_s=end - self._t0,
            compute_s=(end - self._t0) - exposed,
            exposed_comm_s=exposed,
            comm_bytes=dict(self._bytes),
            wire_bytes=dict(self._wire),
            comm_calls=dict(self._calls),
            energy_j=self.energy.read() - self._energy0,
            peak_mem_bytes=peak_memory_bytes(self.device),
            memory_bytes=memory or {},
            stage_busy_s=pipeline[0] if pipeline else None,
            schedule_s=pipeline[1] if pipeline else None,
            comm_measured=self._measured,
            sync_wait_s=min(self._wait, exposed),
            comm_s=exposed - min(self._wait, exposed),
        )
        self.records.append(record)
        return record
