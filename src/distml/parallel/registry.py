"""Training strategies by name: what ``--strategy NAME`` applies in every worker.

A name maps to its :class:`~distml.parallel.strategy.TrainingStrategy` class, or to
``"module:Class"``, imported on first use: a worker should not pay for the modules of strategies
it does not run (DTensor and the pipelining package, the web client of the parameter servers).
A new strategy is its own module and one line here; its name joins
:data:`distml.config.StrategyName`, where every setting is declared, so that configs accept it.

A mesh with ``fsdp``, ``tp`` or ``pp`` above 1 is laid out by :data:`LAYOUT`, whatever the name
(the config allows only ``ddp`` there: the layout's data dimension is all-reduced as DDP's is).

>>> from distml.config import RunConfig
>>> strategy_for(RunConfig()).__name__
'DataParallel'
"""

from __future__ import annotations

import importlib

from distml.config import ConfigError, RunConfig
from distml.layout import Layout
from distml.parallel.strategy import TrainingStrategy

STRATEGIES: dict[str, str | type[TrainingStrategy]] = {
    "ddp": "distml.parallel.data:DataParallel",
    "local-sgd": "distml.parallel.local_sgd:LocalSGD",
    "ps": "distml.ps.worker:ParameterServerWorker",
}

LAYOUT: str | type[TrainingStrategy] = "distml.parallel.layout:ModelParallel"


def strategy_for(config: RunConfig) -> type[TrainingStrategy]:
    """The strategy class that ``config`` (its strategy's name, and its mesh) applies."""
    if Layout(**(config.mesh or {})).model_parallel:
        return _resolve(LAYOUT)
    name = config.strategy.name
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; registered: {', '.join(sorted(STRATEGIES))}")
    return _resolve(STRATEGIES[name])


def _resolve(entry: str | type[TrainingStrategy]) -> type[TrainingStrategy]:
    if not isinstance(entry, str):
        return entry
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)
