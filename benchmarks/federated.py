"""Federated learning: FedSGD against FedAvg on pathological non-IID digits (shaped like Table 2
of McMahan et al. 2017), and the cost of secure aggregation.

    python benchmarks/federated.py                      # both parts
    python benchmarks/federated.py --part rounds --max-rounds 150 --target 0.85
    python benchmarks/federated.py --part secagg --rounds 5

Rounds part: 100 clients, each holding 2 classes of the digits training set (``shards:2``),
C = 0.1, the digits CNN; FedSGD (E = 1, B = all) and FedAvg with E in {1, 5} and B in {10, all},
every one at the same client learning rate. The table gives the rounds each needs to reach
``--target`` validation accuracy and its speed-up over FedSGD; a plot of accuracy against rounds
goes to ``benchmarks/results/federated_rounds.png``.

Secure-aggregation part: the same federation with and without ``--secure-agg``, with C = 0.1 (10
clients a round) and C = 1 (all 100): the median round time, their ratio (goal <= 2x), and the
bytes each participant sends and receives per round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _common import RESULTS_DIR, machine_info, print_table, write_json

from distml.federated.secure_aggregation import SecureAggregation
from distml.federated.server import ServerConfig
from distml.federated.strategy import LocalConfig, make_strategy
from distml.jobs.fl_simulation import SimulationConfig, simulate

CONFIGS = [  # (name, E, B); B = 0 is all of a client's data in one batch
    ("FedSGD", 1, 0),  # = FedAvg with E = 1, B = all
    ("FedAvg E=5 B=all", 5, 0),
    ("FedAvg E=1 B=10", 1, 10),
    ("FedAvg E=5 B=10", 5, 10),
]


def run(rounds: int, epochs: int, batch: int, args, *, fraction=0.1, secure=False):
    history: list[dict[str, Any]] = []
    sim = SimulationConfig(clients=100, partition="shards:2", processes=args.processes)
    config = ServerConfig(model=args.model, rounds=rounds, min_available=100)
    local = LocalConfig(epochs=epochs, batch_size=batch, lr=args.lr)
    strategy = make_strategy("fedavg", fraction_fit=fraction, local=local)
    if secure:
        strategy = SecureAggregation(strategy)
    summary = simulate(sim, config, strategy, on_round=history.append)
    return summary, history


def rounds_to(history: list[dict[str, Any]], target: float) -> int | None:
    for record in history:
        if record.get("accuracy", 0.0) >= target:
            return record["round"]
    return None


def part_rounds(args) -> dict[str, Any]:
    results = {}
    for name, epochs, batch in CONFIGS:
        started = time.perf_counter()
        # FedSGD needs many more rounds (McMahan et al. report hundreds): give it 4x the budget.
        budget = args.max_rounds * (4 if name == "FedSGD" else 1)
        _, history = run(budget, epochs, batch, args)
        results[name] = {
            "rounds_to_target": rounds_to(history, args.target),
            "accuracy": [h["accuracy"] for h in history],
            "final_accuracy": history[-1]["accuracy"],
            "wall_s": time.perf_counter() - started,
        }
        print(f"{name}: {results[name]['rounds_to_target']} rounds to {args.target}", flush=True)
    base = results["FedSGD"]["rounds_to_target"]
    rows = []
    for name, r in results.items():
        n = r["rounds_to_target"]
        speedup = f"{base / n:.1f}x" if base and n else "-"
        shown = str(n) if n else f"> {len(r['accuracy'])}"
        rows.append([name, shown, speedup, f"{r['final_accuracy']:.3f}"])
    print_table(f"Rounds to {args.target} accuracy (digits CNN, 100 clients, 2 classes each, "
                "C = 0.1)", ["", "rounds", "vs FedSGD", "final acc"], rows)  # fmt: skip
    _plot(results, args)
    return results


def _plot(results: dict[str, Any], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        ax.plot(range(1, len(r["accuracy"]) + 1), r["accuracy"], label=name)
    ax.axhline(args.target, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("round")
    ax.set_ylabel("validation accuracy")
    ax.set_title("Digits, pathological non-IID (2 classes per client), C = 0.1")
    ax.legend()
    RESULTS_DIR.mkdir(exist_ok=True)
    fig.savefig(RESULTS_DIR / "federated_rounds.png", dpi=120, bbox_inches="tight")


def part_secagg(args) -> dict[str, Any]:
    results, rows = {}, []
    for fraction in (0.1, 1.0):
        times = {}
        for secure in (False, True):
            _, history = run(args.rounds, 1, 10, args, fraction=fraction, secure=secure)
            # The first round pays for the clients' first model build: leave it out.
            steady = history[1:] or history
            per_client = [(h["bytes_up"] + h["bytes_down"]) / h["participants"] for h in steady]
            times[secure] = statistics.median(h["duration_s"] for h in steady)
            results[f"C={fraction} secure={secure}"] = {
                "round_s": times[secure],
                "bytes_per_client": statistics.median(per_client),
                "rounds": history,
            }
        ratio = times[True] / times[False]
        results[f"C={fraction} ratio"] = ratio
        rows.append([
            f"C = {fraction} ({round(fraction * 100)} clients a round)",
            f"{times[False]:.3f}", f"{times[True]:.3f}", f"{ratio:.2f}x",
            f"{results[f'C={fraction} secure=False']['bytes_per_client'] / 1e3:.0f} kB",
            f"{results[f'C={fraction} secure=True']['bytes_per_client'] / 1e3:.0f} kB",
        ])  # fmt: skip
    print_table("Round time with secure aggregation (median over rounds, s)",
                ["", "plain", "secure", "ratio", "bytes/client plain", "secure"], rows)  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--part", choices=["rounds", "secagg", "all"], default="all")
    parser.add_argument("--model", default="digits-cnn")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--max-rounds", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of the secagg part")
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    payload: dict[str, Any] = {"machine": machine_info(), "args": vars(args)}
    if args.part in ("rounds", "all"):
        payload["rounds"] = part_rounds(args)
    if args.part in ("secagg", "all"):
        payload["secagg"] = part_secagg(args)
    print(f"wrote {write_json('federated', payload)}")


if __name__ == "__main__":
    main()
