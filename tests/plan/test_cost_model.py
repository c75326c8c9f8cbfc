"""The cost model against the worked numbers its papers publish."""

from __future__ import annotations

from dataclasses import replace

import pytest

from distml.plan import DEVICES, Cluster, Layout, ModelSpec, Training, predict
from distml.plan.cost_model import (
    Device,
    activation_bytes_per_layer,
    bubble_fraction,
    days_to_train,
    model_state_bytes,
    training_flops,
)
from distml.plan.simulator import pipeline_step_s
from distml.plan.spec import BYTES

GPT3 = ModelSpec(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, params=175e9)


@pytest.mark.parametrize("zero,gigabytes", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_paper_figure_1_7_5b_params_on_64_gpus(zero, gigabytes):
    # Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, K = 12, Nd = 64.
    state = model_state_bytes(7.5e9, Layout.sharded(64, zero), Training(global_batch=64))
    assert sum(state.values()) / 1e9 == pytest.approx(gigabytes, abs=0.05)  # paper rounds


def test_korthikanti_activations():
    t, b = 8, 1
    s, h, a = GPT3.seq, GPT3.hidden, GPT3.heads
    full_sp = activation_bytes_per_layer(GPT3, Training(1, b, sequence_parallel=True), t)
    assert full_sp == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)
    no_tp = activation_bytes_per_layer(GPT3, Training(1, b), 1)
    assert no_tp == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    # Section 5: selective recomputation saves about 70% of GPT-3's activation memory.
    selective = activation_bytes_per_layer(
        GPT3, Training(1, b, recompute="selective", sequence_parallel=True), t
    )
    assert 1 - selective / full_sp == pytest.approx(0.70, abs=0.01)
    full = activation_bytes_per_layer(GPT3, Training(1, b, recompute="full"), t)
    assert full == 2 * s * b * h


def test_narayanan_training_time_estimates():
    # Section 5.1: GPT-3 (175B, 300B tokens) on 1024 A100s at 140 TFLOP/s: about 34 days;
    # 1T parameters, 450B tokens, 3072 GPUs at 163 TFLOP/s: about 84 days.
    assert days_to_train(300e9, 175e9, 1024, 140e12) == pytest.approx(34, abs=0.5)
    assert days_to_train(450e9, 1e12, 3072, 163e12) == pytest.approx(84, abs=1.0)
    # Their FLOPs formula tends to 8 x tokens x params when h dominates s and V/l.
    flops = training_flops(GPT3, 1536, "full")
    approx = 8 * 1536 * GPT3.seq * 12 * GPT3.layers * GPT3.hidden**2
    assert flops / approx == pytest.approx(1 + 2048 / (6 * 12288) + 51200 / (16 * 96 * 12288))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 8)])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(p, m):
    assert bubble_fraction(Layout(pp=p), m) == pytest.approx((p - 1) / (m + p - 1))
    interleaved = bubble_fraction(Layout(pp=p, schedule="interleaved", chunks=2), m)
    assert interleaved == pytest.approx((p - 1) / (2 * m + p - 1))


def test_prediction_of_a_layout():
    cluster = Cluster(DEVICES["a100"], devices=64)
    train = Training(global_batch=512, micro_batch=1, recompute="selective", sequence_parallel=True)
    model = ModelSpec(layers=32, hidden=4096, heads=32, seq=2048, vocab=51200)
    pred = predict(model, cluster, train, Layout.sharded(8, 1, tp=8, pp=1))
    assert pred.memory_bytes["total"] < 80e9 and not pred.notes
    assert 0 < pred.mfu <= 1 and pred.tokens_per_s > 0
    dp_bytes = sum(b for kind, b in pred.comm_bytes.items() if kind.startswith("dp_"))
    assert pred.comm_bytes["tp_all_reduce"] > dp_bytes
    assert pred.energy_j == pytest.approx(pred.step_time_s * 64 * 400)
    with pytest.raises(ValueError, match="= 32, but the cluster has 64"):
        predict(model, cluster, train, Layout(dp=4, tp=8))


def test_data_parallel_traffic_hides_behind_backward_until_it_outlasts_it():
    # The formulas of a device `distml bench` measured (no kernel-level model of it).
    model = ModelSpec(layers=4, hidden=1024, heads=8, seq=512, vocab=1000)
    cluster = Cluster(Device("measured", 80e9, 312e12, 300e9, 25e9, 5e-6, 400.0), devices=8)
    pred = predict(model, cluster, Training(global_batch=64), Layout(dp=8))
    assert pred.comm_exposed_s == pytest.approx(max(0.0, pred.comm_s - pred.compute_s * 2 / 3))
    assert pred.step_time_s == pytest.approx(pred.compute_s + pred.comm_exposed_s)


def test_fsdp_between_nodes_gathers_at_the_measured_all_gather_rate():
    model = ModelSpec(layers=4, hidden=1024, heads=8, seq=512, vocab=1000)
    train, layout = Training(global_batch=2), Layout.sharded(2, 3)
    shard = BYTES[train.precision] * model.layer_weights / 2  # a block's half on each rank
    plain = Device("cpu", 80e9, 1e11, 1e9, 1e7, 1e-4, 50.0)
    # Measured: all-gathers slower than the all-reduce, and slower still for larger shards.
    measured = replace(plain, inter_allgather_bw=((shard / 4, 6e6), (shard * 4, 4e6)))
    assert measured.allgather_bw(shard) == pytest.approx(5e6)  # halfway in log(size)
    assert measured.allgather_bw(1.0) == 6e6 and measured.allgather_bw(1e12) == 4e6
    assert plain.allgather_bw(shard) == plain.inter_bw
    one, other = (
        predict(model, Cluster(dev, devices=2, devices_per_node=1), train, layout)
        for dev in (plain, measured)
    )
    gathered = one.comm_bytes["dp_all_gather"]
    assert other.comm_s - one.comm_s == pytest.approx(gathered / 5e6 - gathered / 1e7)
    # One node: the link inside it, whatever the nodes' all-gathers do.
    inside = [predict(model, Cluster(d, devices=2), train, layout) for d in (plain, measured)]
    assert inside[0].comm_s == inside[1].comm_s


def test_a_pipeline_across_nodes_runs_torchs_1f1b_on_the_measured_link():
    model = ModelSpec(layers=4, hidden=256, heads=4, seq=128, vocab=1000)
    train, layout = Training(global_batch=16, micro_batch=4), Layout(pp=2)
    plain = Device("cpu", 80e9, 1e10, 1e9, 1e7, 1e-4, 50.0)
    nodes = {
        ways: Cluster(replace(plain, inter_exchange_bw=ways), devices=2, devices_per_node=1)
        for ways in ((), ((1.0, 1e7),), ((1.0, 5e6),))
    }
    end_to_end, duplex, shared = (predict(model, c, train, layout) for c in nodes.values())
    micro_s = end_to_end.compute_s / 4
    message = end_to_end.comm_bytes["pp_send_recv"] / 8
    assert duplex.step_time_s == pytest.approx(
        pipeline_step_s(2, 4, micro_s / 3, 2 * micro_s / 3, message, 1e7, 1e7)
    )
    # Not measured both ways: every transfer on the critical path, as before.
    assert duplex.step_time_s < shared.step_time_s <= end_to_end.step_time_s * 1.001
    assert shared.step_time_s == pytest.approx(
        (shared.compute_s + shared.comm_exposed_s) / (1 - shared.bubble_fraction)
    )


@pytest.mark.parametrize("points", [((1e6, 0.0),), ((2e6, 1e7), (1e6, 1e7)), ((1e6, 1e7),) * 2])
def test_measured_all_gathers_must_be_positive_and_by_growing_size(points):
    with pytest.raises(ValueError, match="inter_allgather_bw"):
        Device("cpu", 80e9, 1e11, 1e9, 1e7, 1e-4, 50.0, inter_allgather_bw=points)


def test_a_measured_exchange_must_be_positive():
    with pytest.raises(ValueError, match="inter_exchange_bw"):
        Device("cpu", 80e9, 1e11, 1e9, 1e7, 1e-4, 50.0, inter_exchange_bw=((1e5, 0.0),))


@pytest.mark.parametrize("tokens", [(2, 16), (4, 32)])
def test_activations_of_distmls_gpt_are_what_autograd_saves(tokens):
    # The oracle: the tensors autograd keeps for backward in one process, counted by storage.
    import torch

    from distml.config import GPTConfig
    from distml.models import GPT, lm_loss
    from distml.plan.auto import model_spec
    from distml.plan.cost_model import activation_bytes
    from distml.telemetry.memory import ActivationTracker

    batch, seq = tokens
    cfg = GPTConfig(vocab_size=64, seq_len=seq, layers=3, hidden=64, heads=4)
    x = torch.randint(0, 64, (batch, seq))
    tracker = ActivationTracker()
    with tracker:
        lm_loss(GPT(cfg)(x), x).backward()
    predicted = activation_bytes(
        model_spec(cfg), Training(batch, batch, precision="fp32"), Layout(), m=1
    )
    assert predicted == pytest.approx(tracker.peak_bytes, rel=0.01)
