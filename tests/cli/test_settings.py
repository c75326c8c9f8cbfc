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
        ({"rdzv_id": "job-7", "role": "trainer", "local_addr": "10.0.0.2"},
         ["rdzv_id=job-7", "role=trainer", "local_addr=10.0.0.2"]),
        ({"nnodes": "2", "rdzv_endpoint": "h:1", "node_rank": 1, "rdzv_backend": "static"},
         ["min_nodes=2", "max_nodes=2", "rdzv_endpoint=h:1", "node_rank=1",
          "rdzv_backend=static"]),
        ({"rdzv_conf": "join_timeout=60,is_host=true"},
         ["rdzv_conf={join_timeout = 60, is_host = true}"]),
        ({"rdzv_conf": "read_timeout=9,is_host=0"},
         ["rdzv_conf={read_timeout = '9', is_host = 0}"]),
        ({"log_dir": "logs", "redirects": "3", "tee": "0:1,1:2"},
         ["log_dir=logs", "redirects=3", "tee=0:1,1:2"]),
        ({"no_python": True, "run_path": True, "monitor_interval": 0.5},
         ["no_python=true", "run_path=true", "monitor_interval=0.5"]),
        ({"no_python": False}, []),  # a flag not given names no setting
        ({"signals_to_handle": "SIGTERM, SIGUSR1"}, ["signals_to_handle=SIGTERM,SIGUSR1"]),
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
        (["rdzv_conf={timout = 5}"], "unknown rendezvous option 'timout'; known: timeout"),
        (["rdzv_conf={join_timeout = 0}"], "join_timeout=0: expected whole seconds >= 1"),
        (["rdzv_conf={read_timeout = 'soon'}"], "read_timeout='soon': expected whole seconds"),
        (["rdzv_conf={is_host = 'maybe'}"], "is_host='maybe': expected true or false"),
        (["rdzv_backend=etcd"], "rdzv_backend"),
        (["redirects=4"], "redirects: '4': expected 0-3"),
        (["tee=0:1,1:7"], "tee: '0:1,1:7'"),
        (["signals_to_handle=SIGTERM,SIGFOO"], "'SIGFOO': not a signal name"),
        (["monitor_interval=0"], "monitor_interval"),
        (["rdzv_id=a/b"], "rdzv_id: use letters, digits"),
        (["role=two words"], "role"),
        (["max_nodes=2", "min_nodes=2", "rdzv_endpoint=h:1", "rdzv_backend=static"],
         "--rdzv-backend static needs --node-rank on every node"),
        (["max_nodes=2", "node_rank=0", "rdzv_endpoint=h:1", "rdzv_backend=static"],
         "--rdzv-backend static is a fixed world"),
    ],
)  # fmt: skip
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


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--rdzv_conf", "bogus=1"], {}, "unknown rendezvous option 'bogus'"),
        ([], {"PET_RDZV_CONF": "bogus=1"}, "unknown rendezvous option 'bogus'"),
        (["-r", "9"], {}, "redirects: '9'"),
        ([], {"PET_TEE": "x"}, "tee: 'x'"),
        (["--rdzv_backend", "etcd"], {}, "rdzv_backend"),
        ([], {"PET_RDZV_ID": "a b"}, "rdzv_id: use letters"),
        (["--signals_to_handle", "SIGNOPE"], {}, "'SIGNOPE': not a signal name"),
        (["--monitor_interval", "-1"], {}, "monitor_interval"),
        (["--no-python", "-m"], {}, "-m runs a module with python"),
        (["--run_path", "-m"], {}, "-m runs a module with python"),
        ([], {"PET_NO_PYTHON": "1"}, "--no-python: train.py is not an executable file"),
    ],
)
def test_torchruns_other_flags_and_variables_are_checked_before_anything_starts(
    tmp_path, monkeypatch, args, env, message
):
    """torchrun's spellings (``--rdzv_conf``, ``-r``...) and ``PET_*`` variables reach the
    same settings, refused with the setting named before any process starts."""
    (tmp_path / "train.py").write_text("raise SystemExit('never run')\n")  # not executable
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = distml_invoke("run", *args, "train.py", cwd=tmp_path)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())
