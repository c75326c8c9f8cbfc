"""The GPU step model against the published figures its pieces come from."""

from __future__ import annotations

from dataclasses import replace

import pytest

from distml.layout import Layout
from distml.plan import DEVICES, Cluster, ModelSpec, Training, predict
from distml.plan.collectives import Group, collective_s, group
from distml.plan.devices import CHIPS, NETWORKS
from distml.plan.gpu_step import micro_batch
from distml.plan.kernels import gemm_s

A100 = CHIPS["a100"]
BURST = replace(A100, sustained=1.0)  # a kernel benchmark runs seconds, not hours


@pytest.mark.parametrize(
    "m,n,k,tflops",
    [
        (1024, 1024, 1024, 119.4),
        (2048, 2048, 2048, 221.8),
        (4096, 4096, 4096, 228.0),
        (8192, 8192, 8192, 253.7),
        (16384, 16384, 16384, 256.5),
        (1024, 2145, 1024, 132.8),
        (6144, 12288, 12288, 250.8),
        (802816, 192, 768, 157.8),  # thin: bound by memory as much as by the tensor cores
    ],
)
def test_gemm_by_shape_against_cublaslt_on_an_a100(m, n, k, tflops):
    # Azure AI-benchmarking-guide, ND A100 v4: cuBLASLt FP16, random data.
    achieved = 2 * m * n * k / gemm_s(BURST, m, n, k, 2) / 1e12
    assert achieved == pytest.approx(tflops, rel=0.12)


# Korthikanti et al. 2022, Table 4: one layer of the 22B model (h=6144, 64 heads, t=8, s=2048,
# micro-batch 4) on DGX A100s, forward and backward in ms.
TABLE_4 = [
    (False, "none", 7.7, 11.9),
    (True, "none", 7.2, 11.8),
    (False, "full", 7.7, 19.5),
    (False, "selective", 7.7, 13.2),
    (True, "selective", 7.2, 13.1),
]


@pytest.mark.parametrize("sequence_parallel,recompute,forward_ms,backward_ms", TABLE_4)
def test_one_layer_against_korthikanti_table_4(
    sequence_parallel, recompute, forward_ms, backward_ms
):
    model = ModelSpec(layers=1, hidden=6144, heads=64, seq=2048, vocab=51200)
    training = Training(4, 4, recompute=recompute, sequence_parallel=sequence_parallel)
    parts = micro_batch(BURST, NETWORKS["dgx-a100"], model, training, Layout(tp=8), 1).parts
    forward = parts["layer_forward_s"] + parts["layer_tp_forward_exposed_s"]
    backward = (
        parts["layer_backward_s"]
        + parts["layer_recompute_s"]
        + parts["layer_tp_backward_exposed_s"]
    )
    assert forward * 1e3 == pytest.approx(forward_ms, rel=0.10)
    assert backward * 1e3 == pytest.approx(backward_ms, rel=0.16)


def test_groups_sit_where_megatron_puts_them():
    # tp innermost: a tp=8 group fills a node; its data-parallel peers are one a node.
    layout = Layout.sharded(4, 1, tp=8, pp=2)
    assert group(layout, "tp", 8) == Group(8, 8)
    assert group(layout, "data", 8) == Group(4, 1)
    assert group(Layout.sharded(16, 0, tp=2), "data", 8) == Group(16, 4)
    assert group(Layout.sharded(1, 0, tp=16), "tp", 8).nodes == 2


def test_hierarchical_all_reduce_charges_each_link():
    net = NETWORKS["dgx-h100"]
    nbytes = 1e9
    inside = collective_s(net, "all_reduce", nbytes, Group(8, 8))
    assert inside == pytest.approx(2 * 7 / 8 * nbytes / net.nvlink_busbw + net.intra_latency_s)
    across = collective_s(net, "all_reduce", nbytes, Group(4, 1))  # one GPU a node
    line = net.nic_bw * net.nic_efficiency
    assert across == pytest.approx(2 * 3 / 4 * nbytes / line + 2 * net.inter_latency_s)
    # Four GPUs in each of two nodes: NVLink inside, four adapters a node between.
    both = collective_s(net, "all_reduce", nbytes, Group(8, 4))
    expected = 2 * 3 / 4 * nbytes / net.nvlink_busbw + 2 * 1 / 2 * nbytes / 4 / line
    assert both == pytest.approx(expected + net.intra_latency_s + net.inter_latency_s)
    assert collective_s(net, "reduce_scatter", nbytes, Group(8, 8)) < inside


GPT_13B = ModelSpec(layers=40, hidden=5120, heads=40, seq=2048, vocab=51200)


def test_named_gpu_steps_are_slower_than_peak_and_say_what_they_assume():
    cluster = Cluster(DEVICES["h100"], 64)
    training = Training(512, 1, recompute="selective", sequence_parallel=True)
    pred = predict(GPT_13B, cluster, training, Layout.sharded(8, 1, tp=8))
    assert 0.2 < pred.mfu < 0.6  # no longer every FLOP at the peak
    for key in ("device", "attention", "network", "placement", "overlap"):
        assert pred.assumptions[key]
    assert "inside a node" in pred.assumptions["placement"]
    assert pred.breakdown["dp_exposed_s"] <= pred.breakdown["dp_comm_s"]


def test_overlap_is_explicit():
    cluster = Cluster(DEVICES["a100"], 64)
    layout = Layout.sharded(8, 0, tp=8)
    hidden = predict(GPT_13B, cluster, Training(512, 4), layout)
    after = predict(GPT_13B, cluster, Training(512, 4, dp_overlap=False), layout)
    assert after.step_time_s - hidden.step_time_s == pytest.approx(
        hidden.breakdown["dp_comm_s"] - hidden.breakdown["dp_exposed_s"]
    )
    behind = predict(GPT_13B, cluster, Training(512, 4, tp_overlap=True), layout)
    assert behind.step_time_s < hidden.step_time_s


def test_tensor_parallelism_across_nodes_costs_more_than_inside_one():
    cluster = Cluster(DEVICES["h100"], 16)
    training = Training(64, 1)
    inside = predict(GPT_13B, cluster, training, Layout.sharded(2, 0, tp=8))
    across = predict(GPT_13B, cluster, training, Layout.sharded(1, 0, tp=16, pp=1))
    assert across.breakdown["tp_exposed_s"] > 2 * inside.breakdown["tp_exposed_s"]
    assert "across nodes" in across.assumptions["placement"]


def test_a_described_network_changes_only_its_links():
    slow = replace(NETWORKS["dgx-h100"], nic_bw=100e9 / 8)
    training = Training(512, 1)
    layout = Layout.sharded(64, 0)
    fast = predict(GPT_13B, Cluster(DEVICES["h100"], 64), training, layout)
    cheap = predict(GPT_13B, Cluster(DEVICES["h100"], 64, network=slow), training, layout)
    assert cheap.breakdown["dp_comm_s"] > 2 * fast.breakdown["dp_comm_s"]  # NIC a quarter
    assert cheap.compute_s == fast.compute_s
