"""The PowerSGD probe times torch's own hook, in a process of its own, on gradients of a
model's shapes: every rank asked for gets a time, and a probe that fails says why."""

from __future__ import annotations

import pytest

from distml.config import GPTConfig
from distml.plan.auto import gpt_shapes
from distml.plan.hook_probe import powersgd_hook_s

pytestmark = pytest.mark.distributed  # a process with a distributed world of its own


def test_each_rank_gets_its_hooks_time_a_step():
    shapes = gpt_shapes(GPTConfig(layers=2, hidden=64, heads=2))
    costs = powersgd_hook_s(shapes, ranks=(1, 4), threads=1, steps=3)
    assert set(costs) == {1, 4} and all(0 < s < 1 for s in costs.values())


def test_a_probe_that_fails_raises_with_its_cause():
    with pytest.raises(RuntimeError, match="the PowerSGD probe failed"):
        powersgd_hook_s([(8, 8)], ranks=(2,), threads=0)  # torch refuses 0 threads
