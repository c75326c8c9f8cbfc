"""Files that come with a checkpoint or a run folder are input like any other: a ``latest``
that names a path elsewhere, a ``config.toml`` that is not one, a broken safetensors header are
each one ConfigError (exit 2); and the launcher's own pickles live where no one else can write."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model

import distml
from conftest import distml_invoke
from distml.config import ConfigError
from distml.models import GPT, DigitsCNN
from distml.serve.model import load_served_model
from distml.train.checkpoint import (
    latest_checkpoint,
    load_weights,
    model_settings_near,
    resolve_weights,
)


@pytest.mark.parametrize("named", ["../elsewhere", "/etc", "step_1/../../x", "checkpoint", ""])
def test_a_latest_file_naming_anything_but_a_step_folder_is_refused(tmp_path, named):
    (tmp_path / "elsewhere").mkdir()
    root = tmp_path / "run" / "checkpoint"
    root.mkdir(parents=True)
    (root / "latest").write_text(named)
    with pytest.raises(ConfigError, match="not a step_N checkpoint"):
        latest_checkpoint(root)
    with pytest.raises(ConfigError, match="not a step_N checkpoint"):
        resolve_weights(tmp_path / "run")


def test_a_latest_file_naming_a_step_folder_is_followed(tmp_path):
    (tmp_path / "step_00000007").mkdir()
    (tmp_path / "latest").write_text("step_00000007\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000007"


def weights_with_config(folder: Path, config: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_model(GPT(distml.config.GPTConfig(layers=1, hidden=16, heads=2)), str(folder / "m.st"))
    (folder / "config.toml").write_bytes(config)
    return folder / "m.st"


BAD_CONFIGS = {
    "nested too deeply": b"a = " + b"[" * 5000 + b"]" * 5000,
    "invalid start byte": b"[model]\nlayers = 1\n# \xff\xfe\n",
    "not a table": b"model = 3\n",
    "over 1024 KiB": b"# " + b"x" * 2**20 + b"\n",
    "end of a table declaration": b"[model\n",
}


@pytest.mark.parametrize("problem", BAD_CONFIGS)
def test_a_config_toml_beside_the_weights_that_is_not_one_is_a_config_error(tmp_path, problem):
    weights = weights_with_config(tmp_path / "run", BAD_CONFIGS[problem])
    with pytest.raises(ConfigError, match=problem):
        model_settings_near(weights)


def test_distml_generate_beside_a_hostile_config_exits_2_without_traceback(tmp_path):
    weights = weights_with_config(tmp_path / "run", BAD_CONFIGS["nested too deeply"])
    result = distml_invoke("generate", str(weights), "--tokens", "1", cwd=tmp_path)
    assert result.exit_code == 2, result.output
    assert "nested too deeply" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def _safetensors(header: bytes, data: bytes = b"\0" * 16) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


BAD_SAFETENSORS = {
    "empty": b"",
    "header length past the file": struct.pack("<Q", 2**63) + b"{}",
    "not JSON": _safetensors(b"{not json"),
    "unknown dtype": _safetensors(
        b'{"w": {"dtype": "EVIL", "shape": [2], "data_offsets": [0, 8]}}'
    ),
    "offsets past the data": _safetensors(
        b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 800]}}'
    ),
    "shape overflow": _safetensors(
        b'{"w": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 8]}}'
    ),
}


@pytest.mark.parametrize("problem", BAD_SAFETENSORS)
def test_a_broken_safetensors_header_is_one_config_error(tmp_path, problem):
    path = tmp_path / "model.safetensors"
    path.write_bytes(BAD_SAFETENSORS[problem])
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        load_weights(DigitsCNN(), path)


def payload_folder(ctx: distml.Context) -> dict:
    """Where this worker's function came from: the file named on its command line (after one
    step, which a parameter-server job needs to finish)."""
    model = torch.nn.Linear(2, 1)
    model, _ = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ctx.train_step(torch.ones(4, 2), lambda x: model(x).square().mean())
    ctx.finish()
    argv = Path("/proc/self/cmdline").read_bytes().decode().split("\0")
    code = next(a for a in argv if "_command_worker_main" in a)
    folder = Path(re.search(r"_command_worker_main\('(.+)'\)", code).group(1)).parent
    info = folder.stat()
    return {"folder": str(folder), "mode": info.st_mode & 0o777, "owner": info.st_uid}


@pytest.mark.distributed
def test_the_launcher_hands_its_function_over_in_a_private_folder_it_removes(tmp_path):
    out = distml.launch(
        payload_folder,
        nproc=1,
        strategy={"name": "ps"},
        runs_dir=tmp_path,
        run_name="job",
        telemetry={"progress": False},
    )
    assert out["mode"] == 0o700 and out["owner"] == os.getuid()
    assert not Path(out["folder"]).is_relative_to(tmp_path)  # not in a shared run folder
    assert not Path(out["folder"]).exists()
    assert not [p for p in tmp_path.rglob("*") if p.suffix in {".pkl", ".pt"}]


BAD_SUMMARIES = {
    "nested deeper": b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "not JSON": b'{"export": "m.safetensors"\xff}',
    "not a path": b'{"export": 3}',
    "over the limit": b'{"pad": "' + b"x" * 2**20 + b'"}',
}


@pytest.mark.parametrize("problem", BAD_SUMMARIES)
def test_a_served_run_folder_with_a_hostile_summary_is_one_config_error(tmp_path, problem):
    save_model(DigitsCNN(), str(tmp_path / "model.safetensors"))
    (tmp_path / "summary.json").write_bytes(BAD_SUMMARIES[problem])
    with pytest.raises(ConfigError, match=problem):
        load_served_model(tmp_path, "digits-cnn")


def test_a_served_model_beside_a_config_whose_model_is_not_a_table_is_a_config_error(tmp_path):
    weights = weights_with_config(tmp_path / "run", b"model = 3\n")
    with pytest.raises(ConfigError, match="not a table"):
        load_served_model(weights)


def _saved_adapter(tmp_path: Path) -> tuple[Path, dict]:
    from distml.train.finetune import adapter_config_path, add_lora, lora_config, save_adapter

    model = DigitsCNN()
    path = save_adapter(add_lora(model, lora_config(model, 2)), tmp_path / "adapter.safetensors")
    return path, json.loads(adapter_config_path(path).read_text())


@pytest.mark.parametrize(
    "change",
    [
        {"r": "4"},
        {"r": 0},
        {"r": 10**12},
        {"lora_alpha": -1.0},
        {"lora_dropout": 1.5},
        {"target_modules": "fc"},
        {"target_modules": []},
        {"extra": 1},
    ],
    ids=["r-string", "r-zero", "r-huge", "alpha-negative", "dropout", "targets-string",
         "targets-empty", "extra-field"],
)  # fmt: skip
def test_an_adapter_config_out_of_range_is_one_config_error(tmp_path, change):
    from distml.train.finetune import adapter_config_path, load_adapter

    path, settings = _saved_adapter(tmp_path)
    adapter_config_path(path).write_text(json.dumps(settings | change))
    with pytest.raises(ConfigError, match="cannot read the adapter"):
        load_adapter(DigitsCNN(), path)


@pytest.mark.parametrize("text", ["[" * 100_000, " " * (5 * 2**20) + "{}"], ids=["deep", "huge"])
def test_an_adapter_config_too_deep_or_too_large_is_one_config_error(tmp_path, text):
    from distml.train.finetune import adapter_config_path, load_adapter

    path, _ = _saved_adapter(tmp_path)
    adapter_config_path(path).write_text(text)
    with pytest.raises(ConfigError, match="cannot read the adapter"):
        load_adapter(DigitsCNN(), path)


def test_a_saved_adapter_still_loads(tmp_path):
    from distml.train.finetune import load_adapter

    path, _ = _saved_adapter(tmp_path)
    assert load_adapter(DigitsCNN(), path) is not None


def test_generate_on_several_ranks_refuses_unfit_weights_before_it_starts_them(tmp_path):
    from distml.jobs.generate import generate_tokens

    weights = tmp_path / "model.safetensors"
    save_model(DigitsCNN(), str(weights))
    with pytest.raises(ConfigError, match="does not fit a GPT"):
        generate_tokens(weights, [[1, 2]], 1, nproc=2)
