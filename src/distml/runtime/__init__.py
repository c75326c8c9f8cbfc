"""Inside one worker process: the Context and accounted collectives."""

from distml.runtime.context import Context

__all__ = ["Context"]
