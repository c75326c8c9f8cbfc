"""Inside one worker process: the Context and accounted collectives.

``Context`` is imported on first use (PEP 562): the collectives' helpers are imported by
modules that the Context itself imports, and must not pull the Context in with them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distml._lazy import lazy_getattr

if TYPE_CHECKING:
    from distml.runtime.context import Context

__getattr__ = lazy_getattr("distml.runtime", {"Context": "distml.runtime.context:Context"})

__all__ = ["Context"]
