"""The user's code, named by an import path: ``package.module:function`` or
``path/to/file.py:function``. Code never travels between processes: every process that needs a
preprocessing transform or a tuning objective imports it itself, so a process on another host
needs the same code there, not a pickle of it.

Light to import (nothing but the standard library): a preprocessing worker loads it first.
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
from typing import Any

FILE_MODULE = "_distml_file_"  # prefix of the modules imported from a file path


class UserCodeError(ValueError):
    """The import path names nothing callable; the message says what is wrong, for the user."""


def import_function(spec: str, what: str = "function") -> Callable[..., Any]:
    """Import ``module:function`` or ``file.py:function`` (``what`` names it in errors:
    "transform", "objective"). Whatever is wrong -- no such file, a module that fails to import, no
    such function -- is a :class:`UserCodeError` with the module's own words.

    A module is looked up from the working directory too, as ``python -m`` would.

    >>> import_function("math:sqrt")(4.0)
    2.0
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise UserCodeError(f"{what} {spec!r} is not MODULE:FUNCTION or FILE.py:FUNCTION")
    if where.endswith(".py") and not Path(where).is_file():
        raise UserCodeError(f"no such {what} file: {where}")
    try:
        module = import_file(Path(where)) if where.endswith(".py") else _import_module(where)
    except Exception as exc:  # a SyntaxError, an ImportError, the module's own error: its words
        raise UserCodeError(f"cannot import {what} {spec!r}: {type(exc).__name__}: {exc}") from exc
    target: object = module
    for part in name.split("."):
        if not hasattr(target, part):
            raise UserCodeError(f"{what} {spec!r}: {where} has no function {name!r}")
        target = getattr(target, part)
    if not callable(target):
        raise UserCodeError(f"{what} {spec!r} is not callable")
    return target


def _import_module(name: str) -> ModuleType:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(name)


def import_file(path: Path) -> ModuleType:
    """The module of the Python file ``path``: one per file, under a name no other import takes
    (``FILE_MODULE`` + a hash of the path), imported once."""
    resolved = path.resolve()
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
