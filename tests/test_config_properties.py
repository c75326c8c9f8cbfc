"""Properties of config loading, which reads TOML files a user (or whoever sent them one)
wrote: every file either validates into a RunConfig or is refused with ConfigError, the one
error the command line turns into exit 2; never another exception."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import examples
from distml.config import (
    ConfigError,
    GPTConfig,
    ParallelConfig,
    PSConfig,
    RunConfig,
    StrategyConfig,
    TelemetryConfig,
    load_config,
    save_config,
)

# No clock in a property: a loaded machine must not turn a slow example into a failure.
FAST = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

TABLES = {
    "strategy": StrategyConfig,
    "parallel": ParallelConfig,
    "model": GPTConfig,
    "ps": PSConfig,
    "telemetry": TelemetryConfig,
}

scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, 1, 2, 4, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["ddp", "ps", "local-sgd", "bsp", "gpipe", "interleaved", "fp16", "dp"]),
    st.booleans(),
    st.datetimes(timezones=st.none() | st.just(datetime.UTC)),
    st.dates(),
)
keys = st.text(max_size=8)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def table(model: type) -> st.SearchStrategy[dict]:
    """Some of ``model``'s fields, and now and then a field it does not have, any value each."""
    keys = st.sampled_from(sorted(model.model_fields)) | st.text(max_size=8)
    return st.dictionaries(keys, values, max_size=4)


@st.composite
def documents(draw: st.DrawFn) -> dict:
    doc = draw(table(RunConfig))
    for name in draw(st.lists(st.sampled_from(sorted(TABLES)), max_size=3, unique=True)):
        doc[name] = draw(table(TABLES[name]))
    if draw(st.booleans()):
        doc["mesh"] = draw(st.dictionaries(st.sampled_from(["dp", "tp", "pp", "fsdp"]), values))
    return doc


def validated_or_refused(path: Path) -> RunConfig | None:
    try:
        config = load_config(path)
    except ConfigError:
        return None
    assert isinstance(config, RunConfig)
    return config


@settings(FAST, max_examples=examples(300))
@given(doc=documents())
def test_any_toml_document_validates_or_is_one_config_error(tmp_path, doc):
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(doc))
    config = validated_or_refused(path)
    if config is not None:  # what validates is written back and read back unchanged
        save_config(config, tmp_path / "again.toml")
        assert load_config(tmp_path / "again.toml") == config


@settings(FAST, max_examples=examples(500))
@given(data=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_any_bytes_validate_or_are_one_config_error(tmp_path, data):
    path = tmp_path / "config.toml"
    path.write_bytes(data)
    validated_or_refused(path)


def mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for at, value in edits:
        out[at % len(out)] = value
    return bytes(out)


@settings(FAST, max_examples=examples(500))
@given(
    edits=st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), min_size=1, max_size=3)
)
def test_a_mutated_resolved_config_validates_or_is_one_config_error(tmp_path, edits):
    path = tmp_path / "config.toml"
    save_config(
        RunConfig(run_name="r", nproc=2, mesh={"dp": 2}, model=GPTConfig(), ps=PSConfig()), path
    )
    path.write_bytes(mutate(path.read_bytes(), edits))
    validated_or_refused(path)


HOSTILE = {
    "nested too deeply": b"plan = " + b"[" * 5000 + b"]" * 5000,
    "invalid start byte": b"nproc = 2\n# \xff\n",
    "over 1024 KiB": b"nproc = 2\n#" + b"x" * 2**20,
    "Is a directory": None,
}


@pytest.mark.parametrize("problem", HOSTILE)
def test_hostile_config_files_are_one_config_error(tmp_path, problem):
    path = tmp_path / "config.toml"
    if HOSTILE[problem] is None:
        path.mkdir()
    else:
        path.write_bytes(HOSTILE[problem])
    with pytest.raises(ConfigError, match=problem):
        load_config(path)


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_a_setting_of_inf_or_nan_is_one_config_error(tmp_path, value):
    path = tmp_path / "config.toml"
    path.write_text(f"timeout_s = {value}\n")
    with pytest.raises(ConfigError, match="timeout_s"):
        load_config(path)
