"""Where the nodes of a run meet, and the rendezvous id they agree on before torch's agent starts.

torch's rendezvous keys all its state by the id: two nodes started with different ids never
meet, and each waits out its rendezvous timeout to fail with a store error that names neither
id. Both of torch's backends keep that state in a multi-tenant ``TCPStore`` on the rendezvous
endpoint, so this node opens one there before the agent starts (on the node that hosts it, the
agent's store then shares its server) and agrees on the id through it: the first node's id is
the run's, a node with another one is refused at once, and the nodes waiting for it are told.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from torch.distributed import DistError, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousTimeoutError,
)

from distml.config import ConfigError, RunConfig, parse_endpoint
from distml.net.ports import free_port

# torch's defaults: the c10d backend's join and read timeouts (seconds)
_C10D_JOIN_TIMEOUT_S = 600
_C10D_READ_TIMEOUT_S = 60
# How long a refused node that hosts the store keeps it up for the waiting nodes to read why
_TELL_WAITING_S = 10.0
_POLL_S = 0.05


@dataclass(frozen=True)
class Rendezvous:
    """One attempt's rendezvous, as torch's agent takes it."""

    backend: str  # c10d or static
    endpoint: str
    configs: dict[str, Any]
    name: str  # torch's run id: the rendezvous id and the attempt, a fresh rendezvous each

    @property
    def hosts_store(self) -> bool:
        if self.backend == "static":
            return self.configs["rank"] == 0
        return bool(self.configs.get("is_host"))

    @property
    def join_timeout_s(self) -> int:
        if self.backend == "static":
            return int(self.configs["timeout"])
        return int(self.configs.get("join_timeout", _C10D_JOIN_TIMEOUT_S))

    @property
    def store_timeout_s(self) -> int:
        if self.backend == "static":
            return int(self.configs["timeout"])
        return int(self.configs.get("read_timeout", _C10D_READ_TIMEOUT_S))


def rendezvous_id(config: RunConfig) -> str:
    """The id every node of the run shares: ``--rdzv-id``, else the run's name."""
    return config.rdzv_id or config.run_name


def same_host(addr: str, host: str) -> bool:
    """``addr`` (this node's) and ``host`` (the rendezvous endpoint's) name one address."""
    try:
        return socket.gethostbyname(addr) == socket.gethostbyname(host)
    except OSError:
        return False


def plan_rendezvous(config: RunConfig, attempt: int, local_addr: str) -> Rendezvous:
    """Attempt ``attempt``'s rendezvous: the backend ``--rdzv-backend`` names (static where a
    node rank is given, else c10d), the endpoint and torch's options for it."""
    configs: dict[str, Any] = {"timeout": int(max(config.timeout_s, 30)), **config.rdzv_conf}
    backend = config.rdzv_backend or ("static" if config.node_rank is not None else "c10d")
    if config.rdzv_endpoint is None:  # one node: a store of its own on a fresh port each attempt
        host, port = "127.0.0.1", free_port()
        endpoint = f"{host}:{port}"
    else:
        host, port = parse_endpoint(config.rdzv_endpoint)
        endpoint = config.rdzv_endpoint
    if backend == "static":
        # Node ranks are fixed; each attempt moves to the next port, for a fresh store.
        configs["rank"] = config.node_rank or 0
        if config.rdzv_endpoint is not None:
            endpoint = f"{host}:{port + attempt}"
    elif config.rdzv_endpoint is not None and "is_host" not in configs:
        configs["is_host"] = same_host(local_addr, host)
    return Rendezvous(backend, endpoint, configs, f"{rendezvous_id(config)}-attempt{attempt}")


def _open_store(rdzv: Rendezvous, is_host_given: bool) -> tuple[TCPStore, bool]:
    """A store on ``rdzv``'s endpoint, and whether this process hosts it."""
    host, port = parse_endpoint(rdzv.endpoint)
    timeout = timedelta(seconds=rdzv.store_timeout_s)
    try:
        try:
            store = TCPStore(
                host, port, is_master=rdzv.hosts_store, multi_tenant=True,
                wait_for_workers=False, timeout=timeout,
            )  # fmt: skip
            return store, rdzv.hosts_store
        except DistError:
            if not rdzv.hosts_store or rdzv.backend == "static" or is_host_given:
                raise
        # Another process of this machine hosts it (nodes on one machine, over the loopback):
        # join it, as torch's c10d backend does where it guessed that it was the host.
        return TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout), False
    except (DistError, TimeoutError) as exc:
        raise RendezvousConnectionError(
            f"cannot reach the rendezvous store at {rdzv.endpoint}: {exc}"
        ) from None


_SAME_ID = "give every node of a run the same --rdzv-id (or --run-name)"


def agree_on_id(store: TCPStore, rdzv: Rendezvous, rdzv_id: str, attempt: int, nodes: int) -> None:
    """Wait until ``nodes`` nodes have joined attempt ``attempt`` with the id ``rdzv_id``;
    ConfigError at once where the store holds another id, or a node with another one came."""
    key = f"distml/rdzv/attempt{attempt}/"
    held = store.compare_set(key + "id", "", rdzv_id).decode()
    if held != rdzv_id:
        store.set(key + "refused", rdzv_id)
        if rdzv.hosts_store:  # the waiting nodes read why from this process's store
            deadline = time.monotonic() + _TELL_WAITING_S
            while time.monotonic() < deadline and (
                store.add(key + "told", 0) < max(1, store.add(key + "joined", 0))
            ):
                time.sleep(_POLL_S)
        raise ConfigError(
            f"this node's rendezvous id {rdzv_id!r} differs from {held!r}, the id of the "
            f"nodes already at {rdzv.endpoint}: {_SAME_ID}"
        )
    store.add(key + "joined", 1)
    deadline = time.monotonic() + rdzv.join_timeout_s
    while (joined := store.add(key + "joined", 0)) < nodes:
        if store.check([key + "refused"]):
            theirs = store.get(key + "refused").decode()
            store.add(key + "told", 1)
            raise ConfigError(
                f"a node with rendezvous id {theirs!r} came to this node's rendezvous "
                f"{rdzv_id!r} at {rdzv.endpoint}, and was refused: {_SAME_ID}"
            )
        if time.monotonic() > deadline:
            raise RendezvousTimeoutError(
                f"{joined} of {nodes} nodes joined the rendezvous {rdzv_id!r} at "
                f"{rdzv.endpoint} within {rdzv.join_timeout_s} s"
            )
        time.sleep(_POLL_S)


class RendezvousStores:
    """The stores this node opened on the rendezvous endpoints of a run, kept open until the
    run ends: on the node that hosts one, its server then outlives each attempt's agent, for
    the nodes still at that attempt."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[TCPStore, bool]] = {}  # endpoint: the store, whether hosted

    def agree(self, config: RunConfig, rdzv: Rendezvous, attempt: int) -> Rendezvous:
        """``rdzv`` once every node has joined it with the run's rendezvous id (see the module),
        with whether this node hosts the store settled; ``rdzv`` itself for a run of one node."""
        if config.rdzv_endpoint is None:
            return rdzv
        if rdzv.endpoint not in self._open:
            self._open[rdzv.endpoint] = _open_store(rdzv, "is_host" in config.rdzv_conf)
        store, hosted = self._open[rdzv.endpoint]
        if rdzv.backend == "c10d":
            rdzv = replace(rdzv, configs={**rdzv.configs, "is_host": hosted})
        agree_on_id(store, rdzv, rendezvous_id(config), attempt, config.min_nodes)
        return rdzv

    def close(self) -> None:
        self._open.clear()
