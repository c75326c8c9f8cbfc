"""The shared secret of a distml service, read from the environment, or made on the spot for a
service that only this machine can reach; and the bearer tokens a service takes."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
from collections.abc import Mapping

TOKEN_ENV = "DISTML_TOKEN"


def token_from_env(env: str = TOKEN_ENV) -> str:
    """The service token from the environment (never from the command line, where ``ps`` shows
    it to every user of the machine)."""
    token = os.environ.get(env, "")
    if len(token) < 16:
        raise ValueError(f"set {env} to a token of at least 16 characters")
    return token


def is_loopback(host: str) -> bool:
    """Whether a service listening on ``host`` is reachable from this machine only. A name
    other than ``localhost`` counts as reachable from elsewhere: it may resolve to anything."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def service_token(*hosts: str, env: str = TOKEN_ENV) -> tuple[str, bool]:
    """The token of a service listening on ``hosts``, and whether it was made here.

    ``env`` when it is set. When it is not and every host is on the loopback, a new random
    token: a first run needs no setup, and the service still answers nobody without the token
    (other users of this machine reach the loopback too). Beyond the loopback the operator
    chooses the token; without one this raises ``ValueError``.

    >>> token, made = service_token("127.0.0.1")  # doctest: +SKIP
    """
    if os.environ.get(env):
        return token_from_env(env), False
    beyond = [host for host in hosts if not is_loopback(host)]
    if beyond:
        raise ValueError(
            f"set {env} to a token of at least 16 characters to listen on {beyond[0]}: beyond "
            "the loopback a service needs a token chosen by its operator (on 127.0.0.1 one is "
            "made for you)"
        )
    return secrets.token_urlsafe(24), True


class Tokens:
    """The bearer tokens a service takes: one shared token, or a mapping ``identity -> token``
    (one token per client). Looked up by their SHA-256, so that the lookup time says nothing
    about a guess's prefix."""

    def __init__(self, token: str | Mapping[str, str]):
        if isinstance(token, str):
            self._identities: dict[bytes, str | None] = {_digest(token): None}
        else:
            self._identities = {_digest(t): identity for identity, t in token.items()}
            if len(self._identities) < len(token):
                raise ValueError("two identities share one token")

    def identity(self, authorization: str | None) -> str | None:
        """Who sent ``authorization`` (an ``Authorization`` header's value): the identity of
        its token, ``None`` for a shared one. Raises :class:`Unauthorized` for anything else."""
        scheme, _, credentials = (authorization or "").partition(" ")
        digest = _digest(credentials.strip()) if scheme.lower() == "bearer" else b""
        if digest not in self._identities:
            raise Unauthorized
        return self._identities[digest]


class Unauthorized(Exception):
    """A request without a token the service knows."""

    detail = "missing or wrong bearer token"
    headers = {"WWW-Authenticate": "Bearer"}


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()
