"""``distml run --strategy auto``: the planner's best layout for the cluster file is the one the
run trains under."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomli_w
from typer.testing import CliRunner

from conftest import distml_cli
from distml.cli.main import app
from distml.config import ConfigError, GPTConfig, ParallelConfig, StrategyConfig
from distml.layout import Layout
from distml.models import GPT
from distml.plan.auto import choose_layout, gpt_params, is_replicas
from distml.plan.bench import read_cluster_file
from distml.plan.sync import AUTO_SYNCS, DDP, Sync, steps_factor, sync_of

GPT_EXAMPLE = str(Path(__file__).parents[2] / "examples" / "gpt" / "train.py")


def cluster_file(path: Path, memory_bytes: float, devices: int = 2, bandwidth: float = 8e8) -> Path:
    """A cluster in the shape ``distml bench`` writes, with this much memory per device and
    this link bandwidth (bytes/s)."""
    data = {
        "devices": devices,
        "devices_per_node": devices,
        "device": {
            "name": "cpu",
            "memory_bytes": memory_bytes,
            "peak_flops": 7e10,
            "intra_bw": bandwidth,
            "inter_bw": bandwidth,
            "latency_s": 5e-4,
            "power_w": 10.0,
        },
    }
    path.write_text(tomli_w.dumps(data))
    return path


def plan_gpt(cluster: Path, microbatches: int, syncs=(DDP,)):
    """The planner's choice for the GPT example's default size on ``cluster``, 16 sequences a
    step, as ``distml run --strategy auto`` makes it."""
    return choose_layout(
        GPTConfig(),
        read_cluster_file(cluster),
        global_batch=16,
        microbatches=microbatches,
        n_params=gpt_params(GPTConfig()),
        syncs=syncs,
    )


def test_a_planner_layout_is_the_runs_layout():
    for layout in (
        Layout(dp=4),
        Layout.sharded(2, zero=3, tp=2),
        Layout.sharded(4, zero=2),
        Layout(pp=2, tp=2),
        Layout(),
    ):
        parallel = ParallelConfig(**layout.parallel_settings())
        assert Layout.from_mesh(layout.mesh_sizes(), layout.world_size, parallel) == layout
    assert Layout.sharded(2, zero=3).mesh_sizes() == {"fsdp": 2}
    assert Layout.sharded(2, zero=2).parallel_settings() == {"reshard_after_forward": False}
    assert Layout.sharded(2, zero=2).record()["zero"] == 2
    with pytest.raises(ConfigError, match="no ZeRO stage 1"):
        Layout.sharded(2, zero=1).parallel_settings()
    with pytest.raises(ConfigError, match="world size is 8"):
        Layout.from_mesh({"dp": 2, "tp": 2}, world_size=8)


def test_the_exact_parameter_count_is_taken_without_building_the_model():
    cfg = GPTConfig(layers=2, hidden=64, heads=2)
    assert gpt_params(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_memory_decides_and_a_model_that_fits_nowhere_is_refused(tmp_path):
    cfg = GPTConfig()  # the GPT example's default size
    n = gpt_params(cfg)
    roomy = read_cluster_file(cluster_file(tmp_path / "a.toml", 6e9))
    tight = read_cluster_file(cluster_file(tmp_path / "b.toml", 12e6))
    big = choose_layout(cfg, roomy, global_batch=16, microbatches=8, n_params=n)
    small = choose_layout(cfg, tight, global_batch=16, microbatches=8, n_params=n)
    # With room, replicas win; with 12 MB a device, only a layout that splits the model fits.
    assert big.mesh == {"dp": 2} and len(big.ranked) > 1 and not big.too_big
    assert small.mesh != {"dp": 2} and small.too_big
    assert all(o.prediction.memory_bytes["total"] <= 12e6 for o in small.ranked)
    assert small.prediction is small.ranked[0].prediction
    with pytest.raises(ConfigError, match=r"fits this model in 1\.0 MB per device"):
        choose_layout(
            cfg,
            read_cluster_file(cluster_file(tmp_path / "c.toml", 1e6)),
            global_batch=16,
            microbatches=8,
            n_params=n,
        )


def test_the_link_decides_how_replicas_synchronise(tmp_path):
    """On a link where DDP's all-reduce takes microseconds, sending less gains nothing that
    costs steps: the pick loses no steps to DDP and is within 0.1% of its time. On a 1 MB/s
    link every lighter synchronisation beats DDP, and the pick is the fastest to a loss, not
    the fastest step."""
    cfg, n = GPTConfig(), gpt_params(GPTConfig())

    def choose(bandwidth, syncs=AUTO_SYNCS):
        cluster = read_cluster_file(cluster_file(tmp_path / "c.toml", 6e9, bandwidth=bandwidth))
        return choose_layout(cfg, cluster, global_batch=16, microbatches=8, n_params=n,
                             syncs=syncs)  # fmt: skip

    fast = choose(1e12)
    ddp = next(o for o in fast.ranked if is_replicas(o.layout) and o.sync == DDP)
    assert fast.mesh == {"dp": 2} and fast.ranked[0].steps_factor == 1.0
    assert fast.ranked[0].time_to_loss_s == pytest.approx(ddp.time_to_loss_s, rel=1e-3)
    slow = choose(1e6)
    replicas = {o.sync.label: o for o in slow.ranked if is_replicas(o.layout)}
    assert set(replicas) == {s.label for s in AUTO_SYNCS}
    assert slow.mesh == {"dp": 2} and slow.sync != DDP
    for option in replicas.values():
        assert option.steps_factor == steps_factor(option.sync)
        assert option.time_to_loss_s == option.prediction.step_time_s * option.steps_factor
        assert option.prediction.step_time_s <= replicas["ddp"].prediction.step_time_s
    ranked = [o.time_to_loss_s for o in slow.ranked]
    assert ranked == sorted(ranked)
    # Without choices of synchronisation, every replica layout is DDP's.
    assert all(o.sync == DDP for o in choose(1e6, (DDP,)).ranked)
    only = choose(1e6, (Sync("local-sgd", every=4),))
    assert {o.sync.label for o in only.ranked if is_replicas(o.layout)} == {"local-sgd"}


@pytest.mark.distributed
def test_run_trains_under_the_planners_choice(tmp_path):
    cluster = cluster_file(tmp_path / "cluster.toml", 12e6)
    expected = plan_gpt(cluster, 8)
    proc = distml_cli(
        "run", "--nproc", "2", "--strategy", "auto", "--cluster", str(cluster),
        "--microbatches", "8", "--runs-dir", str(tmp_path), "--run-name", "auto",
        GPT_EXAMPLE, "--steps", "2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    mesh = ",".join(f"{k}={v}" for k, v in expected.mesh.items())
    assert f"--strategy auto: --mesh {mesh}" in proc.stderr
    summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert {k: summary["layout"][k] for k in expected.mesh} == expected.mesh
    assert summary["world_size"] == 2
    # The summary keeps the pick and its prediction beside what the run measured; the report
    # shows both and a timeline of the predicted step.
    plan = summary["plan"]
    assert plan["mesh"] == expected.mesh
    assert plan["predicted"]["step_time_s"] == pytest.approx(expected.prediction.step_time_s)
    worst = max(r["total"] for r in summary["memory_per_rank"])
    assert plan["measured"]["memory_bytes"] == worst and plan["measured"]["step_time_s"] > 0
    report = (tmp_path / "auto" / "report.html").read_text()
    assert "<h2>Plan</h2>" in report and report.count("data:image/png") >= 1


@pytest.mark.distributed
def test_run_synchronises_as_the_planner_chose_for_a_slow_link(tmp_path):
    cluster = cluster_file(tmp_path / "cluster.toml", 6e9, bandwidth=1e6)
    proc = distml_cli(
        "run", "--nproc", "2", "--strategy", "auto", "--cluster", str(cluster),
        "--runs-dir", str(tmp_path), "--run-name", "auto", GPT_EXAMPLE, "--steps", "2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
    # The run charged each PowerSGD its hook's own work as it measured it on this machine
    # (one thread a worker on 2 cores) and kept those figures: with them, the planner picks
    # what the run trained under.
    hook_s = summary["plan"]["hook_s"]
    assert set(hook_s) == {"powersgd-r2", "powersgd-r8"} and all(s > 0 for s in hook_s.values())
    expected = choose_layout(GPTConfig(), read_cluster_file(cluster), global_batch=16,
                             microbatches=8, n_params=gpt_params(GPTConfig()), syncs=AUTO_SYNCS,
                             hook_s=hook_s)  # fmt: skip
    assert expected.sync != DDP
    assert f"synchronised by {expected.sync.label}" in " ".join(proc.stderr.split())
    assert sync_of(StrategyConfig(**summary["strategy"])) == expected.sync
    assert summary["plan"]["sync"] == expected.sync.label
    assert summary["plan"]["steps_factor"] == steps_factor(expected.sync)


@pytest.mark.distributed
def test_a_layout_the_config_refuses_gives_way_to_the_next_best(tmp_path):
    """On a 1 MB/s network with plain DDP given (``strategy.compression=none``: the layout
    alone is planned), the pipeline (activations only on the wire) is predicted fastest, but
    one micro-batch is too few for 1F1B over two stages: the config refuses pp=2 and the run
    goes ahead under the planner's second choice."""
    cluster = cluster_file(tmp_path / "cluster.toml", 6e9, bandwidth=1e6)
    ranked = plan_gpt(cluster, 1).ranked
    assert ranked[0].layout.pp == 2
    second = ranked[1].layout.mesh_sizes()
    proc = distml_cli(
        "run", "--nproc", "2", "--strategy", "auto", "--cluster", str(cluster),
        "--microbatches", "1", "--runs-dir", str(tmp_path), "--run-name", "auto",
        "--set", "strategy.compression=none", GPT_EXAMPLE, "--steps", "1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    mesh = ",".join(f"{k}={v}" for k, v in second.items())
    assert f"--strategy auto: --mesh {mesh} " in proc.stderr
    assert "number 2 of" in " ".join(proc.stderr.split())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "tp=2"], "give --mesh or --strategy auto, not both"),
        (["--cluster", "no-such.toml"], "distml bench --nproc 2 --out no-such.toml"),
    ],
)
def test_auto_refuses_a_mesh_and_a_missing_cluster_file(tmp_path, args, message):
    out = CliRunner().invoke(app, ["run", "--nproc", "2", "--strategy", "auto", *args, GPT_EXAMPLE])
    assert out.exit_code == 2
    assert message in " ".join(out.output.split())
