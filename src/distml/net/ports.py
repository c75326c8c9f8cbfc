"""Ports for the services and rendezvous that distml starts on this machine.

A port chosen free and bound later can be taken in between by any other process (a busy machine
starting many services loses that race now and then). Where distml starts a service in a child
process, it binds the port first and hands the bound socket over (:func:`listening_socket`,
:data:`LISTEN_FD_ENV`); only a rendezvous, whose store torch binds itself, takes a port by
number (:func:`free_port`).
"""

from __future__ import annotations

import os
import socket

LISTEN_FD_ENV = "DISTML_LISTEN_FD"
"""In a service's environment: the descriptors (comma-separated) of the listening sockets it
serves on, inherited from the process that started it, in place of binding them itself."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening_socket(
    host: str = "127.0.0.1", port: int = 0, *, reuse_port: bool = False
) -> socket.socket:
    """A TCP socket bound to ``host:port`` (a free port for 0) and listening, to serve on here
    or to hand to a child process. With ``reuse_port`` (``SO_REUSEPORT``), every process that
    binds the same port so shares it, and the kernel spreads new connections over them."""
    sock = socket.create_server((host, port), backlog=2048, reuse_port=reuse_port)
    sock.set_inheritable(True)
    return sock


def inherited_sockets() -> list[socket.socket]:
    """The listening sockets this process was handed (:data:`LISTEN_FD_ENV`); the variable is
    cleared, so that this process's own children do not take them for theirs."""
    fds = os.environ.pop(LISTEN_FD_ENV, "")
    return [socket.socket(fileno=int(fd)) for fd in fds.split(",") if fd]
