"""Enumerate the layouts of a cluster and rank those that fit by predicted step time."""

from __future__ import annotations

from distml.layout import Layout
from distml.plan.cost_model import Cluster, ModelSpec, Prediction, Training, predict


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: ModelSpec, cluster: Cluster, training: Training) -> list[Layout]:
    """Every dp x tp x pp = devices with tp dividing the heads, pp at most the layers, and a
    global batch that splits into whole micro-batches per replica; ZeRO stages 0-3 where
    there is more than one replica. On a named GPU the tensor-parallel degree divides a node
    (or is whole nodes), and a pipeline also tries the interleaved schedule, with 2 to 4
    chunks a rank of whole layers each."""
    out = []
    per_node = cluster.devices_per_node
    for tp in divisors(cluster.devices):
        if model.heads % tp:
            continue
        if cluster.device.chip is not None and (per_node % tp if tp <= per_node else tp % per_node):
            continue  # a tensor-parallel group fills whole nodes or divides one
        for pp in divisors(cluster.devices // tp):
            dp = cluster.devices // (tp * pp)
            if pp > model.layers or training.global_batch % (dp * training.micro_batch):
                continue
            stages = range(4) if dp > 1 else (0,)
            chunks = [1]
            if pp > 1 and cluster.device.chip is not None and model.layers % pp == 0:
                chunks += [v for v in (2, 3, 4) if (model.layers // pp) % v == 0]
            for v in chunks:
                schedule = "interleaved" if v > 1 else "1f1b"
                out.extend(
                    Layout.sharded(dp, z, tp=tp, pp=pp, schedule=schedule, chunks=v) for z in stages
                )
    return out


def rank_layouts(
    model: ModelSpec, cluster: Cluster, training: Training, by: str = "time"
) -> tuple[list[Prediction], list[Prediction]]:
    """(layouts that fit, best first; layouts that do not fit in device memory)."""
    preds = [
        predict(model, cluster, training, lay)
        for lay in candidate_layouts(model, cluster, training)
    ]
    fits = [p for p in preds if p.memory_bytes["total"] <= cluster.device.memory_bytes]
    key = (lambda p: p.energy_j) if by == "energy" else (lambda p: p.step_time_s)
    return sorted(fits, key=key), [p for p in preds if p not in fits]
