"""Every setting is declared once, in ``distml.config``: ``--set KEY=VALUE`` reaches it, with
its help and validation, and the short flags of ``distml run`` are names for settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomli_w
from pydantic import BaseModel

from conftest import distml_invoke
from distml.cli.main import ALIASES, assignments_of, resolve_run_config
from distml.config import ConfigError, parse_assignment, settings


def resolve(flags: dict, sets: list[str], config_file: Path | None = None):
    return resolve_run_config(config_file, assignments_of(flags, sets))


def test_every_setting_has_help_and_is_listed_by_run_help(tmp_path):
    keys = settings()
    assert {"nproc", "strategy.compression", "ps.servers", "parallel.tp_plan"} <= set(keys)
    assert all(info.description for info in keys.values()), "a setting without a docstring"
    text = " ".join(distml_invoke("run", "--help", cwd=tmp_path).stdout.split())
    missing = [key for key in keys if f"{key} (" not in text]
    assert not missing


def test_a_section_field_is_a_setting_with_nothing_else_written():
    class Section(BaseModel):
        knob: int = 3
        """A new knob."""

    class Whole(BaseModel):
        top: str = "x"
        section: Section | None = None

    assert list(settings(Whole)) == ["top", "section.knob"]


@pytest.mark.parametrize(
    "flags, sets",
    [
        ({"nproc": 3, "seed": 7}, ["nproc=3", "seed=7"]),
        ({"timeout": 9.5}, ["timeout_s=9.5"]),
        ({"nnodes": "1:4", "rdzv_endpoint": "h:29400"},
         ["min_nodes=1", "max_nodes=4", "rdzv_endpoint=h:29400"]),
        ({"strategy": "ddp:compression=fp16,grad_accum=2"},
         ["strategy.compression=fp16", "strategy.grad_accum=2"]),
        ({"strategy": "local-sgd:4"}, ["strategy.name=local-sgd", "strategy.sync_every=4"]),
        ({"nproc": 4, "mesh": "dp=2,tp=2"}, ["nproc=4", "mesh={dp = 2, tp = 2}"]),
        ({"nproc": 4, "mesh": "pp=4", "schedule": "gpipe", "microbatches": 8},
         ["nproc=4", "mesh={pp = 4}", "parallel.schedule=gpipe", "parallel.microbatches=8"]),
        ({"model": "layers=8,hidden=64"}, ["model.layers=8", "model.hidden=64"]),
        ({"nproc": 2, "simulate_straggler": "1:2.5"},
         ["nproc=2", "telemetry.simulate_straggler=[1, 2.5]"]),
        ({"nproc": 3, "strategy": "ps", "consistency": "ssp:2", "servers": 2},
         ["nproc=3", "strategy.name=ps", "ps.consistency=ssp", "ps.staleness=2", "ps.servers=2"]),
        ({"run_name": "007"}, ["run_name=007"]),
    ],
)  # fmt: skip
def test_a_flag_and_its_settings_give_the_same_config(flags, sets):
    assert set(flags) <= set(ALIASES)
    by_flags, by_sets = resolve(flags, []), resolve({}, sets)
    assert by_flags.model_dump(exclude={"run_name"}) == by_sets.model_dump(exclude={"run_name"})


def test_set_has_the_last_word_over_flags_and_the_config_file(tmp_path):
    config_file = tmp_path / "run.toml"
    config_file.write_text(tomli_w.dumps({"nproc": 2, "seed": 1, "strategy": {"grad_accum": 4}}))
    cfg = resolve({"seed": 2}, ["seed=3", "strategy.compression=bf16"], config_file)
    assert (cfg.nproc, cfg.seed) == (2, 3)
    assert (cfg.strategy.grad_accum, cfg.strategy.compression) == (4, "bf16")


def test_values_are_read_as_toml_where_the_setting_is_not_text():
    assert parse_assignment("parallel.split_points=['blocks.2']") == (
        "parallel.split_points",
        ["blocks.2"],
    )
    assert parse_assignment("parallel.sequence_parallel=true") == (
        "parallel.sequence_parallel",
        True,
    )
    assert parse_assignment("run_name=true") == ("run_name", "true")
    assert parse_assignment("strategy.compression=fp16") == ("strategy.compression", "fp16")


@pytest.mark.parametrize(
    "sets, message",
    [
        (["strategy.compresion=fp16"], "did you mean strategy.compression"),
        (["nproc"], "is not KEY=VALUE"),
        (["model.layers=0"], "model.layers"),
        (["strategy.compression=zip"], "strategy.compression"),
        (["plan={}"], "unknown setting 'plan'"),  # the planner's record is not a setting
    ],
)
def test_a_bad_setting_is_one_config_error_naming_it(sets, message):
    with pytest.raises(ConfigError, match=message):
        resolve({}, sets)


def test_the_command_line_refuses_a_bad_setting_before_anything_starts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never run')\n")
    result = distml_invoke("run", "--set", "ps.server=2", str(script), cwd=tmp_path)
    assert result.exit_code == 2
    assert "did you mean ps.servers" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--standalone", "--nnodes", "2"],
        ["--standalone", "--nnodes", "x"],
        ["--standalone", "--rdzv-endpoint", "h:1"],
        ["--standalone", "--master-addr", "h"],
    ],
)
def test_standalone_is_one_node(tmp_path, args):
    result = distml_invoke("run", *args, "train.py", cwd=tmp_path)
    assert result.exit_code == 2
    assert "--standalone is one node" in result.stderr
