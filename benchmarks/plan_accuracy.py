"""The planner's predictions against what distml measures, same run, same machine.

    python benchmarks/plan_accuracy.py [--steps 8] [--repeats 3] [--layouts ddp4,fsdp4,...]

First ``distml bench``'s measurement runs in a world of 4 workers (matmul FLOP/s per worker
while all 4 compute, collectives, latency) with the benchmark's GPT, batch and micro-batches
given, so that it also profiles the pieces of that model's step (:mod:`distml.plan.profile`);
that is the cluster the cost model reads. Then, for each layout of
``benchmarks/model_parallel.py`` (fp32, AdamW), :func:`distml.plan.cost_model.predict` gives the
step time and the memory per device, and a world of 4 workers trains the layout through
``ctx.setup`` and measures them: the median step over ``--repeats`` blocks of ``--steps`` steps,
and the largest rank's model state and activation peak from its summary. The table prints both,
with the error of the prediction, and the error the formulas alone (the matmul rate, no
profile) would make. Goals: step time within 15%, memory within 10%.
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
from distml.plan.auto import gpt_params, layout_of, model_spec, training_for  # noqa: E402
from distml.plan.bench import cluster_from_dict, measure  # noqa: E402
from distml.plan.cost_model import predict  # noqa: E402


def worker(ctx: distml.Context, steps: int, repeats: int) -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(ctx.data_rank)
    batch_size = GLOBAL_BATCH // ctx.data_world
    batch = (torch.randint(0, MODEL.vocab_size, (batch_size, MODEL.seq_len), generator=g),) * 2
    step = build_distml(ctx)
    timed(step, batch, 2)  # warm-up: shape inference, lazy FSDP initialisation
    seconds = [timed(step, batch, steps) / steps for _ in range(repeats)]
    summary = ctx.finish()
    return {"step_s": seconds, "memory": summary.get("memory_per_rank", [])}


def error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per block")
    parser.add_argument("--repeats", type=int, default=3, help="timed blocks per layout")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    n_params = gpt_params(MODEL)
    model = model_spec(MODEL, n_params)
    results: dict[str, dict] = {}
    with scratch_dir("distml-bench-plan-") as runs:
        bench = distml.launch(
            lambda ctx: measure(gpt=MODEL, global_batch=GLOBAL_BATCH, microbatches=MICROBATCHES),
            nproc=4,
            runs_dir=runs,
            run_name="bench",
            telemetry={"progress": False},
        )
        cluster = cluster_from_dict(bench)
        formulas = replace(cluster, calibration=None)
        print(f"cluster: {bench['device']}", flush=True)
        for name in args.layouts.split(","):
            mesh, par = LAYOUTS[name]
            layout = layout_of(mesh, par)
            recompute = par.get("activation_checkpointing", "none")
            training = training_for(layout, GLOBAL_BATCH, MICROBATCHES, "fp32", recompute)
            pred = predict(model, cluster, training, layout)
            uncalibrated = predict(model, formulas, training, layout)
            out = launch_layout(name, runs, worker, args.steps, args.repeats)
            mem = out["memory"]
            state = max((m["params"] + m["grads"] + m["optimizer"] for m in mem), default=None)
            acts = max((m["activations"] for m in mem), default=None)
            pred_state = sum(pred.memory_bytes[k] for k in ("params", "grads", "optimizer"))
            results[name] = {
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
            }
            if state is not None:
                results[name]["measured"].update(state_bytes=state, activation_bytes=acts)
            print(
                f"{name}: step predicted {pred.step_time_s * 1e3:.1f} ms, measured "
                f"{median(out['step_s']) * 1e3:.1f} ms",
                flush=True,
            )
    rows = []
    for name, res in results.items():
        p, m = res["predicted"], res["measured"]
        row = [
            name,
            f"{p['step_s'] * 1e3:.1f}",
            f"{m['step_s'] * 1e3:.1f}",
            f"{error(p['step_s'], m['step_s']):+.0%}",
            f"{error(p['step_s_formulas'], m['step_s']):+.0%}",
        ]
        for key in ("state_bytes", "activation_bytes"):
            if key in m:
                row += [
                    f"{p[key] / 2**20:.2f}",
                    f"{m[key] / 2**20:.2f}",
                    f"{error(p[key], m[key]):+.0%}",
                ]
            else:
                row += ["-", "-", "-"]
        rows.append(row)
    print_table(
        "Planner vs measured, GPT "
        f"{MODEL.layers}x{MODEL.hidden}, global batch {GLOBAL_BATCH}, 4 processes",
        [
            "layout",
            "step ms (pred)",
            "step ms (meas)",
            "error",
            "error, formulas only",
            "state MiB (pred)",
            "state MiB (meas)",
            "error",
            "act MiB (pred)",
            "act MiB (meas)",
            "error",
        ],
        rows,
    )
    out = {"machine": machine_info(), "args": vars(args), "cluster": bench, "layouts": results}
    print(f"results: {write_json('plan_accuracy', out)}")


if __name__ == "__main__":
    main()
