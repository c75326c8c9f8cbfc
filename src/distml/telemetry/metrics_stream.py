"""A run's metrics stream, written once at the end: ``metrics.jsonl`` and TensorBoard's ``tb/``
(and an MLflow run, :mod:`distml.telemetry.mlflow_log`).

Both files come from the same records, in one function, so what TensorBoard plots is what
``metrics.jsonl`` says, step for step. Global step is the training step (a federated run's,
the round). Tags name the rank where the figure is a rank's own (``rank1/step_time_s``,
``rank0/comm_bytes/all_reduce``); ``loss``, ``samples_per_s`` and ``energy_j`` without a rank
are the mean loss, the summed throughput and the summed energy of the ranks at that step, and
``eval/<metric>`` the run's evaluation, at its last step.

TensorBoard is optional (``pip install 'distml[tensorboard]'``): without it the run writes
``metrics.jsonl`` alone and says so once.

    tensorboard --logdir runs/<name>/tb
"""

from __future__ import annotations

import functools
import json
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distml.telemetry.mlflow_log import MlflowTarget

log = logging.getLogger("distml.telemetry")

Records = list[list[dict[str, Any]]]
Scalar = tuple[str, float, int]  # tag, value, global step

# A step record's figures that are a rank's own, as (key in metrics.jsonl, TensorBoard name).
_RANK_FIGURES = (
    ("loss", "loss"),
    ("step_s", "step_time_s"),
    ("compute_s", "compute_s"),
    ("comm_s", "comm_s"),
    ("sync_wait_s", "sync_wait_s"),
    ("energy_j", "energy_j"),
    ("peak_mem_bytes", "peak_mem_bytes"),
)
_BY_COLLECTIVE = ("comm_bytes", "wire_bytes")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def step_scalars(
    per_rank: Records, eval_metrics: Mapping[str, Any] | None = None, ranks_per_batch: int = 1
) -> list[Scalar]:
    """Every scalar that TensorBoard gets from a run's step records (see the module's doc);
    the run's samples/s counts each sample once, as :func:`~distml.telemetry.summary.summarize`
    does."""
    out: list[Scalar] = []
    losses: dict[int, list[float]] = defaultdict(list)
    rates: dict[int, float] = defaultdict(float)
    energy: dict[int, float] = defaultdict(float)
    for records in per_rank:
        for rec in records:
            step, prefix = int(rec["step"]), f"rank{rec['rank']}/"
            for key, name in _RANK_FIGURES:
                if _is_number(rec.get(key)):
                    out.append((prefix + name, float(rec[key]), step))
            for key in _BY_COLLECTIVE:
                for collective, n in (rec.get(key) or {}).items():
                    out.append((f"{prefix}{key}/{collective}", float(n), step))
            if rec.get("step_s"):
                rate = rec["samples"] / rec["step_s"]
                out.append((prefix + "samples_per_s", rate, step))
                rates[step] += rate
            losses[step].append(float(rec["loss"]))
            energy[step] += float(rec.get("energy_j", 0.0))
    for step in sorted(losses):
        out.append(("loss", sum(losses[step]) / len(losses[step]), step))
        out.append(("samples_per_s", rates[step] / ranks_per_batch, step))
        out.append(("energy_j", energy[step], step))
    if losses:
        last = max(losses)
        out += [(f"eval/{k}", float(v), last) for k, v in (eval_metrics or {}).items()
                if _is_number(v)]  # fmt: skip
    return out


def round_scalars(history: Iterable[dict[str, Any]]) -> list[Scalar]:
    """Every numeric figure of each round of a federated run, at the round's number."""
    return [
        (key, float(value), int(entry["round"]))
        for entry in history
        for key, value in entry.items()
        if key != "round" and _is_number(value)
    ]


def write_metrics(
    run_dir: Path,
    per_rank: Records,
    eval_metrics: Mapping[str, Any] | None = None,
    ranks_per_batch: int = 1,
    mlflow: MlflowTarget | None = None,
) -> Path:
    """Write ``run_dir/metrics.jsonl`` (one JSON object per step per rank) and the same
    records as TensorBoard event files in ``run_dir/tb/`` (and as an MLflow run where
    ``mlflow`` says); returns the jsonl's path."""
    path = Path(run_dir) / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for records in per_rank:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    scalars = step_scalars(per_rank, eval_metrics, ranks_per_batch)
    write_events(Path(run_dir) / "tb", scalars)
    if mlflow is not None:
        from distml.telemetry.mlflow_log import log_run

        log_run(mlflow, scalars)
    return path


def write_events(tb_dir: Path, scalars: Iterable[Scalar]) -> Path | None:
    """``scalars`` as one TensorBoard event file in ``tb_dir``, in place of the event files of
    an earlier attempt of the same run (a restarted run rewrites its metrics.jsonl too);
    None, with a warning the first time, where tensorboard is not installed."""
    writer_class = _summary_writer()
    if writer_class is None:
        return None
    tb_dir.mkdir(parents=True, exist_ok=True)
    for old in _event_files(tb_dir):
        old.unlink()
    writer = writer_class(log_dir=str(tb_dir))
    try:
        for tag, value, step in scalars:
            writer.add_scalar(tag, value, global_step=step)
    finally:
        writer.close()
    return tb_dir


def _event_files(tb_dir: Path) -> Iterator[Path]:
    return tb_dir.glob("events.out.tfevents.*")


@functools.cache
def _summary_writer() -> type | None:
    """torch's SummaryWriter, or None where tensorboard is not installed (said once)."""
    try:
        # Here, not at the top: tensorboard's imports take about half a second, which only the
        # process that writes the run folder pays, once, at the end of the run.
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        log.warning(
            "no TensorBoard event files (tb/) for this run: %s. "
            "Install them with: pip install 'distml[tensorboard]'",
            exc,
        )
        return None
    return SummaryWriter
