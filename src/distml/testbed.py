"""Hosts joined by shaped links, on one Linux machine: a network testbed.

Each host is a network namespace with one interface, ``eth0``, whose peer sits on a bridge in a
namespace of its own (a switch). Each host's link is rate-limited in both directions with
``tc``'s token bucket filter: the host's egress on ``eth0``, and the switch's egress on the
host's port, each with a shallow queue (5 ms, as a switch port has). Up to ``PACED_BITS`` the
frames go one by one through a bucket of a few of them, so that after an idle spell nothing
passes faster than the rate, as on a link that serializes its frames. Processes run "on" a host
through ``ip netns exec``; they reach each other at the hosts' addresses, and nothing outside
the testbed's namespaces is ever addressed::

    with Testbed(hosts=2, rate="50mbit") as bed:
        bed.popen(bed.hosts[0], ["distml", "run", "--nnodes", "2", ...], log=...)

Only the rate is shaped. Latency would need ``netem``, which many kernels (and containers) lack;
the planner models latency instead. The hosts share this machine's cores: give each worker
:meth:`Testbed.threads_per_worker` threads so that all of them together use the cores once
(every worker defaulting to all the cores oversubscribes them many times, and the compute, not
the link, then decides the step).

Needs root, ``ip`` (with ``ip netns``) and ``tc``; :func:`unavailable` says why not. Whatever
the testbed made is removed when it closes, processes left inside included, even after an error.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}

# Up to this rate a link sends frame by frame, with a bucket of PACED_BURST_S: what comes after
# an idle stretch moves at the rate, as on a link that serializes every frame at it. With GSO's
# batches and the 4 ms bucket of faster links, tens of KB passed at once after the link idled,
# and the small collectives of PowerSGD and a pipeline's sends beat the rate (BENCHMARKS.md,
# slow links). Above it GSO stays on: one core sending single frames carried 64 MB/s of 1 Gbit/s.
PACED_BITS = 250e6
PACED_BURST_S = 0.001
MTU_FRAME = 1514  # bytes on the wire of a full Ethernet frame
GSO_MAX = 65536  # the kernel's default batch
_counter = itertools.count()


class TestbedError(RuntimeError):
    """A command that builds or drives the testbed failed."""

    __test__ = False  # a name pytest would otherwise collect


def rate_bits(rate: str | float) -> float:
    """Bits per second of a tc-style rate ("100mbit", "1gbit", "1.5mbit") or a number."""
    if isinstance(rate, int | float):
        if rate <= 0:
            raise ValueError(f"a link rate must be positive, got {rate}")
        return float(rate)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", rate.lower())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r}: expected a number and one of {', '.join(_UNITS)}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def unavailable() -> str | None:
    """Why a testbed cannot be built here (None when it can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2) on PATH"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"`ip netns` unavailable: {probe.stderr.strip()}"
    return None


@dataclass(frozen=True)
class Host:
    name: str  # its network namespace
    addr: str  # its address on the testbed's subnet
    port: str  # its port on the switch (an interface of the switch's namespace)


class Testbed:
    """``hosts`` namespaces on one switch, each link shaped to ``rate`` (None: unshaped)."""

    __test__ = False

    def __init__(
        self,
        hosts: int = 2,
        rate: str | float | None = None,
        *,
        subnet: str = "10.213.78",
        burst_s: float = 0.004,
        queue_s: float = 0.005,
    ):
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be 1..250, got {hosts}")
        self.rate_bits = None if rate is None else rate_bits(rate)
        # The bucket of a link faster than PACED_BITS, in seconds of its rate; slower links send
        # frame by frame through a bucket of PACED_BURST_S (see shape).
        self.burst_s = burst_s
        # The longest a packet may wait in a link's queue (tc's latency). A deep queue
        # (bufferbloat) stalls collectives that send in chunks and wait on each, while one TCP
        # stream fills the link with any (measured: BENCHMARKS.md, slow links).
        self.queue_s = queue_s
        tag = f"{os.getpid()}-{next(_counter)}"
        self.switch = f"dml-sw-{tag}"
        self.hosts = [
            Host(f"dml-h{i}-{tag}", f"{subnet}.{i + 1}", f"port{i}") for i in range(hosts)
        ]
        self.subnet = subnet
        self._made: list[str] = []

    # -- building and tearing down ----------------------------------------------------------
    def __enter__(self) -> Testbed:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        reason = unavailable()
        if reason is not None:
            raise TestbedError(reason)
        remove_stale()
        self._netns_add(self.switch)
        sw = ("ip", "-n", self.switch)
        _sh(*sw, "link", "set", "lo", "up")
        _sh(*sw, "link", "add", "br0", "type", "bridge")
        _sh(*sw, "link", "set", "br0", "up")
        for host in self.hosts:
            self._netns_add(host.name)
            # Made inside the host with its peer in the switch: the caller's namespace never
            # sees either end, and both go when the namespaces go.
            _sh("ip", "-n", host.name, "link", "add", "eth0", "type", "veth",
                "peer", "name", host.port, "netns", self.switch)  # fmt: skip
            _sh(*sw, "link", "set", host.port, "master", "br0")
            _sh(*sw, "link", "set", host.port, "up")
            _sh("ip", "-n", host.name, "link", "set", "lo", "up")
            _sh("ip", "-n", host.name, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _sh("ip", "-n", host.name, "link", "set", "eth0", "up")
        if self.rate_bits is not None:
            self.shape(self.rate_bits)

    def _netns_add(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._made.append(name)

    def close(self) -> None:
        """Stop what still runs inside, then remove every namespace (their links go with them)."""
        for name in reversed(self._made):
            kill_processes_in(name)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
        self._made.clear()

    # -- the links ----------------------------------------------------------------------------
    def shape(self, rate: str | float) -> None:
        """Set every host's link to ``rate`` each way (a token bucket; replaces any before)."""
        bits = rate_bits(rate)
        if bits <= PACED_BITS:
            # Frame by frame, as a link of this rate serializes them: no GSO batch for tbf to
            # pass at once, and a bucket of 1 ms, a few frames at the least.
            gso, burst = MTU_FRAME, max(int(bits / 8 * PACED_BURST_S), 4 * MTU_FRAME)
        else:
            # The bucket holds burst_s of traffic (at least the kernel's timer tick needs at high
            # rates) and a few full frames; tbf splits GSO batches (up to 64 KB) itself.
            gso, burst = GSO_MAX, max(int(bits / 8 * self.burst_s), 16_384)
        queue = f"{self.queue_s * 1e3:g}ms"
        args = ("root", "tbf", "rate", f"{bits:.0f}bit", "burst", str(burst), "latency", queue)
        for host in self.hosts:
            _sh("ip", "-n", host.name, "link", "set", "eth0", "gso_max_size", str(gso))
            _sh("ip", "-n", self.switch, "link", "set", host.port, "gso_max_size", str(gso))
            _sh("tc", "-n", host.name, "qdisc", "replace", "dev", "eth0", *args)
            _sh("tc", "-n", self.switch, "qdisc", "replace", "dev", host.port, *args)
        self.rate_bits = bits

    def link_rate_bytes(self) -> float | None:
        """Each link's shaped rate, bytes/s each way (None: unshaped)."""
        return None if self.rate_bits is None else self.rate_bits / 8

    # -- running on the hosts ---------------------------------------------------------------
    def threads_per_worker(self, workers: int) -> int:
        """Threads each of ``workers`` processes (on all hosts together) may use so that they
        share this machine's cores once."""
        return max(1, (os.cpu_count() or 1) // max(1, workers))

    def command(self, host: Host, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on ``host``."""
        return ["ip", "netns", "exec", host.name, *argv]

    def popen(
        self,
        host: Host,
        argv: Sequence[str],
        *,
        log: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in a session of its own, its output to ``log``."""
        with open(log, "wb") as out:
            return subprocess.Popen(
                self.command(host, argv), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=None if env is None else dict(env), cwd=cwd,
                start_new_session=True,
            )  # fmt: skip

    def run_everywhere(
        self,
        argv_of: Callable[[int, Host], Sequence[str]],
        *,
        logs: Path,
        timeout: float,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> dict[str, int | None]:
        """``argv_of(rank, host)`` on every host at once, each one's output in
        ``logs/<host>.log``; waits up to ``timeout`` seconds in all, then stops what still
        runs. Each host's exit code (None: stopped at the timeout)."""
        procs = {
            host.name: self.popen(
                host, argv_of(rank, host), log=logs / f"{host.name}.log", env=env, cwd=cwd
            )
            for rank, host in enumerate(self.hosts)
        }
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                codes[name] = None
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the workers go too
                proc.wait()
        return codes


_NAMESPACE = re.compile(r"dml-(?:sw|h\d+)-(\d+)-\d+")  # a testbed's, with its maker's pid


def remove_stale() -> list[str]:
    """Remove the namespaces of testbeds whose process is gone (killed before its teardown
    ran), with whatever still runs inside them; returns their names. A testbed of a process
    that still runs is left alone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    stale = []
    for name in (line.split()[0] for line in listed.stdout.splitlines() if line.strip()):
        match = _NAMESPACE.fullmatch(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            kill_processes_in(name)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
            stale.append(name)
    return stale


def kill_processes_in(netns: str, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, whatever runs inside ``netns`` (only what the testbed started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids(netns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _pids(netns):
            time.sleep(0.05)


def _pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def _sh(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise TestbedError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
