"""The shared secret of a distml service, read from the environment."""

from __future__ import annotations

import os

TOKEN_ENV = "DISTML_TOKEN"


def token_from_env(env: str = TOKEN_ENV) -> str:
    """The service token from the environment (never from the command line, where ``ps`` shows
    it to every user of the machine)."""
    token = os.environ.get(env, "")
    if len(token) < 16:
        raise ValueError(f"set {env} to a token of at least 16 characters")
    return token
