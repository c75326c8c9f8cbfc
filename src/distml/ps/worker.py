"""The worker's side of a parameter server: the training strategy of ``--strategy ps``.

After backward, the worker pushes its gradients to every shard (in parallel, one connection per
shard), then pulls the parameters back as soon as the consistency rule lets it, and copies them
into its model. The local optimizer never steps: the servers own the optimizer state, write the
checkpoints (their snapshots) and tell a restarted worker where it resumes. Under ASP and SSP the
worker's data loader claims its batches from the first shard, one at a time.

The workers share no process group: each is a world of one, and the job that started them with
their shards (:mod:`distml.jobs.ps`) gathers their records.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distml.config import RunConfig
from distml.data.loader import ShardedLoader
from distml.data.sampler import ClaimedBatchSampler
from distml.net import (
    ServiceClient,
    ServiceError,
    decode_tensors,
    encode_tensors,
    token_from_env,
)
from distml.parallel.strategy import StrategyEnv, TrainingStrategy
from distml.ps.optimizer_spec import describe_optimizer
from distml.ps.placement import place_parameters

NOT_YET = 425  # the shard's answer while the consistency rule makes a reader wait
SERVERS_ENV = "DISTML_PS_SERVERS"


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
        self.clients = [ServiceClient(u, token) for u in urls]
        self._pool = ThreadPoolExecutor(len(urls), thread_name_prefix="ps-shard")
        self.read_versions = [0] * len(urls)
        self.versions = [0] * len(urls)
        self.generations = [""] * len(urls)
        self.wait_s = 0.0  # of the last step: time the consistency rule held this worker
        self.finished = False
        self.consistency = consistency  # the rule this worker's data loading expects, if known
        clocks = self._each(lambda k: self._register(k, optimizer))
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
        """Push this step's gradients, pull the next parameters (the servers step the
        optimizer). Returns the seconds spent."""
        start = time.perf_counter()
        self._each(lambda k: self._push(k, step))
        for p in self.params.values():
            p.grad = None
        self.pull()
        return time.perf_counter() - start

    def claim(self, epoch: int, position: int, batches: int) -> int | None:
        """The next unclaimed batch of ``epoch`` (ASP and SSP: the first shard hands them out);
        ``position``: this worker's claims of the epoch so far, so that a retry is known."""
        query = {"worker": self.rank, "epoch": epoch, "position": position, "batches": batches}
        return self.clients[0].request("POST", "/v1/claim", params=query).json()["batch"]

    # -- the protocol -----------------------------------------------------------------------
    def _each(self, fn) -> list[Any]:
        return list(self._pool.map(fn, range(len(self.clients))))

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

    def _push(self, k: int, step: int) -> None:
        grads = {}
        for name in self.placement[k]:
            p = self.params[name]
            grads[name] = p.grad if p.grad is not None else torch.zeros_like(p)
        body = encode_tensors(grads)
        query = {"worker": self.rank, "step": step, "version": self.versions[k]}
        answer = self.clients[k].request("POST", "/v1/push", params=query, content=body).json()
        self.read_versions[k] = int(answer["read_version"])
        self.accounting.add_comm("ps_push", len(body), len(body))

    def pull(self) -> None:
        """Read every shard's parameters into the model, each once its rule allows."""
        start = time.perf_counter()
        waited = self._each(self._pull)
        self.wait_s = max(waited)
        self.accounting.add_sync_wait(min(self.wait_s, time.perf_counter() - start))

    def _pull(self, k: int) -> float:
        client = self.clients[k]
        query = {
            "worker": self.rank,
            "min_version": self.read_versions[k],
            "wait_s": 5.0,
            "generation": self.generations[k],
        }
        waited = 0.0
        while True:
            start = time.perf_counter()
            try:
                response = client.request("GET", "/v1/params", params=query)
                break
            except ServiceError as exc:
                if exc.status != NOT_YET:
                    raise
            waited += time.perf_counter() - start
        tensors, _ = decode_tensors(response.content)
        with torch.no_grad():
            for name, value in tensors.items():
                self.params[name].copy_(value)
        self.versions[k] = int(response.headers["X-Version"])
        generation = response.headers["X-Generation"]
        if generation != self.generations[k]:  # the shard restarted from a snapshot
            self.generations[k] = generation
            self.read_versions[k] = self.versions[k]
        self.accounting.add_comm("ps_pull", len(response.content), len(response.content))
        return waited + float(response.headers.get("X-Wait-S", 0.0))

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
        self._each(
            lambda k: self.clients[k].request("POST", "/v1/done", params={"worker": self.rank})
        )
        for client in self.clients:
            while not client.request("GET", "/v1/status").json()["finished"]:
                time.sleep(0.05)
        self.read_versions = [0] * len(self.clients)
        self._each(self._pull)

    def snapshot(self) -> list[Path]:
        """Have every shard write its snapshot now; their paths (on the servers' machines)."""
        answers = self._each(lambda k: self.clients[k].request("POST", "/v1/snapshot").json())
        return [Path(a["path"]) for a in answers]

    def stats(self) -> list[dict[str, Any]]:
        return self._each(lambda k: self.clients[k].request("GET", "/v1/stats").json())

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown()
        for client in self.clients:
            client.close()
