"""distml bench measures this machine; distml plan reads what it wrote."""

from __future__ import annotations

import json
import math
import tomllib

import pytest
import tomli_w
from typer.testing import CliRunner

from conftest import distml_cli
from distml.cli.main import app
from distml.config import GPTConfig
from distml.layout import ORDER
from distml.plan.auto import choose_layout, gpt_params, profile_shapes, sharded_profile_shapes
from distml.plan.bench import read_cluster_file

MODEL = [
    "--layers",
    "4",
    "--hidden",
    "256",
    "--heads",
    "4",
    "--seq",
    "128",
    "--vocab",
    "256",
    "--global-batch",
    "16",
]


GPT = GPTConfig(vocab_size=64, seq_len=16, layers=2, hidden=32, heads=2)


@pytest.mark.distributed
def test_bench_writes_a_cluster_file_the_planner_reads(tmp_path):
    run = {"model": GPT.model_dump(), "parallel": {"microbatches": 2}}
    (tmp_path / "run.toml").write_text(tomli_w.dumps(run))
    proc = distml_cli(
        "bench", "--out", "cluster.toml", "--config", "run.toml", "--global-batch", "4",
        "--passes", "2", cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = tomllib.loads((tmp_path / "cluster.toml").read_text())
    dev = data["device"]
    assert data["devices"] == 2
    assert dev["peak_flops"] > 1e8 and dev["intra_bw"] > 1e6 and 0 < dev["latency_s"] < 1
    out = CliRunner().invoke(
        app, ["plan", *MODEL, "--cluster", str(tmp_path / "cluster.toml"), "--json"]
    )
    assert out.exit_code == 0, out.output
    layouts = json.loads(out.output)["layouts"]
    assert {math.prod(r["layout"][k] for k in ORDER) for r in layouts} == {2}

    # The calibration: a block at every (micro-batch, tensor degree) a layout of 2 runs, an FSDP
    # unit for every sharded one, and the planner then times each layout from them.
    cal = data["calibration"]
    assert set(cal["blocks"]) == {f"{b}x{t}" for b, t in profile_shapes(GPT, 2, 4, 2)}
    assert set(cal["sharded_stages"]) == {
        "x".join(map(str, key)) for key in sharded_profile_shapes(GPT, 2, 4, 2)
    }
    assert all(0 < v["fwd_s"] < v["fwdbwd_s"] for v in cal["blocks"].values())
    assert cal["share"] >= 1 and cal["optimizer_s_per_param"] > 0
    # The device's network figures are the profile's fitted all-reduce and send, not a second
    # timing of them: bus bandwidth 2 (w - 1) / w x beta at w = 2, latency alpha.
    alpha, beta = cal["collectives"]["all_reduce"]["2"]
    assert (dev["intra_bw"], dev["latency_s"]) == (beta, alpha)
    assert data["measured"]["p2p_bw"] == cal["collectives"]["p2p"]["2"][1]
    cluster = read_cluster_file(tmp_path / "cluster.toml")
    choice = choose_layout(GPT, cluster, global_batch=4, microbatches=2, n_params=gpt_params(GPT))
    assert all("step time from the calibration" in o.prediction.notes for o in choice.ranked)


def test_a_broken_cluster_file_is_refused(tmp_path):
    (tmp_path / "bad.toml").write_text("devices = 2\n[device]\nname = 'x'\n")
    out = CliRunner().invoke(app, ["plan", *MODEL, "--cluster", str(tmp_path / "bad.toml")])
    assert out.exit_code == 2 and "cluster file" in out.output
    assert out.output.count("bad.toml") == 1, out.output  # named once
