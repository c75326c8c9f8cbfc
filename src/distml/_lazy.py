"""Names a package exports but imports on first use (PEP 562), so that importing the package
stays cheap for processes that need one corner of it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving ``name`` from ``where[name]``: ``"module"`` (the module
    itself) or ``"module:attribute"``."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = where[name].partition(":")
        value = importlib.import_module(module)
        return getattr(value, attribute) if attribute else value

    return __getattr__
