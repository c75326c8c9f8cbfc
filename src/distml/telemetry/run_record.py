"""What a finished rank hands to the writers of its run folder: plain data, not the ``Context``.

The run files (``distml.runtime.run_files``) and a parameter-server worker's files
(``distml.jobs.ps``) read only this, so neither depends on the runtime that made it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
    model_parallel: bool
    module: nn.Module | None = None  # the plain model, None before setup
    # Under model parallelism: every rank's shards gathered (a collective) into the whole
    # state, and the names of its parameters.
    full_state: tuple[dict[str, torch.Tensor], set[str]] | None = None
