"""The planner against published large-model training runs (benchmarks/data/published_runs.json).

Each run is compared like with like: the published figure becomes seconds a step through the
source's own count (an iteration time as it is; tokens/s a GPU over the global batch; TFLOP/s
a GPU through the FLOP count the source uses: model FLOPs, hardware FLOPs with full
recomputation, or PaLM's 6N + 12lhs a token), and the error is the predicted throughput over
the published one, less one (positive: the planner is optimistic).

The model has one fitted constant per GPU family (the A100s, the Hoppers),
:attr:`~distml.plan.devices.Chip.sustained`.
:func:`fit_sustained` fits it on a set of runs; :func:`cross_validate` fits it on half of the
sources and reports the errors on the other half, both ways round.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from distml.layout import Layout
from distml.plan.cost_model import Cluster, Prediction, named_device, predict, training_flops
from distml.plan.devices import CHIPS, NETWORKS, Chip
from distml.plan.search import rank_layouts
from distml.plan.spec import ModelSpec, Training

GOAL_WITHIN = 0.15  # at least GOAL_SHARE of the runs within this error
GOAL_SHARE = 0.80
GOAL_MAX = 0.30  # and none beyond this
# The sources split in two for cross-validation, each half with A100 and H100 runs and more
# than one organisation's software: NVIDIA's Megatron papers and README and BigScience's
# Megatron-DeepSpeed; Microsoft's DeepSpeed run, Meta's Llama 3 and MosaicML's FSDP.
HALVES = (
    {"korthikanti2022", "bloom2022", "megatron2024"},
    {"smith2022", "llama3_2024", "mosaicml2023"},
)


@dataclass(frozen=True)
class Run:
    id: str
    source: str
    model: ModelSpec
    training: Training
    layout: Layout
    cluster: Cluster
    published_step_s: float
    row: dict[str, Any]


def load(path: Path | str) -> tuple[dict[str, Any], list[Run]]:
    """(sources, runs) of a published-runs file."""
    data = json.loads(Path(path).read_text())
    return data["sources"], [run_of(row) for row in data["runs"]]


def run_of(row: dict[str, Any]) -> Run:
    """One row of the file: the published model, training, layout and cluster."""
    chip = CHIPS[row["device"]]
    net = NETWORKS[row["network"]]
    if "nic_gbps" in row:
        net = net.with_nic(row["nic_gbps"])
    cluster = Cluster(named_device(chip), row["gpus"], net.gpus_per_node, network=net)
    model = ModelSpec(**row["model"])
    training = Training(**row["training"])
    lay = row["layout"]
    layout = Layout.sharded(
        lay["dp"],
        lay["zero"],
        tp=lay["tp"],
        pp=lay["pp"],
        schedule=lay["schedule"],
        chunks=lay["chunks"],
    )
    return Run(
        row["id"],
        row["source"],
        model,
        training,
        layout,
        cluster,
        published_step_s(model, training, row),
        row,
    )


def published_step_s(model: ModelSpec, training: Training, row: dict[str, Any]) -> float:
    """The published figure as seconds a step, through the source's own count."""
    pub, gpus = row["published"], row["gpus"]
    tokens = training.global_batch * model.seq
    if pub["metric"] == "iteration_s":
        return float(pub["value"])
    if pub["metric"] == "tokens_per_s_per_gpu":
        return tokens / (pub["value"] * gpus)
    if pub["metric"] == "tflops_per_gpu":
        return source_flops(model, training, pub["tflops_flops"]) / (pub["value"] * 1e12 * gpus)
    raise ValueError(f"{row['id']}: unknown metric {pub['metric']!r}")


def source_flops(model: ModelSpec, training: Training, count: str) -> float:
    """A step's FLOPs as a source counts them."""
    if count == "model":
        return training_flops(model, training.global_batch, "none")
    if count == "hardware_full":
        return training_flops(model, training.global_batch, "full")
    if count == "palm":  # Chowdhery et al. 2022, appendix B: 6N + 12*l*h*s a token
        per_token = 6 * model.n_params + 12 * model.layers * model.hidden * model.seq
        return per_token * training.global_batch * model.seq
    raise ValueError(f"unknown FLOP count {count!r}")


@dataclass
class Result:
    run: Run
    prediction: Prediction

    @property
    def error(self) -> float:
        """Predicted throughput over published, less one."""
        return self.run.published_step_s / self.prediction.step_time_s - 1


def evaluate(runs: list[Run], sustained: dict[str, float] | None = None) -> list[Result]:
    """Predict every run, with ``sustained`` (chip family -> fraction) in place of the
    shipped, its unstated settings the planner's best."""
    out = []
    for run in runs:
        if sustained:
            run = with_sustained(run, sustained)
        run = tuned(run)
        out.append(Result(run, predict(run.model, run.cluster, run.training, run.layout)))
    return out


def peak_rate_error(run: Run) -> float:
    """The error of the formulas that charge every FLOP at the GPU's peak (the planner before
    its device models, and still on a machine ``distml bench`` measured), for comparison."""
    chip = chip_of(run)
    links = run.cluster.links()
    device = replace(
        run.cluster.device,
        peak_flops=chip.peak(run.training.precision),
        chip=None,
        intra_bw=links.nvlink_bw,
        inter_bw=links.nic_bw,
    )
    pred = predict(run.model, replace(run.cluster, device=device), run.training, run.layout)
    return run.published_step_s / pred.step_time_s - 1


def tuned(run: Run) -> Run:
    """``run`` with the settings its source does not state (``unstated``: the micro-batch, the
    pipeline chunks a rank takes) set to the fastest the planner finds that fits: the authors
    tuned their runs, so the planner's best stands for what they chose."""
    unstated = run.row.get("unstated", [])
    if not unstated:
        return run
    per_replica = run.training.global_batch // run.layout.data_parallel
    micro = [run.training.micro_batch]
    if "micro_batch" in unstated:
        micro = [b for b in range(1, min(per_replica, 16) + 1) if per_replica % b == 0]
    chunks = [run.layout.chunks]
    if "chunks" in unstated and run.layout.pp > 1:
        chunks = interleavings(run.model.layers, run.layout.pp)
    best = None
    for b in micro:
        for v in chunks:
            training = replace(run.training, micro_batch=b)
            layout = replace(run.layout, schedule="interleaved" if v > 1 else "1f1b", chunks=v)
            pred = predict(run.model, run.cluster, training, layout)
            if pred.memory_bytes["total"] > run.cluster.device.memory_bytes:
                continue
            if best is None or pred.step_time_s < best[0]:
                best = (pred.step_time_s, training, layout)
    if best is None:
        return run
    return replace(run, training=best[1], layout=best[2])


def chip_of(run: Run) -> Chip:
    chip = run.cluster.device.chip
    if chip is None:
        raise ValueError(f"{run.id}: a published run is on a named GPU")
    return chip


def with_sustained(run: Run, sustained: dict[str, float]) -> Run:
    chip = chip_of(run)
    family = family_of(chip.name)
    if family not in sustained:
        return run
    device = replace(run.cluster.device, chip=replace(chip, sustained=sustained[family]))
    return replace(run, cluster=replace(run.cluster, device=device))


def family_of(chip_name: str) -> str:
    """The constant a chip shares: the A100s one, the Hoppers (H100, H200) one."""
    return {"a100-40gb": "a100", "h200": "h100"}.get(chip_name, chip_name)


def fit_sustained(runs: list[Run]) -> dict[str, float]:
    """Per chip family, the sustained fraction that zeroes the mean log error of ``runs``.

    The step is not exactly inverse in it (communication does not scale), so this iterates:
    a few fixed-point steps on the geometric mean of published/predicted throughput."""
    families = sorted({family_of(chip_of(r).name) for r in runs})
    fitted = {f: 1.0 for f in families}
    for _ in range(8):
        results = evaluate(runs, fitted)
        for f in families:
            logs = [math.log1p(r.error) for r in results if family_of(chip_of(r.run).name) == f]
            fitted[f] = min(1.0, fitted[f] / math.exp(sum(logs) / len(logs)))
    return fitted


def cross_validate(runs: list[Run], halves: tuple[set[str], set[str]]) -> list[dict[str, Any]]:
    """Fit on one half of the sources, test on the other, both ways round."""
    out = []
    for train, test in (halves, halves[::-1]):
        fitted = fit_sustained([r for r in runs if r.source in train])
        tested = evaluate([r for r in runs if r.source in test], fitted)
        out.append({"fit_on": sorted(train), "sustained": fitted, "results": tested})
    return out


def leave_one_source_out(runs: list[Run]) -> list[Result]:
    """Each source's runs, predicted with the constants fitted on all the other sources."""
    out: list[Result] = []
    for source in sorted({r.source for r in runs}):
        fitted = fit_sustained([r for r in runs if r.source != source])
        out += evaluate([r for r in runs if r.source == source], fitted)
    return out


def flop_consistency(runs: list[Run]) -> list[dict[str, Any]]:
    """Where a source gives two figures for a run, the second as its FLOP count derives it
    from the first: the check that each row is read with the count its source uses."""
    out = []
    for run in runs:
        pub, gpus = run.row["published"], run.cluster.devices
        peak = chip_of(run).peak(run.training.precision)
        step = run.published_step_s
        if pub["metric"] == "iteration_s" and "mfu" in pub:
            flops = training_flops(run.model, run.training.global_batch, "none")
            derived = flops / (step * gpus * peak)
            out.append({"id": run.id, "what": "MFU", "published": pub["mfu"], "derived": derived})
        if pub["metric"] == "iteration_s" and "tflops_per_gpu" in pub:
            flops = source_flops(run.model, run.training, pub["tflops_flops"])
            derived = flops / (step * gpus) / 1e12
            out.append(
                {
                    "id": run.id,
                    "what": "TFLOP/s",
                    "published": pub["tflops_per_gpu"],
                    "derived": derived,
                }
            )
        if pub["metric"] == "tflops_per_gpu" and "mfu" in pub:
            derived = pub["value"] * 1e12 / peak
            out.append({"id": run.id, "what": "MFU", "published": pub["mfu"], "derived": derived})
    return out


def interleavings(layers: int, pp: int, most: int = 8) -> list[int]:
    """Chunks a pipeline rank can take: each the same whole number of layers (a pipeline whose
    ranks hold unequal layers, such as Llama 3's, counts its rounded share)."""
    share = round(layers / pp)
    return [v for v in range(1, min(most, share) + 1) if share % v == 0]


def goal_met(results: list[Result]) -> bool:
    errors = [abs(r.error) for r in results]
    within = sum(err <= GOAL_WITHIN for err in errors) / len(errors)
    return within >= GOAL_SHARE and max(errors) <= GOAL_MAX


def best_layout_gap(run: Run) -> tuple[float, Prediction | None]:
    """How much slower the published layout is predicted to be than the planner's best
    (0.05: 5% slower), among the layouts that fit, under the run's own training settings."""
    ranked, _ = rank_layouts(run.model, run.cluster, run.training)
    if not ranked:
        return math.inf, None
    mine = predict(run.model, run.cluster, run.training, run.layout)
    return mine.step_time_s / ranked[0].step_time_s - 1, ranked[0]
