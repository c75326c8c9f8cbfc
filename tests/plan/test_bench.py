"""distml bench measures this machine; distml plan reads what it wrote."""

from __future__ import annotations

import json
import tomllib

from typer.testing import CliRunner

from conftest import distml_cli
from distml.cli.main import app

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


def test_bench_writes_a_cluster_file_the_planner_reads(tmp_path):
    proc = distml_cli("bench", "--out", "cluster.toml", cwd=tmp_path, timeout=180)
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
    assert {r["layout"]["dp"] * r["layout"]["tp"] * r["layout"]["pp"] for r in layouts} == {2}


def test_a_broken_cluster_file_is_refused(tmp_path):
    (tmp_path / "bad.toml").write_text("devices = 2\n[device]\nname = 'x'\n")
    out = CliRunner().invoke(app, ["plan", *MODEL, "--cluster", str(tmp_path / "bad.toml")])
    assert out.exit_code == 2 and "cluster file" in out.output
