"""Processes a distml process starts and watches itself: serving's replicas, preprocessing's
workers, a parameter-server job's shards and workers. Each is started so that it dies with its
supervisor, and its output goes to a log of its own.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from distml.net.ports import LISTEN_FD_ENV

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: a child gets SIGTERM when the process supervising it dies, even by SIGKILL, so
    none outlives its deployment or job. (The kernel watches the thread that started the child:
    start and restart children from a thread that lives as long as they should.)"""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(eq=False)
class ChildProcess:
    """A process this one supervises: output appended to ``log``, its exit codes and restarts
    kept for the supervisor's policy."""

    log: Path
    popen: subprocess.Popen | None = None
    restarts: int = 0
    exits: list[int] = field(default_factory=list)
    listen: list[socket.socket] = field(default_factory=list)  # a service's ports, until it starts

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        inherit_output: bool = False,
    ) -> None:
        """Start an incarnation; with ``inherit_output`` it writes to this process's terminal
        instead of the log. The first incarnation of a service is handed ``listen``, bound
        sockets to serve on (:data:`distml.net.ports.LISTEN_FD_ENV`), which this process then
        closes: the child owns its ports from the moment they were chosen, and a restarted one
        binds them again."""
        listen, self.listen = self.listen, []
        fds = tuple(sock.fileno() for sock in listen)
        if fds:
            env = {**env, LISTEN_FD_ENV: ",".join(map(str, fds))}
        try:
            if inherit_output:
                self.popen = subprocess.Popen(
                    argv, env=env, pass_fds=fds, preexec_fn=_die_with_parent
                )
                return
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log, "ab") as out:
                self.popen = subprocess.Popen(
                    argv, env=env, stdout=out, stderr=out, pass_fds=fds, preexec_fn=_die_with_parent
                )
        finally:
            for sock in listen:
                sock.close()

    def poll(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").rstrip().splitlines()[-lines:])
        except OSError:
            return ""


def stop_all(processes: Iterable[ChildProcess], timeout_s: float) -> None:
    """SIGTERM every live process, then SIGKILL those still running ``timeout_s`` later."""
    live = [p.popen for p in processes if p.popen is not None and p.popen.poll() is None]
    for popen in live:
        popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for popen in live:
        try:
            popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
