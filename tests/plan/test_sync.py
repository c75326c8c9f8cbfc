"""The synchronisation strategies' bytes against torch's own PowerSGD decision and the ring
formulas, a step's time on a slower link, and the choice by time to a target."""

from __future__ import annotations

import math

import pytest
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from distml.config import GPTConfig
from distml.models import GPT
from distml.plan.sync import (
    TCP_PAYLOAD_FRACTION,
    Sync,
    choose,
    line_rate_bytes,
    powersgd_elements,
    step_seconds,
    steps_to_target,
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


def test_a_slower_link_adds_what_the_bytes_take_at_its_rate():
    assert step_seconds(0.3, 1e6, 1e8, 1e8) == 0.3
    assert step_seconds(0.3, 1e6, 1e8, 1e6) == pytest.approx(0.3 + 1.0 - 0.01)
    assert line_rate_bytes(100e6) == pytest.approx(12.5e6 * TCP_PAYLOAD_FRACTION)


def test_the_choice_is_the_fastest_to_the_target_not_the_fastest_step():
    curve = [(8, 3.4), (16, 3.1), (24, 3.0)]
    assert steps_to_target(curve, 3.1) == 16
    assert steps_to_target(curve, 3.1005) == 16 and steps_to_target(curve, 2.0) is None
    ranked = choose({"fast-step": 0.1, "steady": 0.2, "never": 0.01},
                    {"fast-step": 48, "steady": 16, "never": None})  # fmt: skip
    assert [c.label for c in ranked] == ["steady", "fast-step", "never"]
    assert ranked[0].time_to_target_s == pytest.approx(3.2)
