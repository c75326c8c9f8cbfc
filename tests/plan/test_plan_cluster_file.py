"""distml plan --cluster with a described GPU cluster, and what its JSON says it assumed."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from distml.cli.main import app
from distml.plan.cluster_file import cluster_from_description

MODEL = [
    "--layers", "40", "--hidden", "5120", "--heads", "40", "--seq", "2048", "--vocab", "51200",
    "--global-batch", "512",
]  # fmt: skip

DESCRIBED = """
name = "32 x H100 on 200 Gb/s"
device = "h100"
devices = 32

[links]
nic_gbps = 200
"""


def test_a_described_cluster_is_planned_with_its_links(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(DESCRIBED)
    args = ["plan", *MODEL, "--cluster", str(path), "--tp", "8", "--zero", "1", "--json"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    (row,) = json.loads(out.output)["layouts"]
    assert row["layout"]["tp"] == 8 and row["layout"]["fsdp"] == 4
    assumed = row["assumptions"]
    assert "h100" in assumed["device"] and "200 Gb/s a GPU" in assumed["network"]
    assert "inside a node" in assumed["placement"] and assumed["overlap"]
    assert row["breakdown"]["microbatch_s"] > 0


def test_a_ranking_on_a_described_cluster_keeps_tensor_parallelism_in_a_node(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(DESCRIBED)
    out = CliRunner().invoke(app, ["plan", *MODEL, "--cluster", str(path), "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)["layouts"]
    assert rows and all(r["layout"]["tp"] in (1, 2, 4, 8) for r in rows)
    times = [r["step_time_s"] for r in rows]
    assert times == sorted(times)


@pytest.mark.parametrize(
    "text,message",
    [
        ('device = "h900"\ndevices = 8\n', "device 'h900' is not one of"),
        ('device = "a100"\ndevices = 0\n', "devices: Input should be greater than 0"),
        ('device = "a100"\ndevices = 8\ncolour = "red"\n', "colour: Extra inputs"),
        ('device = "a100"\ndevices = 8\nnetwork = "ethernet"\n', "network 'ethernet'"),
        ('device = "a100"\ndevices = 8\n[links]\nnic_efficiency = 2\n', "nic_efficiency"),
        ('device = "a100"\ndevices = [8\n', "cluster file"),
    ],
)
def test_a_bad_description_is_refused_with_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    out = CliRunner().invoke(app, ["plan", *MODEL, "--cluster", str(path)])
    assert out.exit_code == 2 and message in out.output, out.output


def test_a_description_overrides_only_what_it_names():
    cluster = cluster_from_description(
        {"device": "a100", "devices": 16, "links": {"nvlink_busbw_gbs": 150}}
    )
    net = cluster.links()
    assert net.nvlink_busbw == 150e9 and net.nic_bw == 200e9 / 8 and net.gpus_per_node == 8
    assert cluster.device.chip is not None and cluster.device.memory_bytes == 80e9
