"""The federated server's rounds (the routes are in :mod:`distml.federated.app`).

A round: sample clients with the strategy, publish the global model and the round's settings,
collect updates until every selected client has answered or the deadline passes, then, if at
least ``quorum`` of them answered, aggregate, evaluate on the server's held-out data and
checkpoint. The deadline is ``round_timeout_s`` after the round's first update: the clients
train under the same load, so a busy machine that slows them all does not drop the slowest (a
round that nobody answers closes ``availability_s`` later). Updates for a round that has closed
are refused as late. A round without its quorum is run again with a fresh sample. A restarted
server resumes after its last completed round.

The server knows one strategy and asks it the same questions whatever it is: whom to ask
(``configure_fit``), what to make of the answers (``aggregate_fit``, ``aggregate_evaluate``) and,
for a strategy whose answers come in stages (secure aggregation), which stages the round goes
through (``open_stages``); the server relays their messages. Differential privacy and secure
aggregation are wrappers around the strategy (:mod:`distml.federated.wrapper`), chosen once by
whoever builds the server.
"""

from __future__ import annotations

import asyncio
import math
import random
import secrets
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field
from torch.utils.data import TensorDataset

from distml.federated.checkpoint import load_checkpoint, save_checkpoint
from distml.federated.round import Round, summarize
from distml.federated.secure_round import StageError
from distml.federated.strategy import ClientUpdate, RoundStages, Strategy
from distml.federated.task import Params, build_model, evaluate, get_params, norm, set_params
from distml.net import LoopStopped

# Rounds in a row that end in an error (not a missed quorum) before the server gives up: the
# same failure again and again is a fault no fresh sample of clients will get past.
MAX_ROUND_ERRORS = 3


class ServerConfig(BaseModel):
    model: str = "digits-mlp"
    rounds: int = Field(10, ge=1)
    min_available: int = Field(2, ge=1, description="available clients to start a round")
    round_timeout_s: float = Field(
        60.0, gt=0, description="how long a round waits for the rest after its first update"
    )
    quorum: float = Field(0.5, gt=0, le=1, description="fraction of the selected that must answer")
    availability_s: float = Field(120.0, gt=0, description="silence after which a client is away")
    max_update_norm: float | None = Field(None, gt=0, description="refuse updates above it")
    seed: int = 0


class UpdateRejected(ValueError):
    """An update that does not fit the model or the round (answered 4xx)."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


class FederatedServer:
    def __init__(
        self,
        config: ServerConfig,
        strategy: Strategy,
        eval_data: TensorDataset,
        *,
        checkpoint_dir: Path | None = None,
    ):
        self.config = config
        self.strategy = strategy
        self.eval_data = eval_data
        self.checkpoint_dir = checkpoint_dir
        self.model = build_model(config.model, config.seed)
        self.params: Params = get_params(self.model)
        self.completed = 0  # rounds aggregated
        self.history: list[dict[str, Any]] = []
        self.clients: dict[str, float] = {}  # client -> last seen (monotonic)
        self.round: Round | None = None
        self.late = 0
        self.finished = False
        self.round_errors = 0  # rounds in a row that ended in an error
        self.generation = secrets.token_hex(4)  # new at every start: clients see a restart
        self._cond = asyncio.Condition()
        self._model_body: tuple[int, bytes] | None = None
        if checkpoint_dir is not None and (checkpoint_dir / "global.safetensors").exists():
            self._resume(checkpoint_dir)

    # -- clients ----------------------------------------------------------------------------
    async def seen(self, client: str) -> None:
        async with self._cond:
            new = client not in self.clients
            self.clients[client] = time.monotonic()
            if new:
                self._cond.notify_all()

    async def leave(self, client: str) -> None:
        """``client`` is going away (Flower's DeleteNode): it is no longer available, and an
        open round that selected it and has not heard from it stops waiting for it."""
        async with self._cond:
            self.clients.pop(client, None)
            r = self.round
            if r is not None and r.open and client in r.pending():
                r.left.add(client)
                if r.secure is not None:
                    r.secure.leave(client)
            self._cond.notify_all()

    def available(self) -> list[str]:
        now = time.monotonic()
        return [c for c, t in self.clients.items() if now - t < self.config.availability_s]

    def task_for(self, client: str) -> dict[str, Any] | None:
        """The fit task of ``client`` in the open round, if it was selected and has not answered."""
        r = self.round
        if r is None or not r.open or client not in r.pending():
            return None
        task = {"round": r.number, "model": self.config.model, "config": r.config}
        if r.secure is not None:
            task["secagg"] = r.secure.task(client)
        return task

    def status(self) -> dict[str, Any]:
        r = self.round
        return {
            "round": r.number if r else self.completed + 1,
            "attempt": r.attempt if r else 0,
            "generation": self.generation,
            "open": bool(r and r.open),
            "completed": self.completed,
            "rounds": self.config.rounds,
            "finished": self.finished,
            "clients": len(self.clients),
        }

    async def wait_for_change(
        self, after_completed: int, seen_attempt: int, timeout: float, generation: str = ""
    ) -> None:
        """Long-poll: return once a round opens or completes past what the caller saw (or
        at once, if the caller saw another generation of this server)."""

        def changed() -> bool:
            r = self.round
            return (
                self.finished
                or generation != self.generation
                or self.completed > after_completed
                or bool(r and r.open and r.attempt != seen_attempt)
            )

        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(changed), timeout)
            except TimeoutError:
                pass

    def model_body(self, encode) -> bytes:
        """The global model as a payload, encoded once per version."""
        if self._model_body is None or self._model_body[0] != self.completed:
            self._model_body = (self.completed, encode(self.params, {"round": str(self.completed)}))
        body = self._model_body[1]
        if self.round is not None and self.round.open:
            self.round.bytes_down += len(body)
        return body

    # -- updates ----------------------------------------------------------------------------
    def check_update(self, delta: Params) -> None:
        """Refuse an update that does not fit the model, holds a non-finite value, or is longer
        than ``max_update_norm`` or the ``clip_norm`` the open round asked its clients for."""
        if set(delta) != set(self.params):
            missing, unknown = set(self.params) - set(delta), set(delta) - set(self.params)
            raise UpdateRejected(
                f"names differ: missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        for name, t in delta.items():
            p = self.params[name]
            if t.shape != p.shape or t.dtype != p.dtype:
                raise UpdateRejected(
                    f"{name}: got {t.dtype} {tuple(t.shape)}, expected {p.dtype} {tuple(p.shape)}"
                )
            if not torch.isfinite(t).all():
                raise UpdateRejected(f"{name}: non-finite values")
        clip = self.round.config.get("clip_norm") if self.round is not None else None
        bound = min((b for b in (self.config.max_update_norm, clip) if b is not None), default=None)
        if bound is not None and norm(delta) > bound * (1 + 1e-5):
            raise UpdateRejected(f"update norm {norm(delta):.4g} is above the bound {bound:g}")

    async def submit(
        self,
        client: str,
        round_number: int,
        delta: Params,
        num_examples: int,
        metrics: dict[str, float],
        nbytes: int = 0,
    ) -> None:
        self.check_update(delta)
        async with self._cond:
            r = self.round
            if r is None or r.number != round_number or not r.open:
                self.late += 1
                raise UpdateRejected(f"round {round_number} is closed: a late update", 409)
            if client not in r.selected:
                raise UpdateRejected(f"{client} was not selected for round {round_number}", 403)
            if client in r.updates:
                raise UpdateRejected(f"{client} has already answered round {round_number}", 409)
            if client in r.left:
                raise UpdateRejected(f"{client} has left round {round_number}", 409)
            r.updates[client] = ClientUpdate(client, delta, num_examples, metrics)
            r.arrivals.append(time.perf_counter())
            r.bytes_up += nbytes
            self.clients[client] = time.monotonic()
            self._cond.notify_all()

    # -- the rounds -------------------------------------------------------------------------
    async def run(self) -> None:
        """Run rounds until ``config.rounds`` have completed (a service runs :meth:`step` in
        its supervised background loop instead)."""
        while self.completed < self.config.rounds:
            await self.step()
        await self._finish()

    async def step(self) -> None:
        """One round: open, collect, aggregate, record. A round that fails with an error is
        recorded as failed, with the model and the strategy as they were, and the error raised
        for the caller to report; the next step opens a fresh round. After MAX_ROUND_ERRORS
        such rounds in a row, :class:`LoopStopped`. Once every round is done, waits for ever."""
        if self.completed >= self.config.rounds:
            await self._finish()
            await asyncio.Future()  # nothing left to run: a service's loop idles here
        r = await self._open_round()
        saved = self._saved_state()
        try:
            await self._collect(r)
            record = await self._finish_round(r)
        except Exception as exc:
            self._restore_state(saved)
            await self._record(r, r.failed(f"error: {type(exc).__name__}: {exc}"))
            self.round_errors += 1
            if self.round_errors >= MAX_ROUND_ERRORS:
                raise LoopStopped(f"{self.round_errors} rounds in a row ended in an error") from exc
            raise
        self.round_errors = 0
        await self._record(r, record)
        if self.completed >= self.config.rounds:
            await self._finish()

    async def _record(self, r: Round, record: dict[str, Any]) -> None:
        async with self._cond:
            r.open = False
            self.history.append(record)
            if record["status"] == "completed":
                self.completed = r.number
                if self.checkpoint_dir is not None:
                    await asyncio.to_thread(self._checkpoint)
            self._cond.notify_all()

    async def _finish(self) -> None:
        async with self._cond:
            self.finished = True
            self._cond.notify_all()

    def _saved_state(self) -> tuple[Params, dict[str, torch.Tensor]]:
        """What aggregating a round changes, to put back if it fails half-way: the model and the
        strategy's state (a server optimizer's moments, a privacy ledger)."""
        return dict(self.params), dict(self.strategy.state_dict())

    def _restore_state(self, saved: tuple[Params, dict[str, torch.Tensor]]) -> None:
        params, strategy_state = saved
        self.params = params
        self.strategy.load_state_dict(strategy_state)

    def round_size(self) -> int:
        """How many clients the open round selected (0 when none is open)."""
        r = self.round
        return len(r.selected) if r is not None and r.open else 0

    async def _open_round(self) -> Round:
        async with self._cond:
            await self._cond.wait_for(lambda: len(self.available()) >= self.config.min_available)
            number = self.completed + 1
            rng = random.Random(f"{self.config.seed}:{len(self.history)}")  # a rerun draws anew
            selected, cfg = self.strategy.configure_fit(number, self.available(), rng)
            stages = self.strategy.open_stages(number, selected, self.params)
            deadline = time.monotonic() + self.config.round_timeout_s + self.config.availability_s
            self.round = Round(number, len(self.history) + 1, selected, cfg, deadline)
            self.round.secure = stages
            self._cond.notify_all()
            return self.round

    async def _collect(self, r: Round) -> None:
        """Wait for every selected client's update, or the deadline; then close the round.
        A round in stages does the same for each stage."""
        async with self._cond:
            if r.secure is None:
                await self._wait(lambda: r.updates or not r.pending(), r.deadline)
                if r.arrivals:
                    first = r.arrivals[0] - time.perf_counter() + time.monotonic()
                    deadline = min(first + self.config.round_timeout_s, r.deadline)
                    await self._wait(lambda: not r.pending(), deadline)
            else:
                while not r.secure.done:
                    timeout = (
                        self.config.round_timeout_s
                        if r.secure.training
                        else r.secure.stage_timeout_s
                    )
                    await self._wait(r.secure.complete, time.monotonic() + timeout)
                    r.secure.close_stage()
                    self._cond.notify_all()
            r.open = False
            self._cond.notify_all()

    async def _wait(self, predicate, deadline: float) -> None:
        """Wait (holding the condition) until ``predicate()`` or the deadline."""
        try:
            await asyncio.wait_for(self._cond.wait_for(predicate), deadline - time.monotonic())
        except TimeoutError:
            pass

    # -- secure aggregation's messages ------------------------------------------------------
    def _secure(self, client: str, round_number: int) -> RoundStages:
        r = self.round
        if r is None or r.number != round_number or not r.open or r.secure is None:
            raise UpdateRejected(f"round {round_number} takes no secure-aggregation messages", 409)
        if client not in r.selected:
            raise UpdateRejected(f"{client} was not selected for round {round_number}", 403)
        return r.secure

    async def secure_receive(
        self, client: str, round_number: int, stage: str, payload: Any, nbytes: int
    ) -> None:
        async with self._cond:
            secure = self._secure(client, round_number)
            try:
                secure.receive(client, stage, payload)
            except StageError as exc:
                raise UpdateRejected(str(exc), exc.status) from None
            self.round.bytes_up += nbytes
            self.clients[client] = time.monotonic()
            self._cond.notify_all()

    async def secure_view(self, client: str, round_number: int, stage: str, wait: float) -> Any:
        """What ``client`` needs for ``stage``, waiting up to ``wait`` s for the stage before it
        to close; None if it has not."""
        async with self._cond:
            secure = self._secure(client, round_number)

            def ready() -> bool:
                return secure.done or secure.view(client, stage) is not None

            try:
                await self._wait(ready, time.monotonic() + wait)
                return secure.view(client, stage)
            except StageError as exc:
                raise UpdateRejected(str(exc), exc.status) from None

    async def _finish_round(self, r: Round) -> dict[str, Any]:
        updates = list(r.updates.values())
        needed = max(1, math.ceil(self.config.quorum * len(r.selected)))
        failure = r.secure.failure if r.secure is not None else None
        if r.answered() < needed or failure is not None:
            return r.failed(failure)
        params, fit_metrics = await asyncio.to_thread(
            self.strategy.aggregate_fit, r.number, self.params, updates
        )
        if not all(bool(torch.isfinite(t).all()) for t in params.values()):
            raise ValueError(f"round {r.number}: the aggregate holds NaN or infinity")
        self.params = params
        record = r.entry() | await asyncio.to_thread(self._evaluate)
        fed = self.strategy.aggregate_evaluate(
            [
                u.metrics | {"num_examples": u.num_examples}
                for u in updates
                if "loss" in u.metrics and "accuracy" in u.metrics
            ]
        )
        record.update({f"client_{k}": v for k, v in fed.items()})
        record.update(r.client_figures())
        record.update(fit_metrics)
        return record | {"status": "completed", "duration_s": r.duration_s()}

    def _evaluate(self) -> dict[str, float]:
        set_params(self.model, self.params)
        metrics = evaluate(self.model, self.eval_data)
        return {"accuracy": metrics["accuracy"], "loss": metrics["loss"]}

    # -- checkpoints ------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        save_checkpoint(
            self.checkpoint_dir,
            params=self.params,
            strategy_state=self.strategy.state_dict(),
            state={
                "completed": self.completed,
                "history": self.history,
                "clients": sorted(self.clients),
                "strategy": self.strategy.name,
                "model": self.config.model,
            },
        )

    def _resume(self, directory: Path) -> None:
        params, strategy_state, state = load_checkpoint(directory)
        if state.get("model") != self.config.model or set(params) != set(self.params):
            raise ValueError(
                f"{directory} holds a checkpoint of {state.get('model')!r}, "
                f"not of {self.config.model!r}"
            )
        self.params = params
        self.strategy.load_state_dict(strategy_state)
        self.completed = int(state["completed"])
        self.history = list(state["history"])
        # The clients known before the restart count as available until they stay silent for
        # availability_s, as they would have without the restart.
        now = time.monotonic()
        self.clients = {name: now for name in state.get("clients", [])}

    def summary(self) -> dict[str, Any]:
        return summarize(self.history, self.completed, self.late)
