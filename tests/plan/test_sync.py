"""The synchronisation strategies' bytes against torch's own PowerSGD decision and the ring
formulas, a step's time on a slower link, and the choice by time to a target."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from distml.config import GPTConfig, StrategyConfig, build_config, set_value
from distml.models import GPT
from distml.plan.sync import (
    AUTO_SYNCS,
    TCP_PAYLOAD_FRACTION,
    Sync,
    choose,
    data_parallel_step,
    ddp_buckets,
    line_rate_bytes,
    pipeline_step_seconds,
    powersgd_elements,
    step_seconds,
    steps_to_target,
    sync_of,
    wire_bytes_by_collective,
    wire_bytes_per_step,
)

SHAPES = [tuple(p.shape) for p in GPT(GPTConfig()).parameters()]
PARAMS = sum(math.prod(s) for s in SHAPES)


@pytest.mark.parametrize("rank", [1, 2, 8, 64])
def test_powersgd_compresses_what_torchs_hook_compresses(rank):
    expected = 0
    for shape in SHAPES:
        n, m = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
        compress, full, compressed = _should_compress(n, m, min(n, m, rank), 2)
        expected += compressed if compress else full
    assert powersgd_elements(SHAPES, rank) == expected


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_bytes_follow_the_ring_formulas(ranks):
    ring = 2 * (ranks - 1) / ranks * 4 * PARAMS
    kw = {"steps": 16}
    assert wire_bytes_per_step(Sync("ddp"), SHAPES, ranks, **kw) == pytest.approx(ring)
    assert wire_bytes_per_step(Sync("ddp-fp16"), SHAPES, ranks, **kw) == pytest.approx(ring / 2)
    assert wire_bytes_per_step(Sync("local-sgd", every=8), SHAPES, ranks, **kw) == pytest.approx(
        ring / 8
    )
    # ZeRO-3: all-gather forward, all-gather backward, reduce-scatter: 3 x (N-1)/N x 4P.
    assert wire_bytes_per_step(Sync("fsdp"), SHAPES, ranks, **kw) == pytest.approx(
        3 * (ranks - 1) / ranks * 4 * PARAMS
    )
    # gloo all-reduces the gradients in place of the reduce-scatter.
    assert wire_bytes_per_step(Sync("fsdp"), SHAPES, ranks, gloo=True, **kw) == pytest.approx(
        4 * (ranks - 1) / ranks * 4 * PARAMS
    )
    # By collective: the all-gathers apart, since a link may move them at another rate.
    gathers = 2 * (ranks - 1) / ranks * 4 * PARAMS
    assert wire_bytes_by_collective(Sync("fsdp"), SHAPES, ranks, gloo=True, **kw) == (
        pytest.approx({"all_gather": gathers, "all_reduce": ring})
    )
    assert wire_bytes_by_collective(Sync("fsdp"), SHAPES, ranks, **kw) == (
        pytest.approx({"all_gather": gathers, "reduce_scatter": ring / 2})
    )
    activations = wire_bytes_per_step(
        Sync("pipeline"), SHAPES, 2, boundary_activation_bytes=1e6, **kw
    )
    assert activations == 2e6  # forward, then the gradients back
    # PowerSGD: two plain steps, then the factors.
    low = 2 * (ranks - 1) / ranks * 4 * powersgd_elements(SHAPES, 2)
    assert wire_bytes_per_step(Sync("powersgd", rank=2), SHAPES, ranks, **kw) == pytest.approx(
        (2 * ring + 14 * low) / 16
    )
    with pytest.raises(ValueError, match="unknown"):
        wire_bytes_per_step(Sync("gossip"), SHAPES, ranks, **kw)


def test_a_pipeline_step_on_a_slower_link_from_the_fast_links_step():
    fast = {"all_reduce": 1e9}
    slow = {"all_reduce": 1e6}
    shared = slow | {"exchange": 5e5}  # both ways at once share the rate
    base, message = 0.072, 1.3e5
    assert pipeline_step_seconds(base, 2, 4, message, fast, fast) == pytest.approx(base)
    duplex = pipeline_step_seconds(base, 2, 4, message, fast, slow)
    sharing = pipeline_step_seconds(base, 2, 4, message, fast, shared)
    end_to_end = step_seconds(base, {"send_recv": 2 * 4 * message}, fast, slow)
    assert base < duplex < sharing <= end_to_end * 1.01


def test_a_slower_link_adds_what_the_bytes_take_at_its_rate():
    fast, slow = {"all_reduce": 1e8}, {"all_reduce": 1e6}
    assert step_seconds(0.3, {"all_reduce": 1e6}, fast, fast) == 0.3
    assert step_seconds(0.3, {"all_reduce": 1e6}, fast, slow) == pytest.approx(0.3 + 1.0 - 0.01)
    # Each collective at its own rate; one with none of its own at the all-reduce's.
    wire = {"all_reduce": 1e6, "all_gather": 1e6, "send_recv": 1e6}
    gathers_slower = slow | {"all_gather": 5e5}
    assert step_seconds(0.3, wire, fast, gathers_slower) == pytest.approx(0.3 + 1 + 2 + 1 - 0.03)
    assert line_rate_bytes(100e6) == pytest.approx(12.5e6 * TCP_PAYLOAD_FRACTION)


def test_the_choice_is_the_fastest_to_the_target_not_the_fastest_step():
    curve = [(8, 3.4), (16, 3.1), (24, 3.0)]
    assert steps_to_target(curve, 3.1) == 16
    assert steps_to_target(curve, 3.1005) == 16 and steps_to_target(curve, 2.0) is None
    ranked = choose({"fast-step": 0.1, "steady": 0.2, "never": 0.01},
                    {"fast-step": 48, "steady": 16, "never": None})  # fmt: skip
    assert [c.label for c in ranked] == ["steady", "fast-step", "never"]
    assert ranked[0].time_to_target_s == pytest.approx(3.2)


def test_a_data_parallel_step_keeps_what_ddp_hid_and_pays_what_its_bytes_add():
    ratio_r2 = powersgd_elements(SHAPES, 2) / PARAMS
    # DDP hid all of its 0.1 s: fp16 and PowerSGD hide theirs too; Local SGD's averaging
    # comes after the step, where nothing hides it.
    hidden = (0.3, 0.1, 0.0)
    assert data_parallel_step(Sync("ddp"), SHAPES, 2, hidden) == hidden
    assert data_parallel_step(Sync("ddp-fp16"), SHAPES, 2, hidden) == pytest.approx((0.3, 0.05, 0))
    local = data_parallel_step(Sync("local-sgd", every=8), SHAPES, 2, hidden)
    assert local == pytest.approx((0.3 + 0.1 / 8, 0.1 / 8, 0.1 / 8))
    # DDP showed 0.3 of its 0.4 s (0.1 hidden): a tenth of the bytes hide behind the same 0.1.
    slow = (1.0, 0.4, 0.3)
    assert data_parallel_step(Sync("ddp-fp16"), SHAPES, 2, slow) == pytest.approx((0.8, 0.2, 0.1))
    step, comm, exposed = data_parallel_step(Sync("powersgd", rank=2), SHAPES, 2, slow)
    # (its two plain steps spread over a long run)
    assert comm == pytest.approx(0.4 * ratio_r2, rel=1e-3)
    assert exposed == pytest.approx(max(0.0, 0.4 * ratio_r2 - 0.1), abs=1e-4)
    assert step == pytest.approx(0.7 + exposed)


def test_powersgd_on_gloo_hides_nothing_and_pays_its_latencies_and_its_hook():
    """distml runs the hook one bucket at a time on gloo: all of its bytes show, and so does
    each of its three all-reduces a bucket; its own work adds to the step."""
    slow = (1.0, 0.4, 0.3)
    sync = Sync("powersgd", rank=2)
    step, comm, exposed = data_parallel_step(sync, SHAPES, 2, slow, gloo=True, latency_s=0.002,
                                             hook_s=0.01)  # fmt: skip
    assert exposed == pytest.approx(comm + 3 * ddp_buckets(SHAPES) * 0.002)
    assert step == pytest.approx(0.7 + exposed + 0.01)
    # Off gloo the hook overlaps the backward pass as DDP did; its work still counts.
    on_nccl = data_parallel_step(sync, SHAPES, 2, slow, latency_s=0.002, hook_s=0.01)
    assert on_nccl[0] == pytest.approx(0.7 + max(0.0, comm - 0.1) + 0.01)


@pytest.mark.parametrize(
    "cfg", [GPTConfig(), GPTConfig(hidden=64, layers=2), GPTConfig(hidden=1024, layers=4)]
)
def test_buckets_are_those_torchs_reducer_assigns(cfg):
    params = list(GPT(cfg).parameters())
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20]  # the reducer's, rebuilding
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [torch.empty(p.shape) for p in reversed(params)], limits
    )
    assert ddp_buckets([tuple(p.shape) for p in params]) == len(buckets)


def test_each_synchronisation_is_the_one_its_run_settings_train_under():
    for sync in AUTO_SYNCS:
        fields: dict = {}
        for key, value in sync.run_settings():
            set_value(fields, key, value)
        cfg = build_config(**fields)
        assert sync_of(cfg.strategy) == sync, sync.label
    assert sync_of(StrategyConfig(compression="bf16")) == Sync("ddp-fp16")
    with pytest.raises(ValueError, match="a layout"):
        Sync("fsdp").run_settings()
