"""From every rank's step records to the run's summary: waits, stragglers, totals.

Synchronisation wait is derived, not sampled: in synchronous data parallelism the gradient
all-reduce of step t cannot finish on any rank before the slowest rank has computed its gradients,
so rank r waits ``max_r' compute(t, r') - compute(t, r)`` of its exposed communication time; the
rest of the exposed time is communication proper.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any


def attribute_waits(per_rank: list[list[dict[str, Any]]]) -> None:
    """Split each record's ``exposed_comm_s`` into ``sync_wait_s`` and ``comm_s``, in place."""
    steps = min((len(r) for r in per_rank), default=0)
    for t in range(steps):
        slowest = max(records[t]["compute_s"] for records in per_rank)
        for records in per_rank:
            rec = records[t]
            wait = min(slowest - rec["compute_s"], rec["exposed_comm_s"])
            rec["sync_wait_s"] = wait
            rec["comm_s"] = rec["exposed_comm_s"] - wait


def find_stragglers(per_rank: list[list[dict[str, Any]]], factor: float) -> list[dict[str, Any]]:
    """Ranks whose median compute time exceeds ``factor`` x the median of the other ranks.

    Against the *other* ranks, so that with two ranks the slow one is not half of its own yardstick.
    """
    medians = [
        statistics.median(r["compute_s"] for r in records) if records else 0.0
        for records in per_rank
    ]
    found = []
    for rank, m in enumerate(medians):
        others = medians[:rank] + medians[rank + 1 :]
        baseline = statistics.median(others) if others else 0.0
        if baseline > 0 and m > factor * baseline:
            found.append({"rank": rank, "median_compute_s": m, "ratio": m / baseline})
    return found


def _sum_by_key(dicts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = defaultdict(int)
    for d in dicts:
        for k, v in d.items():
            total[k] += v
    return dict(total)


def summarize(
    per_rank: list[list[dict[str, Any]]],
    straggler_factor: float,
    measured_waits: bool = False,
    lockstep: bool = True,
    ranks_per_batch: int = 1,
) -> dict[str, Any]:
    """Totals over the run. Byte counts are per rank (rank 0's); times are sums over steps.

    ``ranks_per_batch``: how many ranks record the same samples (tensor-parallel peers and
    pipeline stages each see their data rank's whole batch); samples count once.

    ``measured_waits``: the records carry their own ``sync_wait_s`` (a parameter server's), which
    is kept; otherwise waits are derived from the ranks' compute times (:func:`attribute_waits`).
    ``lockstep``: every step of every rank ends together (a collective), so a step lasts as long
    as its slowest rank. Otherwise (asynchronous parameter-server workers, which may take
    different numbers of steps) the ranks run side by side: training lasts as long as the busiest
    rank, and ``steps`` and rank 0's totals are all of rank 0's.
    """
    if not measured_waits:
        attribute_waits(per_rank)
    if lockstep:
        steps = min((len(r) for r in per_rank), default=0)
        per_rank_steps = [records[:steps] for records in per_rank]
        train_s = sum(max(records[t]["step_s"] for records in per_rank) for t in range(steps))
    else:
        per_rank_steps = per_rank
        steps = len(per_rank[0]) if per_rank else 0
        train_s = max((sum(r["step_s"] for r in records) for records in per_rank), default=0.0)
    rank0 = per_rank_steps[0] if per_rank else []
    samples = sum(rec["samples"] for records in per_rank_steps for rec in records)
    samples /= ranks_per_batch
    ranks = []
    for rank, records in enumerate(per_rank):
        ranks.append(
            {
                "rank": rank,
                "step_s": sum(r["step_s"] for r in records),
                "compute_s": sum(r["compute_s"] for r in records),
                "comm_s": sum(r["comm_s"] for r in records),
                "sync_wait_s": sum(r["sync_wait_s"] for r in records),
                "energy_j": sum(r["energy_j"] for r in records),
                "peak_mem_bytes": max((r["peak_mem_bytes"] for r in records), default=0),
            }
        )
    return {
        "steps": steps,
        "final_loss": rank0[-1]["loss"] if rank0 else None,
        "train_s": train_s,
        "samples_per_s": samples / train_s if train_s > 0 else 0.0,
        "comm_bytes": _sum_by_key([r["comm_bytes"] for r in rank0]),
        "wire_bytes": _sum_by_key([r["wire_bytes"] for r in rank0]),
        "comm_s": sum(r["comm_s"] for r in rank0),
        "sync_wait_s": sum(r["sync_wait_s"] for r in rank0),
        "compute_s": sum(r["compute_s"] for r in rank0),
        "energy_j": sum(r["energy_j"] for r in ranks),
        "stragglers": find_stragglers(per_rank, straggler_factor),
        "ranks": ranks,
    }


def memory_per_rank(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, int]]:
    """Each rank's model state (its last step's) and peak activations over the run, in bytes."""
    out = []
    for rank, records in enumerate(per_rank):
        if not records or not records[-1].get("memory_bytes"):
            continue
        mem = dict(records[-1]["memory_bytes"])
        mem["activations"] = max(r["memory_bytes"].get("activations", 0) for r in records)
        mem["total"] = sum(v for k, v in mem.items())
        out.append({"rank": rank, **mem})
    return out


def measured_bubble(per_rank: list[list[dict[str, Any]]]) -> dict[str, Any] | None:
    """The idle share of a pipeline step, 1 - (stage compute / step span), for each pipeline
    rank as the median over steps (the first left out: it infers shapes and builds the
    schedule), and their mean as the pipeline's bubble.

    A step spans the longest of the ranks' schedule runs: a stage that is done early (the last
    one, while the first still drains its backward passes) idles until the step ends. With equal
    stages each idles (p - 1) of (m + p - 1) slots; unequal stages shift idle time from the
    busiest to the others, as ``per_rank`` shows.
    """
    timed = [[r for r in records[1:] if r.get("schedule_s")] for records in per_rank]
    timed = [records for records in timed if records]
    if not timed:
        return None
    steps = min(len(records) for records in timed)
    span = [max(records[t]["schedule_s"] for records in timed) for t in range(steps)]
    shares = [
        statistics.median(1 - records[t]["stage_busy_s"] / span[t] for t in range(steps))
        for records in timed
    ]
    return {"measured": statistics.fmean(shares), "per_rank": shares}
