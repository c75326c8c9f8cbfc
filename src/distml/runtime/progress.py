"""A live progress line on rank 0: step, loss, throughput."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import Progress as RichProgress
from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

from distml.telemetry.units import format_rate


class Progress:
    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self._bar: RichProgress | None = None
        self._task = None

    def update(self, step: int, loss: float, samples_per_s: float) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            self._bar = RichProgress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task("")
        text = f"step {step}  loss {loss:.4f}  {format_rate(samples_per_s)}"
        self._bar.update(self._task, description=text)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
