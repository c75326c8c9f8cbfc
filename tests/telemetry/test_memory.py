"""The activation tracker against what autograd holds, counted by hand."""

from __future__ import annotations

import gc

import torch
from torch import nn

from distml.telemetry.memory import ActivationTracker


def test_the_peak_is_the_saved_activations_and_backward_releases_them():
    torch.manual_seed(0)
    layer = nn.Linear(64, 256)
    x = torch.randn(32, 64)
    tracker = ActivationTracker()
    with tracker:
        y = torch.relu(layer(x)).sum()  # saves x (the input) and relu's output; W is state
        saved = x.numel() * 4 + 32 * 256 * 4
        assert tracker.live_bytes == saved
        y.backward()
    assert tracker.peak_bytes == saved and tracker.live_bytes == 0


def test_a_graph_dropped_without_backward_is_freed_and_uncounted():
    # A pipeline stage's shape inference runs a forward and never its backward; a saved output
    # that held its own grad_fn kept such a graph alive through autograd's C++ side.
    layer = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Sigmoid())
    tracker = ActivationTracker()
    with tracker:
        out = layer(torch.randn(16, 64))
        assert tracker.live_bytes > 0
        del out
    gc.collect()
    assert tracker.live_bytes == 0
