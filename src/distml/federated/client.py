"""A federated client: its data stays in this process. When the server selects it, it fetches the
global model, evaluates it on its own data, trains on it, and sends back only its update.

>>> client = FederatedClient("http://127.0.0.1:7400", token, digits("train"))  # doctest: +SKIP
>>> client.run()                                                                # doctest: +SKIP
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from torch.utils.data import TensorDataset

from distml.federated.secure_client import SecureSession
from distml.federated.task import Params, build_model, evaluate, set_params, train_local
from distml.net import ServiceClient, ServiceError, decode_tensors, encode_tensors

Attack = Callable[[Params], Params]
# Energy of local training, estimated from its CPU time as distml.telemetry.energy does where no
# hardware counter is read: a typical figure per busy core.
WATTS_PER_CORE = 10.0


def parse_attack(spec: str) -> Attack:
    """A Byzantine client's rewrite of its honest update, for robustness tests:
    ``sign-flip:S`` sends -S x the update, ``scale:S`` sends S x the update."""
    kind, _, arg = spec.partition(":")
    try:
        factor = float(arg or 1.0)
    except ValueError:
        factor = float("nan")
    if kind not in ("sign-flip", "scale") or not factor > 0:
        raise ValueError(f"attack {spec!r}: expected sign-flip:S or scale:S with S > 0")
    sign = -1.0 if kind == "sign-flip" else 1.0
    return lambda delta: {n: sign * factor * t for n, t in delta.items()}


class FederatedClient:
    def __init__(
        self,
        url: str,
        token: str,
        data: TensorDataset,
        *,
        seed: int = 0,
        verify: bool | str = True,
        attack: Attack | None = None,
        retry_s: float = 60.0,
    ):
        self.http = ServiceClient(url, token, verify=verify, retry_s=retry_s)
        self.data = data
        self.seed = seed
        self.attack = attack
        self.rounds_trained = 0
        self._models: dict[str, Any] = {}

    def register(self) -> dict[str, Any]:
        return self.http.request("POST", "/v1/register").json()

    def leave(self) -> None:
        """Tell the server this client is going: the open round stops waiting for it. One
        try: a client that cannot reach the server is a dropout the round's deadline handles."""
        self.http.retry_s = 0.0
        self.http.request("POST", "/v1/leave")

    def task(self) -> dict[str, Any] | None:
        """This client's task in the open round; None if it was not selected."""
        response = self.http.request("GET", "/v1/task")
        return None if response.status_code == 204 else response.json()

    def train(self, task: dict[str, Any]) -> tuple[Params, int, dict[str, float]]:
        """Fetch the global model, evaluate it on the local data, train: (delta, examples,
        metrics)."""
        params, _ = decode_tensors(self.http.request("GET", "/v1/model").content)
        model = self._model(task["model"])
        set_params(model, params)
        before = evaluate(model, self.data)  # the global model on this client's data
        cfg = task["config"]
        cpu = time.process_time()
        result = train_local(
            model,
            self.data,
            epochs=int(cfg["epochs"]),
            batch_size=int(cfg["batch_size"]),
            lr=float(cfg["lr"]),
            prox_mu=float(cfg.get("prox_mu") or 0.0),
            clip_norm=cfg.get("clip_norm"),
            seed=self.seed * 1_000 + task["round"],
        )
        energy_j = (time.process_time() - cpu) * WATTS_PER_CORE
        delta = self.attack(result.delta) if self.attack else result.delta
        self.rounds_trained += 1
        metrics = {"loss": before["loss"], "accuracy": before["accuracy"], "energy_j": energy_j}
        return delta, result.num_examples, metrics | {"train_loss": result.loss}

    def fit(self, task: dict[str, Any]) -> None:
        """Train and send the update in the clear (the server sees it, not the data)."""
        delta, examples, metrics = self.train(task)
        body = encode_tensors(
            delta, {"num_examples": str(examples), "metrics": json.dumps(metrics)}
        )
        try:
            self.http.request("POST", "/v1/update", params={"round": task["round"]}, content=body)
        except ServiceError as exc:  # a late update is the server's call, not a failure here
            if exc.status != 409:
                raise

    def _model(self, name: str):
        if name not in self._models:
            self._models[name] = build_model(name)
        return self._models[name]

    def run(self, poll_s: float = 20.0) -> int:
        """Answer the server's rounds until it has finished; the number of rounds trained."""
        run_clients([self], poll_s)
        return self.rounds_trained

    def close(self) -> None:
        self.http.close()


def run_clients(clients: list[FederatedClient], poll_s: float = 20.0) -> None:
    """Serve several clients from one process (the simulation's worker pool): wait for a round
    to open, let each selected client train, repeat until the server has finished. A server
    that restarts (a new ``generation``) is registered with again."""
    watcher = clients[0].http
    generation, served = None, 0  # served: the last round (attempt) this process answered
    status = watcher.request("GET", "/v1/status").json()
    while not status["finished"]:
        if status["generation"] != generation:
            for client in clients:
                client.register()
            generation, served = status["generation"], 0
        if status["open"] and status["attempt"] != served:
            tasks = [(client, client.task()) for client in clients]
            selected = [(client, task) for client, task in tasks if task is not None]
            if any("secagg" in task for _, task in selected):
                run_secure_round(selected)
            else:
                for client, task in selected:
                    client.fit(task)
            served = status["attempt"]
        # Long-poll: wakes when a round opens or completes, or after poll_s to refresh presence.
        status = watcher.request(
            "GET",
            "/v1/status",
            params={
                "after": status["completed"],
                "seen_attempt": served,
                "wait": poll_s,
                "generation": generation,
            },
        ).json()


def run_secure_round(selected: list[tuple[FederatedClient, dict[str, Any]]]) -> None:
    """This process's selected clients through the four stages of secure aggregation, stage by
    stage together (each stage closes only when every client of the round has answered it). A
    client the protocol leaves out, or that cannot go on safely, sits the round out."""

    sessions = [SecureSession(client, task) for client, task in selected]
    for stage in ("advertise", "share_keys", "masked_input", "unmask"):
        for session in sessions:
            session.step(stage)
        sessions = [s for s in sessions if s.active]
