"""Start worker processes with torch's elastic agent, and restart them when one fails.

Restarts are done here, one fresh agent per attempt, rather than by the agent's own
``max_restarts``: with gloo, the agent's restart reuses one rendezvous store across attempts and
the restarted workers hang or are refused in ``connectFullMesh`` (pytorch issues 135712 and
167288). A fresh agent brings a fresh store (a new port on a single host, a new rendezvous on
the rendezvous endpoint across hosts), so a restart works for any script, torchrun scripts
included. The workers still see what torchrun's one agent would give them (restart count, most
restarts, rendezvous id, log folders), through the run's logs spec (:class:`RunLogsSpecs`).
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import runpy
import socket
import struct
import sys
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import LogsDest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.run import run_script_path

from distml.config import CONFIG_ENV, ConfigError, RunConfig, parse_endpoint, save_config
from distml.devices import gpu_share_error
from distml.launch.forkserver import start_fork_server
from distml.launch.rendezvous import (
    Rendezvous,
    RendezvousStores,
    plan_rendezvous,
    rendezvous_id,
)

ATTEMPT_ENV = "DISTML_ATTEMPT"
# A failed worker makes torch's agent log the failure, and a function's with a traceback that
# torch's log formatter renders by importing torch._dynamo (2.3 s here): LaunchError reports
# each failed rank with its cause instead, so the agent's own report is kept quiet.
_AGENT_FAILURE_LOG = logging.getLogger("torch.distributed.elastic.multiprocessing.api")


@dataclass
class WorkerFailure:
    rank: int
    exitcode: int
    message: str

    def __str__(self) -> str:
        return f"--- rank {self.rank} (exit code {self.exitcode}) ---\n{self.message}".rstrip()


class LaunchError(RuntimeError):
    """Workers failed on the last attempt. ``failures`` names each failed rank."""

    def __init__(self, failures: list[WorkerFailure], attempts: int):
        self.failures = failures
        self.attempts = attempts
        lines = [f"workers failed after {attempts} attempt(s):"]
        lines += [str(f) for f in failures]
        super().__init__("\n".join(lines))


def route_source_addr(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (a UDP connect sends no packet)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def interface_of(addr: str) -> str | None:
    """The name of the network interface that holds IPv4 address ``addr``, if any."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == addr:
                return name
    return None


def node_addressing(config: RunConfig) -> tuple[str, dict[str, str]]:
    """This node's address for the other nodes (``--local-addr``, else found here), and the
    environment gloo needs to use it.

    Left to itself, torch finds its own address by resolving the hostname, which on many machines
    (Debian's 127.0.1.1 entry, containers) names the loopback: peers are then told to connect to
    127.0.0.1. The address on the route to the rendezvous endpoint is the one peers can reach.
    """
    if config.rdzv_endpoint is None:
        return config.local_addr or "127.0.0.1", {}
    if config.local_addr is not None:
        addr = config.local_addr
    else:
        addr = route_source_addr(*parse_endpoint(config.rdzv_endpoint))
    env = {}
    try:
        ifname = interface_of(socket.gethostbyname(addr))
    except OSError:  # a name this node cannot resolve: gloo is left to find its interface
        ifname = None
    if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return addr, env


# Workers get 5 s between SIGTERM and SIGKILL when a run stops, where this torch lets the agent
# say so (older releases wait their own 30 s).
_SHUTDOWN = (
    {"shutdown_timeout": 5} if "shutdown_timeout" in {f.name for f in fields(LaunchConfig)} else {}
)


_LAUNCH_FIELDS = {f.name for f in fields(LaunchConfig)}
_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # torchrun's launcher sets it; its workers inherit


class RunLogsSpecs(DefaultLogsSpecs):
    """torch's logs spec for a whole run, which also gives the workers the run's values of
    torchrun's variables.

    Each attempt's fresh agent counts no restarts of its own and knows its attempt's rendezvous
    only; torchrun's one agent gives attempt k of a run ``TORCHELASTIC_RESTART_COUNT=k``, the
    most restarts and the rendezvous id. ``reify`` is where torch hands the logs spec the
    environment of each worker it is about to start, so the run's values (:attr:`run_env`) go
    in there; the folders it makes are then torchrun's too, one per run and one per attempt:
    ``<log_dir>/<rdzv_id>_<random>/attempt_<k>/<local_rank>/``.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run_env: dict[str, str] = {}

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        for env in envs.values():
            env.update(self.run_env)
        return super().reify(envs)


def logs_specs(config: RunConfig) -> RunLogsSpecs:
    """The run's logs spec: ``--log-dir`` (else the run folder's ``logs``), ``--redirects`` and
    ``--tee`` read by torch's own parser."""
    return RunLogsSpecs(
        log_dir=str((config.log_dir or config.run_dir / "logs").resolve()),
        redirects=Std.from_str(config.redirects),
        tee=Std.from_str(config.tee),
    )


def launch_config(
    config: RunConfig, rdzv: Rendezvous, local_addr: str, logs: RunLogsSpecs
) -> LaunchConfig:
    """The elastic agent's settings for one attempt of a run."""
    signals = {"signals_to_handle": config.signals_to_handle}
    return LaunchConfig(
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        nproc_per_node=config.nproc,
        run_id=rdzv.name,
        rdzv_backend=rdzv.backend,
        rdzv_endpoint=rdzv.endpoint,
        rdzv_configs=dict(rdzv.configs),
        max_restarts=0,  # this launcher restarts, with a fresh agent (see the module's docstring)
        role=config.role,
        monitor_interval=config.monitor_interval,
        # A function's workers fork from the preloaded fork server (distml.launch.forkserver),
        # a Python program's too (run_program); any other executable is exec'd.
        start_method="forkserver",
        local_addr=local_addr,
        logs_specs=logs,
        **(signals if "signals_to_handle" in _LAUNCH_FIELDS else {}),
        **_SHUTDOWN,
    )


# What torch's elastic agent sets in each worker (its rank, world, rendezvous), with every
# TORCHELASTIC_* (RunLogsSpecs gives those the run's values): these come from the agent; the
# rest of the worker's environment from this process's, as a spawned one has it.
_AGENT_VARS = {
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
}


def _in_launch_environment(environ: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in a forked worker under ``environ``, the launching process's
    environment when it launched (the fork server's is that of its own start), with the agent's
    variables kept, and torch's threads as ``OMP_NUM_THREADS`` says, as a new process reads it."""

    agent = {
        k: v for k, v in os.environ.items() if k in _AGENT_VARS or k.startswith("TORCHELASTIC_")
    }
    os.environ.clear()
    os.environ.update({**environ, **agent})
    if threads := os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(threads))
    return fn(*args)


def run_program(argv: list[str], cwd: str) -> None:
    """``python -u ARGV`` in this forked worker, from the working directory ``cwd``, as torchrun's
    ``--run-path`` runs a script (with torch's ``run_script_path``). ``ARGV`` is ``[script,
    *args]`` or ``["-m", module, *args]``; ``sys.path[0]`` is what the interpreter would have set,
    and the program's ``atexit`` functions run when it ends, as at an interpreter's exit.
    An uncaught exception is reported with its traceback, in the restart notice or LaunchError."""

    os.chdir(cwd)
    sys.stdout.reconfigure(line_buffering=True)  # the worker's output interleaves by lines
    atexit._clear()  # the fork server's own: not the program's to run
    try:
        if argv[0] == "-m":
            sys.path.insert(0, cwd)
            sys.argv = argv[1:]  # run_module puts the module's file in argv[0]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.realpath(argv[0])))
            run_script_path(*argv)
    finally:
        atexit._run_exitfuncs()  # a forked worker ends with os._exit, which runs none


@contextmanager
def _log_level(logger: logging.Logger, level: int) -> Iterator[None]:
    saved = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(saved)


@contextmanager
def _worker_env(values: dict[str, str]) -> Iterator[None]:
    """Workers inherit the agent's environment; set ours for the duration of a launch."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _failures(err: ChildFailedError) -> list[WorkerFailure]:
    out = []
    for rank, failure in sorted(err.failures.items()):
        message = failure.message
        if isinstance(message, dict):
            info = message.get("extraInfo", {})
            message = info.get("py_callstack") or message.get("message") or str(message)
        out.append(WorkerFailure(rank=rank, exitcode=failure.exitcode, message=str(message)))
    return out


def worker_threads(nproc: int) -> int:
    """The threads each of ``nproc`` workers on this node computes on: ``OMP_NUM_THREADS`` where
    it is set; otherwise, as torchrun sets it but sharing the cores rather than taking one each
    (N workers with torch's default of one thread per core would oversubscribe the CPU N times),
    cores / nproc."""
    if (threads := os.environ.get("OMP_NUM_THREADS", "")).isdigit():
        return max(1, int(threads))
    return max(1, (os.cpu_count() or 1) // nproc)


def run_workers(
    config: RunConfig, entrypoint: Callable[..., Any] | str, args: tuple[Any, ...]
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in every worker, restarting up to ``config.max_restarts`` times.

    ``entrypoint`` is a picklable function or an executable path. Returns the workers' return
    values on this node, by global rank. Raises ConfigError, before any process starts, when
    the node has GPUs but fewer than ``config.nproc``, or when another node of the rendezvous
    has another rendezvous id.
    """
    if error := gpu_share_error(config.nproc):
        raise ConfigError(error)
    config_path = config.run_dir / "config.toml"
    save_config(config, config_path)
    local_addr, worker_env = node_addressing(config)
    if "OMP_NUM_THREADS" not in os.environ:
        worker_env["OMP_NUM_THREADS"] = str(worker_threads(config.nproc))
    worker_env[_SIGNALS_ENV] = config.signals_to_handle
    if callable(entrypoint):
        start_fork_server()
    logs = logs_specs(config)
    last: list[WorkerFailure] = []
    with closing(RendezvousStores()) as stores:
        for attempt in range(config.max_restarts + 1):
            env = {CONFIG_ENV: str(config_path.resolve()), ATTEMPT_ENV: str(attempt), **worker_env}
            try:
                return _attempt(config, attempt, entrypoint, args, local_addr, stores, logs, env)
            except ChildFailedError as err:
                last = _failures(err)
            ranks = ", ".join(str(f.rank) for f in last)
            if attempt < config.max_restarts:
                causes = "\n".join(str(f) for f in last)
                print(
                    f"distml: rank(s) {ranks} failed on attempt {attempt}; restarting "
                    f"({attempt + 1}/{config.max_restarts})\n{causes}",
                    file=sys.stderr,
                )
    raise LaunchError(last, config.max_restarts + 1)


def _attempt(
    config: RunConfig,
    attempt: int,
    entrypoint: Callable[..., Any] | str,
    args: tuple[Any, ...],
    local_addr: str,
    stores: RendezvousStores,
    logs: RunLogsSpecs,
    env: dict[str, str],
) -> dict[int, Any]:
    """One attempt of a run: a fresh agent, once the nodes agree on the rendezvous id."""
    logs.run_env = {
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_RUN_ID": rendezvous_id(config),
    }
    with _worker_env(env):
        if callable(entrypoint):
            target, target_args = _in_launch_environment, (dict(os.environ), entrypoint, *args)
        else:
            target, target_args = entrypoint, args
        rdzv = stores.agree(config, plan_rendezvous(config, attempt, local_addr), attempt)
        agent = launch_config(config, rdzv, local_addr, logs)
        with _log_level(_AGENT_FAILURE_LOG, logging.CRITICAL):
            return elastic_launch(agent, target)(*target_args)
