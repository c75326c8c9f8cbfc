"""The worker's side of a parameter server: the strategy object ``Context`` drives under
``--strategy ps``.

After backward, the worker pushes its gradients to every shard (in parallel, one connection per
shard), then pulls the parameters back as soon as the consistency rule lets it, and copies them
into its model. The local optimizer never steps: the servers own the optimizer state. Under ASP
and SSP the worker's data loader claims its batches from the first shard, one at a time.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distml.net import (
    ServiceClient,
    ServiceError,
    decode_tensors,
    encode_tensors,
    token_from_env,
)
from distml.parallel.data import Accounting
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


class ParameterServerWorker:
    """Worker ``rank`` of a parameter-server job whose shards listen at ``urls``.

    Every worker computes the same placement of the model's parameters over the shards; worker 0
    sends the initial parameters and the optimizer's description (each shard keeps the first it
    gets, so a restarted worker 0 changes nothing). With ``consistency``, a shard that applies
    another rule is refused: the worker's data loader depends on it (claimed batches or fixed
    shards).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        rank: int,
        urls: list[str],
        token: str,
        accounting: Accounting,
        heartbeat_s: float = 2.0,
        consistency: str | None = None,
    ):
        self.model = model
        self.rank = rank
        self.accounting = accounting
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

    # -- the strategy interface Context drives ---------------------------------------------
    def no_sync(self):
        return nullcontext()

    def after_backward(self) -> None:
        self.accounting.grads_ready()

    def after_optimizer_step(self) -> float:
        return 0.0

    def step(self, step: int) -> float:
        """Push this step's gradients, pull the next parameters. Returns the seconds spent."""
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
