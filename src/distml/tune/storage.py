"""Where a study lives: an Optuna ``RDBStorage`` in SQLite (the default) or PostgreSQL.

Every worker process, on this host or another, opens its own ``RDBStorage`` on the same URL:
that is Optuna's documented way to share a study. The database, not any process, holds the
state, so a job that was killed resumes from what the database says.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import optuna

from distml.config import ConfigError

# SQLAlchemy's URL helpers are imported where a URL is checked (optuna imports SQLAlchemy
# lazily itself).

DEFAULT_STORAGE = "sqlite:///study.db"
HEARTBEAT_S = 10
# A trial whose heartbeat is older than GRACE_FACTOR heartbeats belongs to a dead worker.
# Optuna's default is 2; 3 leaves room for a heartbeat delayed behind a busy SQLite lock.
GRACE_FACTOR = 3
# A trial that kills its worker (out of memory, say) is retried this often, then left failed.
MAX_RETRY = 3
# SQLite allows one writer at a time; the others wait this long for the lock instead of
# failing at once with "database is locked" (Optuna's docs pass connect_args={"timeout": ...}).
SQLITE_TIMEOUT_S = 60.0


def check_storage_url(url: str) -> str:
    """Refuse, before anything starts, a URL that no worker could open; returns it unchanged.

    >>> check_storage_url("sqlite:///study.db")
    'sqlite:///study.db'
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    example = "sqlite:///study.db or postgresql+psycopg://USER@HOST:PORT/DB"
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ConfigError(f"{url!r} is not a database URL; use {example}") from None
    try:
        dialect = parsed.get_dialect()
    except NoSuchModuleError:
        unknown = f"{url!r}: unknown database {parsed.drivername!r}"
        raise ConfigError(f"{unknown}; use {example}") from None
    shown = parsed.render_as_string(hide_password=True)
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise ConfigError(
            f"{shown}: the database driver is not installed ({exc}); "
            "for PostgreSQL: pip install 'distml[postgres]'"
        ) from None
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:") or database.startswith("file::memory:"):
            raise ConfigError(f"{shown}: workers cannot share an in-memory SQLite; name a file")
        if not Path(database).parent.is_dir():
            raise ConfigError(f"{shown}: no such directory {str(Path(database).parent)!r}")
    return url


def _engine_kwargs(url: str) -> dict[str, Any]:
    from sqlalchemy.engine import make_url

    if make_url(url).get_backend_name() == "sqlite":
        return {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    # A server may drop idle connections between two trials of a long study.
    return {"pool_pre_ping": True}


def open_storage(url: str, heartbeat_s: int | None = None) -> optuna.storages.RDBStorage:
    """An ``RDBStorage`` on ``url``; with ``heartbeat_s``, the one a worker runs trials on.

    A running trial's heartbeat is written every ``heartbeat_s`` seconds. A trial whose heartbeat
    is more than ``GRACE_FACTOR`` x ``heartbeat_s`` old was left RUNNING by a dead process: the
    next worker to start a trial fails it and queues a copy with the same parameters
    (``RetryHeartbeatStaleTrialCallback``; Optuna 4.9 renamed it from ``RetryFailedTrialCallback``
    and ``failed_trial_callback`` to ``heartbeat_stale_trial_callback``).
    """
    if heartbeat_s is None:
        return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url))
    with warnings.catch_warnings():
        # Marked experimental since Optuna 2.8; the warnings would repeat in every worker.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(
            url,
            engine_kwargs=_engine_kwargs(url),
            heartbeat_interval=heartbeat_s,
            grace_period=GRACE_FACTOR * heartbeat_s,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                max_retry=MAX_RETRY
            ),
        )
