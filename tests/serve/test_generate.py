"""Greedy generation with the GPT sharded by tensor or pipeline parallelism gives exactly the
tokens of one process running the whole model."""

from __future__ import annotations

import pytest
import tomli_w
import torch
from safetensors.torch import save_model

from conftest import distml_cli
from distml.config import ConfigError, GPTConfig
from distml.data import stdlib_text
from distml.jobs.generate import generate_text, generate_tokens
from distml.models import GPT, lm_loss

CFG = GPTConfig(vocab_size=256, seq_len=32, layers=4, hidden=64, heads=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A run folder as a training run leaves it: a briefly trained GPT and its config."""
    run = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = stdlib_text("train", CFG.seq_len, max_bytes=50_000)
    for step in range(40):
        x, y = data[torch.arange(16) + 16 * step]
        optimizer.zero_grad()
        lm_loss(model(x), y).backward()
        optimizer.step()
    save_model(model, str(run / "model.safetensors"))
    (run / "config.toml").write_text(tomli_w.dumps({"model": CFG.model_dump()}))
    return run


PROMPTS = [list(b"import os\n"), list(b"def main(")]


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_sharded_generation_equals_one_process(checkpoint, mesh, tmp_path):
    one = generate_tokens(checkpoint, [p[:9] for p in PROMPTS], 24)
    sharded = generate_tokens(
        checkpoint, [p[:9] for p in PROMPTS], 24, nproc=2, mesh=mesh, runs_dir=tmp_path
    )
    assert sharded == one
    assert len(one[0]) == 9 + 24 and one[0][:9] == PROMPTS[0][:9]


@pytest.mark.distributed
def test_cli_generates_text(checkpoint, tmp_path):
    expected = generate_text(checkpoint, "import os", 16)
    proc = distml_cli(
        "generate",
        str(checkpoint),
        "--prompt",
        "import os",
        "--tokens",
        "16",
        "--nproc",
        "2",
        "--mesh",
        "tp=2",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == expected


def test_a_checkpoint_that_does_not_fit_the_config_is_refused(checkpoint, tmp_path):
    (tmp_path / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes())
    (tmp_path / "config.toml").write_text("[model]\nlayers = 2\n")
    with pytest.raises(ConfigError, match="does not fit a GPT"):
        generate_tokens(tmp_path, [[1, 2]], 1)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        generate_tokens(tmp_path, [[1, 2]], 1)
