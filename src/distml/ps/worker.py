"""The worker's side of a parameter server: the training strategy of ``--strategy ps``.

After backward, the worker sends its gradients to every shard in one exchange a step
(``POST /v1/step``): each shard applies them and answers with the parameters the worker trains on
next, as soon as the consistency rule lets it read them (under BSP once the step's barrier is
complete; the request waits on the shard, a long poll). The requests to all shards go out before
any answer is read, so the shards work at once, without a thread per call; each answer is read
into one buffer that the parameters are copied from. The local optimizer never steps: the
servers own the optimizer state, write the checkpoints (their snapshots) and tell a restarted
worker where it resumes. Under ASP and SSP the worker's data loader claims its batches from the
first shard, one at a time: each in the exchange of the step before it (the claim the loader
makes next, answered when the step's parameters are), the first of an epoch on its own. A
worker that stops after a step (a step limit) leaves that one batch of its epoch untrained, as
a data loader that prefetches does.

The workers share no process group: each is a world of one, and the job that started them with
their shards (:mod:`distml.jobs.ps`) gathers their records.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distml.config import RunConfig
from distml.data.loader import ShardedLoader
from distml.data.sampler import ClaimedBatchSampler
from distml.net import ServiceError, decode_tensors, encode_tensors, token_from_env
from distml.net.client import Answer, KeepAliveClient
from distml.net.tensors import tensor_parts
from distml.parallel.strategy import StrategyEnv, TrainingStrategy
from distml.ps.optimizer_spec import describe_optimizer
from distml.ps.placement import place_parameters

NOT_YET = 425  # the shard's answer while the consistency rule makes a reader wait
PUSHED_ONLY = 202  # a step's push counted, its parameters not readable within the long poll
SERVERS_ENV = "DISTML_PS_SERVERS"
# How long a read waits on a shard before it asks again: well within the connection's timeout.
LONG_POLL_S = 30.0


def servers_from_env() -> tuple[list[str], str]:
    """The shards' URLs (``DISTML_PS_SERVERS``, comma-separated) and the job's token."""
    urls = [u for u in os.environ.get(SERVERS_ENV, "").split(",") if u]
    if not urls:
        raise RuntimeError(
            f"--strategy ps: no parameter servers; {SERVERS_ENV} is empty (start the script "
            "with `distml run --strategy ps`, or point it at `distml ps serve` shards)"
        )
    return urls, token_from_env()


class ParameterServerWorker(TrainingStrategy):
    """Worker ``env.rank`` of a parameter-server job whose shards listen at ``urls``.

    Every worker computes the same placement of the model's parameters over the shards; worker 0
    sends the initial parameters and the optimizer's description (each shard keeps the first it
    gets, so a restarted worker 0 changes nothing). With ``consistency``, a shard that applies
    another rule is refused: the worker's data loader depends on it (claimed batches or fixed
    shards).
    """

    joins_process_group = False
    counts_memory = False  # the servers hold the optimizer state

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        env: StrategyEnv,
        urls: list[str],
        token: str,
        heartbeat_s: float = 2.0,
        consistency: str | None = None,
    ):
        super().__init__(model, env)
        self.rank = env.rank
        self.accounting = env.recorder
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.placement = place_parameters(self.params, len(urls))
        self.clients = [KeepAliveClient(u, token) for u in urls]
        # Each shard's answers are read into one buffer, step after step: the parameters are
        # copied out of it at once, and memory reused costs no page faults.
        self._buffers = [bytearray() for _ in urls]
        self.read_versions = [0] * len(urls)
        self.versions = [0] * len(urls)
        self.generations = [""] * len(urls)
        self.wait_s = 0.0  # of the last step: time the consistency rule held this worker
        self.finished = False
        self.consistency = consistency  # the rule this worker's data loading expects, if known
        self._next_claim: tuple[int, int, int] | None = None  # to claim in the next step
        self._claimed: tuple[tuple[int, int, int], int | None] | None = None  # and its answer
        clocks = [self._register(k, optimizer) for k in range(len(urls))]
        self.start_step = min(clocks)
        self.pull()
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat, args=(heartbeat_s,), daemon=True, name="ps-heartbeat"
        )
        self._heartbeat.start()

    @classmethod
    def apply(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        env: StrategyEnv,
    ) -> tuple[ParameterServerWorker, torch.optim.Optimizer]:
        if optimizer is None:
            raise ValueError("a parameter-server worker needs the optimizer the servers apply")
        urls, token = servers_from_env()
        # Beats well inside the shards' timeout, so that a live worker is never taken for gone.
        beat = min(2.0, env.config.ps.heartbeat_timeout_s / 4)
        worker = cls(
            model,
            optimizer,
            env,
            urls,
            token,
            heartbeat_s=beat,
            consistency=env.config.ps.consistency,
        )
        return worker, optimizer

    @classmethod
    def claims_batches(cls, config: RunConfig) -> bool:
        return config.ps.consistency != "bsp"

    # -- the training strategy --------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Push this step's gradients and read the next parameters, in one exchange with each
        shard (the servers step the optimizer). Returns the seconds spent."""
        start = time.perf_counter()
        parts = [tensor_parts(self._grads(k)) for k in range(len(self.clients))]
        claim, self._next_claim = self._next_claim, None
        answers = self._exchange(
            "POST",
            "/v1/step",
            lambda k: self._step_query(k, step, claim),
            lambda k: parts[k],
            into=self._buffers,
        )
        for p in self.params.values():
            p.grad = None
        waited = []
        for k, answer in enumerate(answers):
            size = sum(memoryview(part).nbytes for part in parts[k])
            self.accounting.add_comm("ps_push", size, size)
            self.read_versions[k] = int(answer.headers["X-Read-Version"])
            if answer.status == PUSHED_ONLY:
                waited.append(self._pull(k))
            else:
                waited.append(self._take(k, answer))
        batch = answers[0].headers.get("X-Claim")
        if claim is not None and batch is not None:
            self._claimed = (claim, None if batch == "none" else int(batch))
        self._waited(waited, start)
        return time.perf_counter() - start

    def claim(self, epoch: int, position: int, batches: int) -> int | None:
        """The next unclaimed batch of ``epoch`` (ASP and SSP: the first shard hands them out);
        ``position``: this worker's claims of the epoch so far, so that a retry is known. The
        answer came with the last step's parameters when that step claimed this one."""
        claimed, self._claimed = self._claimed, None
        if claimed is not None and claimed[0] == (epoch, position, batches):
            batch = claimed[1]
        else:
            query = {"worker": self.rank, "epoch": epoch, "position": position, "batches": batches}
            batch = self.clients[0].request("POST", "/v1/claim", params=query).json()["batch"]
        self._next_claim = None if batch is None else (epoch, position + 1, batches)
        return batch

    # -- the protocol -----------------------------------------------------------------------
    def _exchange(
        self,
        method: str,
        path: str,
        params: Callable[[int], dict[str, Any]],
        content: Callable[[int], Any] | None = None,
        ok: tuple[int, ...] = (),
        into: list[bytearray] | None = None,
    ) -> list[Answer]:
        """The same request to every shard (``params(k)`` and ``content(k)`` for shard k): all
        are sent before any answer is read (into ``into[k]``, where given)."""
        pending = [
            client.send(method, path, params=params(k), content=content and content(k))
            for k, client in enumerate(self.clients)
        ]
        return [
            client.receive(p, ok=ok, into=into and into[k])
            for k, (client, p) in enumerate(zip(self.clients, pending, strict=True))
        ]

    def _register(self, k: int, optimizer: torch.optim.Optimizer) -> int:
        client = self.clients[k]
        status = client.request("POST", "/v1/register", params={"worker": self.rank}).json()
        if self.consistency is not None and status["consistency"] != self.consistency:
            raise RuntimeError(
                f"the parameter server at {client.url} applies {status['consistency']!r}, but this "
                f"job is set to {self.consistency!r}: give the workers the servers' --consistency"
            )
        if not status["initialized"] and self.rank == 0:
            names = {id(p): n for n, p in self.params.items()}
            spec = describe_optimizer(optimizer, names)
            mine = {n: self.params[n].detach() for n in self.placement[k]}
            body = encode_tensors(mine, {"optimizer": json.dumps(spec)})
            client.request("POST", "/v1/init", params={"worker": self.rank}, content=body)
        self.generations[k] = status["generation"]
        return int(status["clock"])

    def _step_query(self, k: int, step: int, claim: tuple[int, int, int] | None) -> dict[str, Any]:
        query = {
            "worker": self.rank,
            "step": step,
            "version": self.versions[k],
            "wait_s": LONG_POLL_S,
            "generation": self.generations[k],
        }
        if k == 0 and claim is not None:
            epoch, position, batches = claim
            query |= {"claim_epoch": epoch, "claim_position": position, "claim_batches": batches}
        return query

    def _grads(self, k: int) -> dict[str, torch.Tensor]:
        grads = {}
        for name in self.placement[k]:
            p = self.params[name]
            grads[name] = p.grad if p.grad is not None else torch.zeros_like(p)
        return grads

    def pull(self) -> None:
        """Read every shard's parameters into the model, each once its rule allows."""
        start = time.perf_counter()
        self._waited([self._pull(k) for k in range(len(self.clients))], start)

    def _waited(self, waited: list[float], start: float) -> None:
        self.wait_s = max(waited)
        self.accounting.add_sync_wait(min(self.wait_s, time.perf_counter() - start))

    def _pull(self, k: int) -> float:
        """Read shard k's parameters once the rule lets this worker (a long poll, asked again
        each time it ends unanswered); the seconds the rule held it."""
        query = {
            "worker": self.rank,
            "min_version": self.read_versions[k],
            "wait_s": LONG_POLL_S,
            "generation": self.generations[k],
        }
        waited = 0.0
        while True:
            start = time.perf_counter()
            answer = self.clients[k].request(
                "GET", "/v1/params", params=query, ok=(NOT_YET,), into=self._buffers[k]
            )
            if answer.status != NOT_YET:
                return waited + self._take(k, answer)
            waited += time.perf_counter() - start

    def _take(self, k: int, answer: Answer) -> float:
        """Copy shard k's parameters from its answer into the model; the seconds the rule held
        this worker on the shard."""
        tensors, _ = decode_tensors(answer.content)  # views of the answer's buffer
        with torch.no_grad():
            for name, value in tensors.items():
                self.params[name].copy_(value)
        self.versions[k] = int(answer.headers["X-Version"])
        generation = answer.headers["X-Generation"]
        if generation != self.generations[k]:  # the shard restarted from a snapshot
            self.generations[k] = generation
            self.read_versions[k] = self.versions[k]
        self.accounting.add_comm("ps_pull", len(answer.content), len(answer.content))
        return float(answer.headers.get("X-Wait-S", 0.0))

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            for client in self.clients:
                try:
                    client.request("POST", "/v1/heartbeat", params={"worker": self.rank})
                except ServiceError:
                    pass  # the shard is restarting: the next push or pull retries it

    def save_checkpoint(
        self,
        directory: Path,
        step: int,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, torch.Tensor],
    ) -> Path:
        """The servers hold the state: each writes its snapshot now."""
        return self.snapshot()[0].parent

    def load_checkpoint(
        self,
        path: Path | None,
        directory: Path,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, torch.Tensor],
        loaders: Sequence[ShardedLoader],
    ) -> dict[str, torch.Tensor] | None:
        """Resume from the servers: the step is this worker's clock there, and loaders of fixed
        shards move past the batches of the steps it already pushed (loaders that claim batches
        need not: the servers hand out only what is left)."""
        step = self.start_step
        if step == 0:
            return None
        restored = {"step": torch.tensor(step)}
        for i, loader in enumerate(loaders):
            if isinstance(loader.sampler, ClaimedBatchSampler):
                continue  # the servers know the epoch: those used up answer "none" at once
            per_epoch = max(len(loader), 1)
            restored[f"loader{i}"] = torch.tensor([step // per_epoch, step % per_epoch])
        return restored

    def finish(self) -> None:
        self.finalize()

    def finalize(self) -> None:
        """Tell every shard this worker is done, wait until all workers are, and read the final
        parameters (under ASP the others may still be pushing until then)."""
        if self.finished:
            return
        self.finished = True
        self._stop.set()
        self._exchange("POST", "/v1/done", lambda k: {"worker": self.rank})
        for client in self.clients:
            while not client.request("GET", "/v1/status").json()["finished"]:
                time.sleep(0.05)
        self.read_versions = [0] * len(self.clients)
        for k in range(len(self.clients)):
            self._pull(k)

    def snapshot(self) -> list[Path]:
        """Have every shard write its snapshot now; their paths (on the servers' machines)."""
        answers = self._exchange("POST", "/v1/snapshot", lambda k: {})
        return [Path(a.json()["path"]) for a in answers]

    def stats(self) -> list[dict[str, Any]]:
        return [a.json() for a in self._exchange("GET", "/v1/stats", lambda k: {})]

    def close(self) -> None:
        self._stop.set()
        for client in self.clients:
            client.close()
