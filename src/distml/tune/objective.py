"""The user's objective, named by an import path: code never travels between processes.

Every worker imports the objective itself, from ``package.module:function`` or
``path/to/file.py:function``, so a worker on another host needs the same code there, not a
pickle of it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import optuna

from distml.config import ConfigError

Objective = Callable[[optuna.Trial], float]
FILE_MODULE = "_distml_objective_"  # prefix of the modules imported from a file path


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

    A module is looked up from the working directory too, as ``python -m`` would.

    >>> load_objective("math:sqrt")(4.0)
    2.0
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"objective {spec!r} is not MODULE:FUNCTION or FILE.py:FUNCTION")
    try:
        module = _import_file(Path(where)) if where.endswith(".py") else _import_module(where)
    except ConfigError:
        raise
    except Exception as exc:  # the user's module failed while importing: pass its own words on
        raise ConfigError(f"cannot import objective {spec!r}: {type(exc).__name__}: {exc}") from exc
    target: object = module
    for part in name.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"objective {spec!r}: {where} has no {name!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"objective {spec!r} is not callable")
    return target  # type: ignore[return-value]


def _import_module(name: str) -> ModuleType:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(name)


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise ConfigError(f"no such objective file: {path}")
    resolved = path.resolve()
    # One module per file, under a name no other import can take.
    name = FILE_MODULE + hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
