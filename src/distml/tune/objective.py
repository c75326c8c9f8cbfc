"""The user's objective, named by an import path (:mod:`distml.user_code`): every tuning worker
imports it itself."""

from __future__ import annotations

import sys
from collections.abc import Callable

import optuna

from distml.config import ConfigError
from distml.user_code import FILE_MODULE, UserCodeError, import_function

Objective = Callable[[optuna.Trial], float]


def objective_spec(objective: str | Objective) -> str:
    """The import path of ``objective``; a string is taken as one already.

    A function of the script being run (``__main__``), or of a file that :func:`load_objective`
    imported, is named by its file, which the workers import under another name (keep a
    script's work under ``if __name__ == "__main__"``).

    >>> import math; objective_spec(math.sqrt)
    'math:sqrt'
    """
    if isinstance(objective, str):
        return objective
    module = getattr(objective, "__module__", None)
    qualname = getattr(objective, "__qualname__", "")
    if module is None or not qualname or "<" in qualname:
        raise ConfigError(
            f"objective {objective!r} must be a module-level function: workers import it by name"
        )
    if module == "__main__" or module.startswith(FILE_MODULE):
        path = getattr(sys.modules[module], "__file__", None)
        if path is None:
            raise ConfigError("an objective defined interactively cannot be imported by workers")
        return f"{path}:{qualname}"
    return f"{module}:{qualname}"


def load_objective(spec: str) -> Objective:
    """Import ``module:function`` or ``file.py:function``; a ConfigError says what is wrong.

    >>> load_objective("math:sqrt")(4.0)
    2.0
    """
    try:
        return import_function(spec, "objective")
    except UserCodeError as exc:
        raise ConfigError(str(exc)) from exc.__cause__
