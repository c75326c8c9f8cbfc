"""distml plan: one layout, or the ranking of all layouts, and its bad input."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from distml.cli.main import app

MODEL = [
    "--layers",
    "32",
    "--hidden",
    "4096",
    "--heads",
    "32",
    "--seq",
    "2048",
    "--vocab",
    "51200",
    "--global-batch",
    "512",
    "--devices",
    "64",
]


def test_one_layout_as_json():
    out = CliRunner().invoke(app, ["plan", *MODEL, "--tp", "8", "--zero", "1", "--json"])
    assert out.exit_code == 0, out.output
    (row,) = json.loads(out.output)["layouts"]
    assert row["layout"]["fsdp"] == 8 and row["layout"]["tp"] == 8 and row["layout"]["zero"] == 1
    assert set(row["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "total"}
    assert row["step_time_s"] > 0 and 0 < row["mfu"] <= 1


def test_ranking_is_sorted_and_only_holds_layouts_that_fit():
    out = CliRunner().invoke(app, ["plan", *MODEL, "--params", "6.7e9", "--json"])
    assert out.exit_code == 0, out.output
    layouts = json.loads(out.output)["layouts"]
    times = [r["step_time_s"] for r in layouts]
    assert times == sorted(times) and len(layouts) > 10
    assert all(r["memory_bytes"]["total"] <= 80e9 for r in layouts)


def test_impossible_layouts_are_refused_with_the_numbers():
    out = CliRunner().invoke(app, ["plan", *MODEL, "--tp", "3"])
    assert out.exit_code == 2 and "--tp 3 does not divide --heads 32" in out.output
    out = CliRunner().invoke(app, ["plan", *MODEL, "--tp", "8", "--pp", "2", "--dp", "2"])
    assert out.exit_code == 2 and "= 32, but the cluster has 64" in out.output


def test_simulate_draws_the_timeline_and_reports_the_bubble(tmp_path):
    gantt = tmp_path / "g.png"
    out = CliRunner().invoke(
        app, ["simulate", "--stages", "4", "--microbatches", "8", "--gantt", str(gantt)]
    )
    assert out.exit_code == 0, out.output
    assert "bubble 27.3% (formula (p-1)/(m+p-1) = 27.3%)" in out.output
    assert gantt.read_bytes()[:4] == b"\x89PNG"
    bad = CliRunner().invoke(app, ["simulate", "--schedule", "zigzag"])
    assert bad.exit_code == 2 and "unknown schedule" in bad.output


@pytest.mark.distributed  # PowerSGD's hook is probed in a process of its own
def test_the_replicas_synchronise_fastest_to_a_loss_on_the_measured_link(tmp_path):
    """On a CPU cluster joined by a 1 MB/s link, any lighter synchronisation beats DDP's
    all-reduce of the GPT's 3.5 MB of gradients; the table ranks by time to a loss."""
    from test_auto import cluster_file  # the shape distml bench writes

    slow = cluster_file(tmp_path / "slow.toml", 6e9, bandwidth=1e6)
    gpt = ["--layers", "4", "--hidden", "128", "--heads", "4", "--seq", "64", "--vocab", "256"]
    args = ["plan", *gpt, "--global-batch", "16", "--cluster", str(slow), "--precision", "fp32"]
    out = CliRunner().invoke(app, [*args, "--json"])
    assert out.exit_code == 0, out.output
    syncs = json.loads(out.stdout)["syncs"]
    assert {s["sync"] for s in syncs} == {
        "ddp", "ddp-fp16", "powersgd-r2", "powersgd-r8", "local-sgd", "diloco"
    }  # fmt: skip
    to_loss = [s["step_time_s"] * s["steps_factor"] for s in syncs]
    assert to_loss == sorted(to_loss) and syncs[-1]["sync"] == "ddp"
    assert all(s["layout"]["dp"] == 2 for s in syncs)
    # PowerSGD's own work on these CPU workers, measured here as --strategy auto measures it.
    assert all((s["hook_s"] > 0) == s["sync"].startswith("powersgd") for s in syncs)
    text = CliRunner().invoke(app, args).output
    assert "synchronising the replicas of" in text and "powersgd-r2" in text
    assert "hook s: the seconds a step PowerSGD's own work took on this machine" in text


def test_a_model_too_large_to_probe_is_planned_without_its_hooks_work(tmp_path):
    from test_auto import cluster_file

    cpu = cluster_file(tmp_path / "cpu.toml", 1e12)
    gpt = ["--layers", "12", "--hidden", "1024", "--heads", "16", "--seq", "64", "--vocab", "256"]
    out = CliRunner().invoke(app, ["plan", *gpt, "--global-batch", "16", "--cluster", str(cpu)])
    assert out.exit_code == 0, out.output
    assert "PowerSGD's own work is not measured for 1.51e+08 parameters" in out.output
    assert "powersgd-r2" in out.output and "hook s" not in out.output
