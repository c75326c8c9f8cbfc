"""What each synchronisation strategy buys as the link between two hosts slows.

    python benchmarks/network.py                              # 1gbit,200mbit,50mbit,10mbit
    python benchmarks/network.py --rates 50mbit --strategies ddp,powersgd-r2 --repeats 1

Two hosts of a :class:`distml.testbed.Testbed` (network namespaces on one switch, each link
shaped with tc's token bucket), one worker each, through the multi-node path (``distml run
--nnodes 2 --rdzv-endpoint``), train the GPT of examples/gpt (``benchmarks/network_train.py``)
under each strategy: DDP, DDP with fp16 or PowerSGD (rank 2, 8) compression, Local SGD and
DiLoCo (H = 8), FSDP, and a 2-stage 1F1B pipeline.

Two measurements, because the link changes the time of a step and never its arithmetic:

- **Loss per step**, once per strategy, on loopback: the validation loss every 8 steps up to
  ``2 x --steps``. The target is the loss DDP reaches at ``--steps``.
- **Time per step**, per strategy and link rate, on the testbed: ``--timed-steps`` steps, from
  the run's ``metrics.jsonl``: the first two (start-up, and PowerSGD's plain all-reduce before
  its ``start_iter``) timed apart, then the steady step, the mean of the rest (H steps, so
  Local SGD's sync is in at its share); samples/s from the steady step. One testbed, its
  links reshaped between runs: each of ``--repeats`` repeats measures the links at every
  rate, then runs each strategy at every rate back to back, so that a slow spell of a shared
  machine hits every strategy, and a strategy's rates alike. The medians count: of the runs,
  and of each link figure. Five repeats, because runs of the same strategy on the same link
  can sit a fifth apart here while the steps within each run agree (PowerSGD rank 2 at
  50 Mbit/s: 0.103 to 0.123 s a step in five runs), and the median of three then moves with
  one run.

Time to target = the first evaluated step at or below the target (to 1e-3, the float noise
between layouts of the same arithmetic): the first two steps as they took, the rest at the
steady step. Since the loss per step does not depend on the link, ``--reuse`` takes the curves
(and the rates not measured again) from the last results file, to remeasure some rates alone.

The planner's step at each slower rate is predicted from the fastest rate's, and its error
given twice: the median step against the prediction from the median fastest-rate step, and
paired, each run against the prediction from its own repeat's fastest-rate step (the median
of those errors), which a drift of the machine's speed between repeats does not move.

Two choices are set against the best measured time to target at each rate: the planner's with
the measured loss curves (``distml.plan.sync.choose``), and ``distml run --strategy auto``'s,
from the cluster files ``distml bench --nnodes 2`` wrote on that link (each figure the
median of the repeats'), PowerSGD's hook measured on this machine at one thread
(``distml.plan.hook_probe``, as the run measures it) and the stated rule for the steps
(``distml.plan.auto.choose_layout``, the very function the run calls).

Each worker gets the threads that let both share the cores once. Needs root, ip and tc (the
testbed's requirements). Results: benchmarks/results/network.json and network.png.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, machine_info, print_table, scratch_dir, write_json

from distml.config import GPTConfig
from distml.models import GPT
from distml.plan.auto import choose_layout, gpt_params, gpt_shapes, hook_costs, is_replicas
from distml.plan.bench import cluster_from_dict
from distml.plan.sync import (
    AUTO_SYNCS,
    Sync,
    choose,
    line_rate_bytes,
    pipeline_step_seconds,
    step_seconds,
    steps_to_target,
    wire_bytes_by_collective,
)
from distml.testbed import Testbed, rate_bits, unavailable

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "benchmarks" / "network_train.py"
H = 8
WARMUP = 2  # steps timed apart: start-up, and PowerSGD's plain steps (its start_iter)
MICROBATCHES = 4  # the pipeline's
STRATEGIES: dict[str, list[str]] = {
    "ddp": ["--strategy", "ddp"],
    "ddp-fp16": ["--set", "strategy.compression=fp16"],
    "powersgd-r2": ["--set", "strategy.compression=powersgd", "--set", "strategy.powersgd_rank=2"],
    "powersgd-r8": ["--set", "strategy.compression=powersgd", "--set", "strategy.powersgd_rank=8"],
    "local-sgd": ["--strategy", f"local-sgd:{H}"],
    "diloco": [
        "--strategy",
        f"local-sgd:{H}",
        "--set",
        "strategy.outer_lr=0.7",
        "--set",
        "strategy.outer_momentum=0.9",
    ],  # fmt: skip
    "fsdp": ["--mesh", "fsdp=2"],
    "pipeline": ["--mesh", "pp=2", "--schedule", "1f1b", "--microbatches", str(MICROBATCHES)],
}
SYNCS = {
    "ddp": Sync("ddp"),
    "ddp-fp16": Sync("ddp-fp16"),
    "powersgd-r2": Sync("powersgd", rank=2),
    "powersgd-r8": Sync("powersgd", rank=8),
    "local-sgd": Sync("local-sgd", every=H),
    "diloco": Sync("diloco", every=H),
    "fsdp": Sync("fsdp"),
    "pipeline": Sync("pipeline"),
}
RATES = ("1gbit", "200mbit", "50mbit", "10mbit")
GLOBAL_BATCH = 16  # network_train.py's default


def run_job(argv: list[str], log: Path, timeout: float, env: dict[str, str]) -> None:
    with open(log, "wb") as out:
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                              timeout=timeout)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}); log: {log}")


def loss_curve(name: str, args: argparse.Namespace, runs: Path) -> list[tuple[int, float]]:
    """Validation loss every H steps, on loopback (2 workers, one thread each)."""
    argv = [
        sys.executable, "-m", "distml", "run", "--nproc", "2", *STRATEGIES[name],
        "--run-name", f"curve-{name}", "--runs-dir", str(runs), str(TRAIN),
        "--steps", str(2 * args.steps), "--eval-every", str(H),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_job(argv, runs / f"curve-{name}.log", args.timeout, env)
    return [tuple(p) for p in json.loads((runs / f"curve-{name}" / "curve.json").read_text())]


def _medians(runs: list[dict[str, Any]], curve, target: float) -> dict[str, Any]:
    """One strategy at one rate: the medians of its repeats, and its time to the target."""
    median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    rates = [GLOBAL_BATCH / r["step_s"] for r in runs]
    reached = steps_to_target(curve, target)
    ttt = None if reached is None else median["warmup_s"] + (reached - WARMUP) * median["step_s"]
    return median | {
        "measured": time.strftime("%Y-%m-%d %H:%M"),
        "samples_per_s": GLOBAL_BATCH / median["step_s"],
        "samples_per_s_range": [min(rates), max(rates)],
        "repeats": len(runs),
        "step_s_by_repeat": [r["step_s"] for r in runs],
        "steps_to_target": reached,
        "time_to_target_s": ttt,
    }


def run_everywhere(bed: Testbed, argv_of, logs: Path, timeout: float, threads: int, cwd: Path):
    """``argv_of(rank, host)`` on every host at once; raises unless all exit 0."""
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    codes = bed.run_everywhere(argv_of, logs=logs, timeout=timeout, env=env, cwd=cwd)
    if set(codes.values()) != {0}:
        raise RuntimeError(f"at {bed.rate_bits / 1e6:g} Mbit/s: exit codes {codes}; logs in {logs}")


def timed_run(
    bed: Testbed, name: str, args: argparse.Namespace, runs: Path, repeat: int = 0
) -> dict[str, Any]:
    """``--timed-steps`` steps of ``name`` across the testbed's two hosts: its summary, and
    each step's seconds (the slowest rank's) from its metrics stream."""
    tag = f"{name}-{bed.rate_bits:.0f}-{repeat}"

    def argv(rank: int, host) -> list[str]:
        return [
            sys.executable, "-m", "distml", "run", "--nnodes", str(len(bed.hosts)), "--nproc",
            "1", "--rdzv-endpoint", f"{bed.hosts[0].addr}:29541", "--rdzv-id", tag,
            "--run-name", tag, "--runs-dir", str(runs / host.name), *STRATEGIES[name],
            str(TRAIN), "--steps", str(args.timed_steps),
        ]  # fmt: skip

    threads = bed.threads_per_worker(len(bed.hosts))
    run_everywhere(bed, argv, runs / f"logs-{tag}", args.timeout, threads, ROOT)
    (folder,) = [p.parent for p in runs.glob(f"*/{tag}/summary.json")]
    summary = json.loads((folder / "summary.json").read_text())
    steps: dict[int, float] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "step_s" in rec:
            steps[rec["step"]] = max(steps.get(rec["step"], 0.0), rec["step_s"])
    return summary | {"step_times": [steps[k] for k in sorted(steps)]}


def link_cluster(bed: Testbed, runs: Path, timeout: float, repeat: int = 0) -> dict[str, Any]:
    """The cluster file ``distml bench --nnodes 2`` writes on the testbed's two hosts (its
    ``device.inter_bw``: the all-reduce bandwidth between them, bytes/s)."""
    tag = f"bench-{bed.rate_bits:.0f}-{repeat}"

    def argv(rank: int, host) -> list[str]:
        return [
            sys.executable, "-m", "distml", "bench", "--nnodes", "2", "--nproc", "1",
            "--node-rank", str(rank), "--rdzv-endpoint", f"{bed.hosts[0].addr}:29543",
            "--out", str(runs / f"{tag}-{rank}.toml"),
        ]  # fmt: skip

    run_everywhere(bed, argv, runs / f"logs-{tag}", timeout, 1, runs)
    return tomllib.loads((runs / f"{tag}-0.toml").read_text())


def measure(
    names: list[str],
    curves: dict[str, Any],
    target: float,
    args: argparse.Namespace,
    runs: Path,
    timed: dict[str, dict[str, Any]],
) -> dict[str, list[dict[str, Any]]]:
    """Every strategy at every rate, ``--repeats`` times, into ``timed`` (the medians); returns
    each rate's cluster files, one a repeat.

    One testbed whose links are reshaped between runs. Each repeat first measures the links
    at every rate, then runs each strategy at every rate back to back: a strategy's steps at
    the fastest rate, from which its other rates are predicted, are timed minutes from them,
    not half an hour, so a shared machine's drift in speed between phases does not read as
    an error of the prediction. Each repeat starts at another rate."""
    rates = args.rates.split(",")
    benched: dict[str, list[dict[str, Any]]] = {rate: [] for rate in rates}
    runs_of: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with Testbed(2, rates[0]) as bed:
        for repeat in range(args.repeats):
            order = rates[repeat % len(rates) :] + rates[: repeat % len(rates)]
            for rate in order:
                bed.shape(rate)
                benched[rate].append(link_cluster(bed, runs, args.timeout, repeat))
                inter = benched[rate][-1]["device"]["inter_bw"]
                print(f"{rate:>8} link: {inter / 1e6:.2f} MB/s measured", flush=True)
            for name in [] if args.links_only else names:
                for rate in order:
                    bed.shape(rate)
                    summary = timed_run(bed, name, args, runs, repeat)
                    times = summary["step_times"]
                    runs_of.setdefault((rate, name), []).append({
                        "step_s": statistics.mean(times[WARMUP:]),
                        "warmup_s": sum(times[:WARMUP]),
                        "comm_s": summary["comm_s"] / summary["steps"],
                        "wire_bytes_per_step": sum(summary["wire_bytes"].values())
                        / summary["steps"],
                    })  # fmt: skip
                    step_s = runs_of[rate, name][-1]["step_s"]
                    print(f"{rate:>8} {name:<12} {GLOBAL_BATCH / step_s:8.1f} samples/s",
                          flush=True)  # fmt: skip
    for (rate, name), measured in runs_of.items():
        timed.setdefault(rate, {})[name] = _medians(measured, curves[name], target)
    return benched


def median_figures(files: list[dict[str, Any]]) -> dict[str, Any]:
    """One cluster file from several of the same link: each measured figure the median of the
    files' (a figure by size, the median at each size)."""

    def median(values: list[Any]) -> Any:
        first = values[0]
        if isinstance(first, dict):
            return {key: median([v[key] for v in values]) for key in first}
        if isinstance(first, list):
            return [median(list(column)) for column in zip(*values, strict=True)]
        if isinstance(first, float):
            return statistics.median(values)
        return first  # a name or a count, the same in every file

    return median(files)


def main() -> dict[str, Any]:
    # A SIGTERM unwinds as an exception does, so that the testbed's teardown runs.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default=",".join(RATES), help="tc rates of the links")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--steps", type=int, default=96, help="DDP's steps that set the target")
    parser.add_argument("--timed-steps", type=int, default=WARMUP + H,
                        help="steps a timed run")  # fmt: skip
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed runs of each strategy at each rate, and link benches (medians)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    parser.add_argument(
        "--reuse", action="store_true", help="the curves and other rates of the last results"
    )
    parser.add_argument("--report", action="store_true", help="only report the last results")
    parser.add_argument(
        "--links-only", action="store_true", help="with --reuse: measure the links alone"
    )
    args = parser.parse_args()
    if args.report:
        results = json.loads((RESULTS_DIR / "network.json").read_text())
        _report(results, results["args"]["strategies"].split(","))
        return results
    names = args.strategies.split(",")
    unknown = set(names) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; known: {', '.join(STRATEGIES)}")
    if (reason := unavailable()) is not None:
        parser.error(f"the testbed cannot run here: {reason}")

    previous: dict[str, Any] = {"curves": {}, "rates": {}}
    if args.reuse:
        previous = json.loads((RESULTS_DIR / "network.json").read_text())
    with scratch_dir("distml-network-") as runs:
        curves = {
            name: previous["curves"].get(name) or loss_curve(name, args, runs)
            for name in {"ddp", *names}
        }
        target = dict(curves["ddp"])[args.steps]
        timed: dict[str, dict[str, Any]] = previous["rates"]
        clusters: dict[str, dict[str, Any]] = previous.get("clusters", {})
        benched = measure(names, curves, target, args, runs, timed)
        clusters |= {rate: median_figures(files) for rate, files in benched.items()}
        # What `--strategy auto` charges PowerSGD's hook, measured as the run measures it,
        # at the one thread a worker computes on here.
        cpu = cluster_from_dict(next(iter(clusters.values()))).device
        hook_s = hook_costs(gpt_shapes(GPTConfig()), AUTO_SYNCS, cpu, threads=1)
    results = {
        "machine": machine_info(),
        "args": vars(args),
        "target_loss": target,
        "curves": curves,
        "clusters": clusters,
        "link_benches": previous.get("link_benches", {}) | benched,
        "hook_s": hook_s,
        "rates": timed,
    }
    path = write_json("network", results)
    _report(results, names)
    write_json("network", results)  # with the predictions
    print(f"results: {path}")
    return results


def _report(results: dict[str, Any], names: list[str]) -> None:
    rates = sorted(results["rates"], key=rate_bits, reverse=True)
    rows = []
    for name in names:
        cells = [name]
        for rate in rates:
            r = results["rates"][rate][name]
            ttt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f}"
            cells.append(f"{GLOBAL_BATCH / r['step_s']:.1f} / {ttt}")
        final = results["curves"][name][-1][1]
        cells.append(str(steps_to_target(results["curves"][name], results["target_loss"]) or "-"))
        cells.append(f"{final:.3f}")
        rows.append(cells)
    print_table(
        f"samples/s / seconds to validation loss {results['target_loss']:.3f}",
        ["strategy", *rates, "steps to target", f"loss at {2 * results['args']['steps']}"],
        rows,
    )
    _links(results.get("clusters", {}), rates)
    _plot(results, names, rates)
    _predictions(results, names, rates)


def _links(clusters: dict[str, dict[str, Any]], rates: list[str]) -> None:
    """What distml bench measured between the hosts at each rate, MB/s."""
    measured = [rate for rate in rates if rate in clusters]
    if not measured:
        return
    rows = []
    for rate in measured:
        dev = clusters[rate]["device"]
        sized = [
            f"{bw / 1e6:.2f} at {size / 2**20:g} MiB"
            for key in ("inter_allgather_bw", "inter_exchange_bw")
            for size, bw in dev.get(key, ())
        ]
        rows.append([rate, f"{dev['inter_bw'] / 1e6:.2f}", ", ".join(sized) or "-"])
    print_table(
        "the links as distml bench measured them (MB/s): all-reduce; all-gathers by shard, "
        "then both ways at once by message",
        ["rate", "all-reduce", "all-gather, both ways"],
        rows,
    )


def _predictions(results: dict[str, Any], names: list[str], rates: list[str]) -> None:
    """The planner's steady step times (distml.plan.sync) from the fastest rate's measured step
    and each link's bandwidth as distml bench measured it (the line rate where it did not),
    against the measured ones; then the two choices at each rate against the best measured
    time to target."""
    cfg = GPTConfig()
    model = GPT(cfg)
    shapes = [tuple(p.shape) for p in model.parameters()]
    boundary = GLOBAL_BATCH * cfg.seq_len * cfg.hidden * 4
    # FSDP gathers a block at a time (distml.parallel.sharded): each rank's half of one.
    shard = 4 * sum(p.numel() for p in next(iter(model.blocks.values())).parameters()) / 2
    base = rates[0]
    clusters = results.get("clusters", {})
    links = {r: bandwidths(clusters, r, shard, boundary / MICROBATCHES) for r in rates}
    wire = {
        n: wire_bytes_by_collective(SYNCS[n], shapes, 2, steps=10**6, gloo=True)
        for n in names
        if n != "pipeline"  # predicted from its schedule below
    }

    def predict(name: str, base_s: float, rate: str) -> float:
        """``name``'s step at ``rate`` from ``base_s``, its step at the fastest rate."""
        if name == "pipeline":
            return pipeline_step_seconds(base_s, 2, MICROBATCHES, boundary / MICROBATCHES,
                                         links[base], links[rate])  # fmt: skip
        return step_seconds(base_s, wire[name], links[base], links[rate])

    rows, errors, paired_errors = [], [], []
    for name in names:
        cells = [name]
        for rate in rates:
            here, fast = results["rates"][rate][name], results["rates"][base][name]
            predicted = predict(name, fast["step_s"], rate)
            here["predicted_step_s"] = predicted
            error = here["step_s"] / predicted - 1  # samples/s: predicted over measured, minus 1
            cell = f"{GLOBAL_BATCH / predicted:.1f} ({error:+.0%}"
            # Each repeat timed the fast link's step minutes from the slower ones: each run
            # predicted from its own repeat's, the median of those errors.
            runs, fast_runs = here.get("step_s_by_repeat"), fast.get("step_s_by_repeat")
            if runs and fast_runs and len(runs) == len(fast_runs):
                paired = statistics.median(
                    m / predict(name, b, rate) - 1 for b, m in zip(fast_runs, runs, strict=True)
                )
                here["paired_error"] = paired
                cell += f"; paired {paired:+.0%}"
                if rate != base:
                    paired_errors.append(abs(paired))
            if rate != base:
                errors.append(abs(error))
            cells.append(cell + ")")
        rows.append(cells)
    largest_paired = (
        f"; paired within the repeats {max(paired_errors):.0%}" if paired_errors else ""
    )
    print_table(
        f"predicted samples/s from the {base} step (error of the prediction); "
        f"largest error {max(errors, default=0):.0%}{largest_paired}",
        ["strategy", *rates],
        rows,
    )
    rows = []
    for rate in rates:
        measured = results["rates"][rate]
        reach = [n for n in names if measured[n]["time_to_target_s"] is not None]
        best = min(reach, key=lambda n: measured[n]["time_to_target_s"])
        probed = choose(
            {n: measured[n]["predicted_step_s"] for n in names},
            {n: measured[n]["steps_to_target"] for n in names},
        )[0].label
        auto = auto_choice(clusters[rate], results.get("hook_s")) if rate in clusters else "-"
        cells = [rate, best]
        for pick in (probed, auto):
            if pick in reach:
                ratio = measured[pick]["time_to_target_s"] / measured[best]["time_to_target_s"]
                cells += [pick, f"{ratio:.2f}"]
            else:
                cells += [pick, "not measured"]
        rows.append(cells)
    print_table(
        "the choices by predicted time to target vs the best measured (time to target, "
        "chosen / best)",
        ["rate", "best measured", "measured curves", "ratio", "--strategy auto", "ratio"],
        rows,
    )


def auto_choice(cluster: dict[str, Any], hook_s: dict[str, float] | None) -> str:
    """What ``distml run --strategy auto`` picks on this cluster file for the benchmark's GPT
    and batch, with PowerSGD's hooks costing ``hook_s``: one of the benchmark's strategy
    names, or the layout when it is none of them."""
    cfg = GPTConfig()
    best = choose_layout(cfg, cluster_from_dict(cluster), global_batch=GLOBAL_BATCH,
                         microbatches=MICROBATCHES, n_params=gpt_params(cfg),
                         syncs=AUTO_SYNCS, hook_s=hook_s).ranked[0]  # fmt: skip
    layout = best.layout
    if is_replicas(layout):
        return best.sync.label
    if layout.zero == 3 and layout.data_parallel == 2:
        return "fsdp"
    if layout.pp == 2:
        return "pipeline"
    return str(layout)


def bandwidths(
    clusters: dict[str, dict[str, Any]], rate: str, shard: float, message: float
) -> dict[str, float]:
    """Each collective's bytes/s between the hosts as distml bench measured them (all-gathers
    of ``shard`` bytes a rank; ``message`` bytes both ways at once), the line rate where it
    measured nothing."""
    measured = clusters.get(rate)
    if not measured:
        return {"all_reduce": line_rate_bytes(rate_bits(rate))}
    device = cluster_from_dict(measured).device
    return {
        "all_reduce": device.inter_bw,
        "all_gather": device.allgather_bw(shard),
        "exchange": device.exchange_bw(message),
    }


def _plot(results: dict[str, Any], names: list[str], rates: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [rate_bits(r) / 1e6 for r in rates]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        per_rate = [results["rates"][r][name] for r in rates]
        left.plot(x, [GLOBAL_BATCH / p["step_s"] for p in per_rate], marker="o", label=name)
        times = [p["time_to_target_s"] for p in per_rate]
        if any(t is not None for t in times):
            right.plot(x, [float("nan") if t is None else t for t in times], marker="o",
                       label=name)  # fmt: skip
    for ax, label in ((left, "samples/s"), (right, "seconds to the target loss")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate, Mbit/s (each way)")
        ax.set_ylabel(label)
    left.legend(fontsize=8)
    fig.suptitle("GPT (examples/gpt), 2 hosts x 1 worker, tc-shaped links")
    RESULTS_DIR.mkdir(exist_ok=True)
    fig.savefig(RESULTS_DIR / "network.png", dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
