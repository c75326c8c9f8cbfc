"""The strategy protocol: the registry names the config's strategies, and a new strategy is one
module plus one registry line, run by the real launcher and Context like distml's own."""

from __future__ import annotations

from typing import Any

import pytest
from dp_oracle import BATCH, train_worker
from param_averaging import ParameterAveraging

import distml
from conftest import rel_err
from distml.config import STRATEGY_NAMES, RunConfig, build_config, config_from_env
from distml.jobs.strategy_jobs import JOBS, strategy_job
from distml.launch.elastic import run_workers
from distml.parallel.registry import STRATEGIES, strategy_for
from distml.parallel.strategy import TrainingStrategy
from distml.runtime.context import Context

STEPS = 8


def test_the_registry_names_every_strategy_the_config_accepts():
    assert set(STRATEGIES) == set(STRATEGY_NAMES)
    for name in STRATEGIES:
        config = RunConfig(strategy={"name": name})
        assert issubclass(strategy_for(config), TrainingStrategy)
    assert set(JOBS) <= set(STRATEGIES)
    assert strategy_job("ddp") is None and callable(strategy_job("ps"))


@pytest.mark.parametrize("mesh", [{"fsdp": 2}, {"tp": 2}, {"pp": 2}])
def test_a_mesh_that_splits_the_model_is_laid_out_whatever_the_name(mesh):
    assert strategy_for(RunConfig(nproc=2, mesh=mesh)).__name__ == "ModelParallel"


def train(ctx: distml.Context) -> dict[str, Any]:
    """Plain SGD (no momentum: the averaging oracle holds for it only) on each rank's shard."""
    return train_worker(ctx, STEPS, BATCH, momentum=0.0)


def train_param_averaging() -> dict[str, Any]:
    """In each worker: register the new strategy -- the one line a new strategy adds -- and run
    ``train`` under it. distml's own strategies are also listed in ``config.StrategyName``,
    which validates configs; this test-only one is set on the loaded config directly."""
    STRATEGIES["param-avg"] = ParameterAveraging
    config = config_from_env()
    strategy = config.strategy.model_copy(update={"name": "param-avg"})
    with Context.create(config.model_copy(update={"strategy": strategy})) as ctx:
        return train(ctx)


@pytest.mark.distributed
def test_a_new_strategy_is_one_module_and_one_registry_line(tmp_path):
    settings = dict(nproc=2, runs_dir=tmp_path, telemetry={"progress": False})
    ddp = distml.launch(train, run_name="ddp", **settings)
    config = build_config(run_name="param-avg", **settings)
    averaged = run_workers(config, train_param_averaging, ())[0]
    assert "param-avg" not in STRATEGIES  # registered in the workers only
    assert (ddp["wrapper"], averaged["wrapper"]) == ("DistributedDataParallel", "MLP")
    assert rel_err(averaged["params"], ddp["params"]) < 1e-6
    summary = averaged["summary"]
    assert summary["strategy"]["name"] == "param-avg" and summary["steps"] == STEPS
    assert summary["comm_bytes"] == ddp["summary"]["comm_bytes"]  # every parameter, every step
