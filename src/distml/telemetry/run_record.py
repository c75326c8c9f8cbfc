"""What a finished rank hands to the writers of its run folder: plain data, not the ``Context``.

The run files (``distml.runtime.run_files``) read only this, so they depend neither on the
runtime that made it nor on the strategy that trained: a strategy adds its part through
:meth:`distml.parallel.strategy.TrainingStrategy.record_fields`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distml.config import RunConfig
from distml.telemetry.recorder import StepRecorder


@dataclass(frozen=True)
class RunRecord:
    config: RunConfig
    rank: int
    world_size: int
    attempt: int
    steps: int
    run_dir: Path
    device: torch.device
    wall_s: float
    recorder: StepRecorder
    mesh: dict[str, int]  # the layout's sizes; {"dp": world_size} under plain data parallelism
    # False: this rank shared no process group with the others (a parameter-server worker), so
    # it cannot gather: it writes its own records, and the job that started it the run's files.
    shares_process_group: bool = True
    module: nn.Module | None = None  # the whole plain model, where this rank holds it
    # Under model parallelism: every rank's shards gathered (a collective) into the whole
    # state on rank 0, and the names of its parameters.
    full_state: tuple[dict[str, torch.Tensor], set[str]] | None = None
    summary: dict[str, Any] = field(default_factory=dict)  # what the strategy adds to it
