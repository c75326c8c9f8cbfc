"""Many virtual clients on one machine, against the real server over loopback.

The server runs in this process (uvicorn in a thread); the clients live in a bounded pool of
worker processes, each holding the data of its own clients only (it loads the dataset and keeps
its partition: no example crosses the network). Every client has its own token.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distml.data import digits
from distml.federated.app import create_fl_app
from distml.federated.client import FederatedClient, parse_attack, run_clients
from distml.federated.partition import partition
from distml.federated.server import FederatedServer, ServerConfig
from distml.federated.strategy import Strategy
from distml.launch.forkserver import start_fork_server
from distml.net import BackgroundServer


@dataclass
class SimulationConfig:
    clients: int = 100
    partition: str = "iid"
    processes: int = 2
    byzantine: float = 0.0  # fraction of clients that attack
    attack: str = "sign-flip:10"
    seed: int = 0


def _pool_worker(url: str, members: list[tuple[str, str, list[int], bool]], attack: str) -> None:
    """One pool process: the data of its clients, and their answers to every round."""

    torch.set_num_threads(1)
    train = digits("train")
    x, y = train.tensors
    clients = []
    for k, (_name, token, indices, byzantine) in enumerate(members):
        idx = torch.tensor(indices)
        data = torch.utils.data.TensorDataset(x[idx], y[idx])
        clients.append(
            FederatedClient(
                url, token, data, seed=k, attack=parse_attack(attack) if byzantine else None
            )
        )
    run_clients(clients)


def simulate(
    sim: SimulationConfig,
    server_config: ServerConfig,
    strategy: Strategy,
    *,
    checkpoint_dir: Path | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run ``server_config.rounds`` rounds with ``sim.clients`` virtual clients; the summary.
    ``strategy`` may be wrapped in differential privacy or secure aggregation."""

    if sim.processes < 1 or not 0 <= sim.byzantine < 1:
        raise ValueError(f"need processes >= 1 and 0 <= byzantine < 1, got {sim}")
    labels = digits("train").tensors[1]
    parts = partition(labels, sim.clients, sim.partition, sim.seed)
    names = [f"client-{i:04d}" for i in range(sim.clients)]
    tokens = {name: secrets.token_urlsafe(24) for name in names}
    attackers = set(names[: round(sim.byzantine * sim.clients)])
    server = FederatedServer(server_config, strategy, digits("val"), checkpoint_dir=checkpoint_dir)
    app = create_fl_app(server, tokens)
    # Forked from the preloaded fork server (a spawned worker paid torch's import each).
    start_fork_server()
    ctx = mp.get_context("forkserver")
    workers = []
    started = time.perf_counter()
    with BackgroundServer(app) as http:
        url = http.url
        for p in range(min(sim.processes, sim.clients)):
            members = [
                (n, tokens[n], parts[i], n in attackers)
                for i, n in enumerate(names)
                if i % sim.processes == p
            ]
            proc = ctx.Process(target=_pool_worker, args=(url, members, sim.attack), daemon=True)
            proc.start()
            workers.append(proc)
        reported = 0
        while not server.finished:
            reported = _report(server.history, reported, on_round)
            if not any(w.is_alive() for w in workers):
                raise RuntimeError("every client process has exited before the last round")
            time.sleep(0.05)
        _report(server.history, reported, on_round)
        for w in workers:
            w.join(60)
    summary = server.summary() | {
        "clients": sim.clients,
        "partition": sim.partition,
        "strategy": strategy.name,
        "byzantine": len(attackers),
        "wall_s": time.perf_counter() - started,
    }
    return summary


def _report(history: list[dict[str, Any]], reported: int, on_round) -> int:
    for record in history[reported:]:
        if on_round is not None:
            on_round(record)
    return len(history)


def print_json_line(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()
