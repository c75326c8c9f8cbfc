"""A step from measured pieces, against the same sums done by hand."""

from __future__ import annotations

import math

import pytest

from distml.plan import DEVICES, Cluster, Layout, Training, predict
from distml.plan.calibration import Calibration
from distml.plan.cost_model import ModelSpec

LAYER = 12 * 64**2 + 13 * 64
MODEL = ModelSpec(
    layers=4,
    hidden=64,
    heads=4,
    seq=16,
    vocab=32,
    params=4 * LAYER + 2 * 32 * 64 + 16 * 64,  # blocks, embeddings and head, positions
    embedding_params=(32 + 16) * 64,
)
BLOCK = {"fwd_s": 0.01, "fwdbwd_s": 0.03}
EDGE = {"embed_s": 0.001, "head_s": 0.002}
RATE = 1e-8  # AdamW seconds per parameter
ALPHA, BETA = 1e-3, 1e9  # every collective: 1 ms + n / 1 GB/s


def calibration(share: float = 1.0, **extra) -> Calibration:
    fits = {str(d): [ALPHA, BETA] for d in (2, 4)}
    return Calibration(
        model={"layers": 4, "hidden": 64, "heads": 4, "seq": 16, "vocab": 32},
        world=4,
        share=share,
        blocks={"4x1": BLOCK, "2x1": BLOCK, "16x1": BLOCK},
        edges={"4": EDGE, "2": EDGE, "16": EDGE},
        optimizer_s_per_param=RATE,
        collectives={
            "all_reduce": fits,
            "all_gather": fits,
            "reduce_scatter": fits,
            "p2p": {"2": [ALPHA, BETA]},
        },
        **extra,
    )


def fp32(global_batch: int, micro_batch: int) -> Training:
    return Training(global_batch, micro_batch, precision="fp32")


def test_data_parallel_on_shared_cores_adds_every_piece():
    cal = calibration(share=2.0)
    timing = cal.step(MODEL, fp32(16, 4), Layout(dp=4), m=1)
    n = MODEL.n_params
    compute = 4 * BLOCK["fwdbwd_s"] + EDGE["embed_s"] + EDGE["head_s"] + RATE * n
    buckets = math.ceil(4 * n / (25 * 2**20))  # one DDP bucket
    allreduce = buckets * ALPHA + 4 * n / BETA
    assert timing.compute_s == pytest.approx(compute)
    assert timing.exposed_s == pytest.approx(allreduce)  # shared cores: nothing overlaps
    assert timing.step_s == pytest.approx(compute + allreduce)


def test_devices_of_their_own_hide_the_gradients_behind_backward():
    timing = calibration(share=1.0).step(MODEL, fp32(16, 4), Layout(dp=4), m=1)
    assert timing.exposed_s == pytest.approx(max(0.0, timing.comm_s - timing.compute_s * 2 / 3))


def test_a_pipeline_is_stretched_by_its_bubble_unless_cores_are_shared():
    layout = Layout(pp=2, dp=2)
    # the last stage: 2 blocks x 4 micro-batches, the head each, AdamW on its parameters
    own = calibration(share=1.0).step(MODEL, fp32(16, 2), layout, m=4)
    shared = calibration(share=2.0).step(MODEL, fp32(16, 2), layout, m=4)
    bubble = 1 / (4 + 1)  # (p-1)/(m+p-1)
    assert own.step_s == pytest.approx((own.compute_s + own.exposed_s) / (1 - bubble))
    work = shared.compute_s + shared.exposed_s
    # idle stages lend their share: at least the work, at most the stretched work / share
    assert shared.step_s == pytest.approx(max(work, work / (1 - bubble) / 2.0))


def test_a_profiled_fsdp_stage_replaces_the_blocks_and_their_collectives():
    stage = {"sync_s": 0.2, "nosync_s": 0.16, "opt_s": 0.008}
    cal = calibration(share=2.0, sharded_stages={"4x1x4x3x4": stage})
    timing = cal.step(MODEL, fp32(16, 4), Layout.sharded(4, 3), m=1)
    rest = MODEL.n_params - 4 * MODEL.layer_params  # embeddings and head: the root unit
    compute = stage["sync_s"] + stage["opt_s"]
    compute += EDGE["embed_s"] + EDGE["head_s"] + RATE * rest / 4
    gather = 2 * ALPHA + 2 * 4 * rest / 4 / BETA  # before forward and before backward
    scatter = ALPHA + 4 * rest / BETA
    assert timing.compute_s == pytest.approx(compute)
    assert timing.step_s == pytest.approx(compute + gather + scatter)
    # a pipeline of 2 stages x 4 micro-batches: the gradients synchronise on the last only
    piped = calibration(share=2.0, sharded_stages={"2x1x2x3x2": stage})
    last = piped._stage(MODEL, fp32(16, 2), Layout.sharded(2, 3, pp=2), 4, stage=1)
    assert last.compute_s == pytest.approx(
        3 * stage["nosync_s"]
        + stage["sync_s"]
        + stage["opt_s"]
        + 4 * EDGE["head_s"]
        + RATE * (MODEL.edge_params[1]) / 2
    )


def test_pieces_it_lacks_give_none_and_predict_falls_back_to_the_formulas():
    cal = calibration()
    assert cal.step(MODEL, fp32(16, 8), Layout(dp=2, pp=2), m=1) is None  # no 8x1 block
    cluster = Cluster(DEVICES["a100"], devices=4, calibration=cal)
    measured = predict(MODEL, cluster, fp32(16, 4), Layout(dp=4))
    assert "step time from the calibration" in measured.notes
    assert measured.step_time_s == pytest.approx(
        cal.step(MODEL, fp32(16, 4), Layout(dp=4), 1).step_s
    )
    other_model = ModelSpec(layers=2, hidden=64, heads=4, seq=16, vocab=32, params=MODEL.params)
    assert (
        "step time from the calibration"
        not in predict(other_model, cluster, fp32(16, 4), Layout(dp=4)).notes
    )
    bf16 = predict(MODEL, cluster, Training(16, 4), Layout(dp=4))  # profiled in fp32 only
    assert "step time from the calibration" not in bf16.notes


def test_a_malformed_calibration_is_refused_by_name():
    with pytest.raises(ValueError, match=r"\[calibration\] is malformed"):
        Calibration.from_dict({"model": {"layers": 4}, "world": 4})


def test_collective_fit_recovers_latency_and_bandwidth():
    from distml.plan.profile import _fit

    sizes = [2.0**16, 2.0**18, 2.0**20, 2.0**22]
    alpha, beta = _fit(sizes, [1e-4 + n / 1e9 for n in sizes])
    assert alpha == pytest.approx(1e-4) and beta == pytest.approx(1e9)
    alpha, beta = _fit(sizes, [n / 2e9 * 1.02 for n in sizes])  # no latency: alpha is not < 0
    assert alpha == pytest.approx(0.0, abs=1e-12) and beta == pytest.approx(2e9 / 1.02)


def test_passes_of_a_profile_merge_into_the_median_of_each_number():
    from distml.plan.profile import median_of

    passes = [
        {"share": 2.0, "blocks": {"2x1": {"fwd_s": 0.010}}, "fit": {"2": [1e-3, 1e9]}},
        {"share": 9.0, "blocks": {"2x1": {"fwd_s": 0.030}}, "fit": {"2": [5e-3, 2e9]}},
        {"share": 2.2, "blocks": {"2x1": {"fwd_s": 0.011}}, "fit": {"2": [2e-3, 3e9]}},
    ]
    assert median_of(passes) == {
        "share": 2.2,
        "blocks": {"2x1": {"fwd_s": 0.011}},
        "fit": {"2": [2e-3, 2e9]},
    }
