"""The planner's predictions against what distml measures, same run, same machine.

    python benchmarks/plan_accuracy.py [--rounds 3] [--passes 3] [--steps 8] [--repeats 3]

First ``distml bench``'s measurement runs in a world of 4 workers (matmul FLOP/s per worker
while all 4 compute, collectives, latency) with the benchmark's GPT, batch and micro-batches
given, so that it also profiles the pieces of that model's step (:mod:`distml.plan.profile`);
each piece is the median of ``--passes`` passes over them all (``distml bench --passes``).
That is the cluster the cost model reads. Then, for each layout of
``benchmarks/model_parallel.py`` (fp32, AdamW), :func:`distml.plan.cost_model.predict` gives the
step time and the memory per device, and a world of 4 workers trains the layout through
``ctx.setup`` and measures them: the median step over ``--repeats`` blocks of ``--steps`` steps,
and the largest rank's model state and activation peak from its summary. The table prints both,
with the error of the prediction, and the error the formulas alone (the matmul rate, no
profile) would make. Goals: step time within 15%, memory within 10%.

The whole of that is one round, and the run makes ``--rounds`` of them, every other one with
the layouts in reverse order: this machine's speed drifts by tens of percent over minutes, and
one calibration followed by one measurement catches whatever drift fell between them. The
table gives each layout's medians over the rounds and every round's error. It also shows the
drift: a reference (one plain block's forward + backward, every worker at once) is timed before
and after the calibration and before and after each layout's blocks, and "drift" is the ratio
of the two. (Scaling the prediction by it did not bring the rounds closer: the reference is
too short a sample of a machine whose speed changes within seconds.)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, median, print_table, scratch_dir, write_json  # noqa: E402
from model_parallel import (  # noqa: E402
    GLOBAL_BATCH,
    LAYOUTS,
    MICROBATCHES,
    MODEL,
    build_distml,
    launch_layout,
    timed,
)

import distml  # noqa: E402
from distml.config import ParallelConfig  # noqa: E402
from distml.layout import Layout  # noqa: E402
from distml.plan.auto import gpt_params, model_spec, training_for  # noqa: E402
from distml.plan.bench import cluster_from_dict, measure  # noqa: E402
from distml.plan.cost_model import predict  # noqa: E402
from distml.plan.profile import reference_block_s  # noqa: E402

REFERENCE_MICRO_BATCH = 2  # a block shape the profile times for every layout here


def calibrate(ctx: distml.Context, passes: int) -> dict:
    """``distml bench``'s measurement, between two timings of the reference block."""
    before = reference_block_s(MODEL, REFERENCE_MICRO_BATCH)
    cluster = measure(
        gpt=MODEL, global_batch=GLOBAL_BATCH, microbatches=MICROBATCHES, passes=passes
    )
    after = reference_block_s(MODEL, REFERENCE_MICRO_BATCH)
    return {"cluster": cluster, "reference_s": [before, after]}


def worker(ctx: distml.Context, steps: int, repeats: int) -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(ctx.data_rank)
    batch_size = GLOBAL_BATCH // ctx.data_world
    batch = (torch.randint(0, MODEL.vocab_size, (batch_size, MODEL.seq_len), generator=g),) * 2
    before = reference_block_s(MODEL, REFERENCE_MICRO_BATCH)
    step = build_distml(ctx)
    timed(step, batch, 2)  # warm-up: shape inference, lazy FSDP initialisation
    seconds = [timed(step, batch, steps) / steps for _ in range(repeats)]
    after = reference_block_s(MODEL, REFERENCE_MICRO_BATCH)
    summary = ctx.finish()
    return {
        "step_s": seconds,
        "memory": summary.get("memory_per_rank", []),
        "reference_s": [before, after],
    }


def error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def measure_round(runs: Path, names: list[str], steps: int, repeats: int, passes: int) -> dict:
    """One ``distml bench`` calibration, then every layout in ``names`` predicted from it and
    measured right after."""
    model = model_spec(MODEL, gpt_params(MODEL))
    runs.mkdir()
    calibrated = distml.launch(
        calibrate, passes, nproc=4, runs_dir=runs, run_name="bench", telemetry={"progress": False}
    )
    bench, reference = calibrated["cluster"], median(calibrated["reference_s"])
    cluster = cluster_from_dict(bench)
    formulas = replace(cluster, calibration=None)
    print(f"cluster: {bench['device']}", flush=True)
    layouts: dict[str, dict] = {}
    for name in names:
        mesh, par = LAYOUTS[name]
        layout = Layout.from_mesh(mesh, 4, ParallelConfig(**par))
        recompute = par.get("activation_checkpointing", "none")
        training = training_for(layout, GLOBAL_BATCH, MICROBATCHES, "fp32", recompute)
        pred = predict(model, cluster, training, layout)
        uncalibrated = predict(model, formulas, training, layout)
        out = launch_layout(name, runs, worker, steps, repeats)
        mem = out["memory"]
        state = max((m["params"] + m["grads"] + m["optimizer"] for m in mem), default=None)
        acts = max((m["activations"] for m in mem), default=None)
        pred_state = sum(pred.memory_bytes[k] for k in ("params", "grads", "optimizer"))
        layouts[name] = {
            "layout": vars(layout),
            "predicted": {
                "step_s": pred.step_time_s,
                "step_s_formulas": uncalibrated.step_time_s,
                "notes": pred.notes,
                "compute_s": pred.compute_s,
                "comm_exposed_s": pred.comm_exposed_s,
                "bubble": pred.bubble_fraction,
                "state_bytes": pred_state,
                "activation_bytes": pred.memory_bytes["activations"],
            },
            "measured": {"step_s": median(out["step_s"]), "steps_s": out["step_s"]},
            # how much slower the machine ran the reference block now than when calibrated
            "drift": median(out["reference_s"]) / reference,
        }
        if state is not None:
            layouts[name]["measured"].update(state_bytes=state, activation_bytes=acts)
        print(
            f"{name}: step predicted {pred.step_time_s * 1e3:.1f} ms, measured "
            f"{median(out['step_s']) * 1e3:.1f} ms",
            flush=True,
        )
    return {"cluster": bench, "reference_s": calibrated["reference_s"], "layouts": layouts}


def step_row(name: str, rounds: list[dict]) -> list[str]:
    """A layout's step time: medians over the rounds, each round's error, and how much slower
    the machine ran the reference block during the layout than around its calibration."""
    of_layout = [r["layouts"][name] for r in rounds]
    predicted = [r["predicted"]["step_s"] for r in of_layout]
    measured = [r["measured"]["step_s"] for r in of_layout]
    drift = [r["drift"] for r in of_layout]
    errors = [error(p, m) for p, m in zip(predicted, measured, strict=True)]
    formulas = [
        error(r["predicted"]["step_s_formulas"], m)
        for r, m in zip(of_layout, measured, strict=True)
    ]
    return [
        name,
        f"{median(predicted) * 1e3:.1f}",
        f"{median(measured) * 1e3:.1f}",
        f"{median(errors):+.0%}",
        ", ".join(f"{e:+.0%}" for e in errors),
        ", ".join(f"{d:.2f}" for d in drift),
        f"{median(formulas):+.0%}",
    ]


def memory_row(name: str, rounds: list[dict]) -> list[str]:
    """A layout's memory, the same in every round: the first round's."""
    p, m = rounds[0]["layouts"][name]["predicted"], rounds[0]["layouts"][name]["measured"]
    row = [name]
    for key in ("state_bytes", "activation_bytes"):
        if key in m:
            mib = [f"{p[key] / 2**20:.2f}", f"{m[key] / 2**20:.2f}"]
            row += [*mib, f"{error(p[key], m[key]):+.0%}"]
        else:
            row += ["-", "-", "-"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per block")
    parser.add_argument("--repeats", type=int, default=3, help="timed blocks per layout")
    parser.add_argument("--rounds", type=int, default=3, help="calibrations, each then measured")
    parser.add_argument("--passes", type=int, default=3, help="of the calibration's profile")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    names = args.layouts.split(",")
    rounds = []
    with scratch_dir("distml-bench-plan-") as runs:
        for r in range(args.rounds):  # every other round in reverse, so drift spreads evenly
            order = names if r % 2 == 0 else names[::-1]
            rounds.append(
                measure_round(runs / f"round-{r}", order, args.steps, args.repeats, args.passes)
            )
    title = f"GPT {MODEL.layers}x{MODEL.hidden}, global batch {GLOBAL_BATCH}, 4 processes"
    print_table(
        f"Step time, planner vs measured, {title}, medians of {args.rounds} rounds",
        [
            "layout",
            "predicted ms",
            "measured ms",
            "error",
            "by round",
            "drift by round",
            "error, formulas only",
        ],
        [step_row(name, rounds) for name in names],
    )
    print_table(
        f"Memory per device, planner vs measured, {title}",
        ["layout", "state MiB (pred)", "(meas)", "error", "act MiB (pred)", "(meas)", "error"],
        [memory_row(name, rounds) for name in names],
    )
    out = {"machine": machine_info(), "args": vars(args), "rounds": rounds}
    print(f"results: {write_json('plan_accuracy', out)}")


if __name__ == "__main__":
    main()
