"""Run configuration: parsing, validation, round trip through TOML."""

from __future__ import annotations

import pytest

from distml.config import (
    ConfigError,
    build_config,
    load_config,
    parse_mesh,
    parse_nnodes,
    parse_strategy,
    save_config,
)


def test_parsers():
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:4") == (1, 4)
    assert parse_mesh("dp=2,tp=2") == {"dp": 2, "tp": 2}
    assert parse_strategy("ddp:compression=fp16,grad_accum=2") == {
        "name": "ddp",
        "compression": "fp16",
        "grad_accum": "2",
    }
    for bad in ("x", "1:", ":2"):
        with pytest.raises(ConfigError):
            parse_nnodes(bad)
    with pytest.raises(ConfigError, match="given twice"):
        parse_mesh("dp=2,dp=2")


def test_toml_round_trip(tmp_path):
    cfg = build_config(
        nproc=4,
        run_name="x",
        strategy={"compression": "powersgd"},
        telemetry={"simulate_straggler": (1, 2.0)},
        mesh={"dp": 4},
    )
    save_config(cfg, tmp_path / "c.toml")
    assert load_config(tmp_path / "c.toml") == cfg


def test_errors_name_the_field_and_the_numbers():
    with pytest.raises(ConfigError, match=r"mesh dp=8 = 8 processes, but the world size is 4"):
        build_config(nproc=4, mesh={"dp": 8})
    with pytest.raises(ConfigError, match="strategy.grad_accum"):
        build_config(strategy={"grad_accum": 0})
    with pytest.raises(ConfigError, match="unknown_field"):
        build_config(unknown_field=1)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config("no-such.toml")
