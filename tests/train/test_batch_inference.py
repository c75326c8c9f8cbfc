"""Distributed batch inference in launched worlds of two processes writes the file one process
would: the digits CNN over a dataset whose size two does not divide, and the GPT generating
from prompts of several lengths under tensor parallelism, or from a checkpoint saved sharded
under pipeline parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomli_w
import torch
import typer
from safetensors.torch import load_file, save_file, save_model
from typer.testing import CliRunner

import distml
from distml.cli.data_spec import parse_data
from distml.cli.infer import infer as infer_command
from distml.config import ConfigError, GPTConfig
from distml.data import digits
from distml.jobs.generate import generate_tokens
from distml.jobs.infer import read_sequences, write_sequences
from distml.models import GPT, DigitsCNN, lm_loss


def _cli() -> typer.Typer:
    """The command mounted the way ``distml`` mounts it."""
    root = typer.Typer()
    root.command(name="infer")(infer_command)

    @root.command()
    def other() -> None: ...

    return root


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    path = tmp_path_factory.mktemp("cnn") / "model.safetensors"
    torch.manual_seed(3)
    save_model(DigitsCNN(), str(path))
    return path


@pytest.mark.distributed
def test_predictions_of_two_ranks_equal_one_process_in_input_order(cnn, tmp_path):
    data = digits("val")
    assert len(data) % 2 == 1  # the blocks differ by one sample: nothing padded or dropped
    out = tmp_path / "preds.safetensors"
    args = ["infer", str(cnn), "--data", "digits:val", "--out", str(out)]
    result = CliRunner().invoke(_cli(), [*args, "--nproc", "2", "--batch-size", "50"])
    assert result.exit_code == 0, result.output
    written = load_file(str(out))
    model = DigitsCNN()
    model.load_state_dict(load_file(str(cnn)))
    with torch.no_grad():
        expected = model.eval()(data.tensors[0])
    assert written["outputs"].shape == expected.shape
    assert torch.allclose(written["outputs"], expected, atol=1e-6, rtol=0)
    assert torch.equal(written["predictions"], expected.argmax(dim=1))


CFG = GPTConfig(vocab_size=256, seq_len=16, layers=2, hidden=32, heads=4)
PROMPTS = ["import os", "x = 1", "def f(x):", "return", "from a.b", "class C:", "try: pass"]


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("gpt")
    torch.manual_seed(0)
    save_model(GPT(CFG), str(run / "model.safetensors"))
    (run / "config.toml").write_text(tomli_w.dumps({"model": CFG.model_dump()}))
    return run


@pytest.mark.distributed
def test_batch_generation_under_tp_gives_the_tokens_of_one_process(gpt_run, tmp_path):
    lengths = {len(p) for p in PROMPTS}
    assert len(lengths) > 1 and any(sum(len(p) == n for p in PROMPTS) > 2 for n in lengths)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "tokens.safetensors"
    args = ["infer", str(gpt_run), "--model", "gpt", "--prompts", str(prompts), "--tokens", "10"]
    args += ["--out", str(out), "--batch-size", "2", "--nproc", "2", "--mesh", "tp=2"]
    result = CliRunner().invoke(_cli(), args)
    assert result.exit_code == 0, result.output
    sharded = read_sequences(out)
    ids = [list(p.encode()) for p in PROMPTS]
    assert sharded == generate_tokens(gpt_run, ids, 10, batch_size=2)
    for prompt, sequence in zip(ids, sharded, strict=True):  # in input order
        assert sequence[: len(prompt)] == prompt and len(sequence) == len(prompt) + 10


def checkpoint_under_tp(ctx: distml.Context, weights: str) -> None:
    """One step of the GPT at ``weights`` under tp=2, then a checkpoint (its tensors saved
    sharded) and the run's export of the same weights."""
    model = GPT(CFG)
    model.load_state_dict(load_file(weights))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ctx.setup(model, optimizer)
    x = torch.arange(2 * CFG.seq_len).reshape(2, CFG.seq_len) % CFG.vocab_size
    ctx.train_step((x, x.roll(-1, dims=1)), loss=lm_loss)
    ctx.save_checkpoint()
    ctx.finish()


@pytest.mark.distributed
def test_gpt_inference_from_a_checkpoint_folder_equals_that_from_the_export(
    gpt_run, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # the launched workers' run folders go under ./runs
    distml.launch(
        checkpoint_under_tp,
        str(gpt_run / "model.safetensors"),
        nproc=2,
        mesh={"tp": 2},
        model=CFG.model_dump(),
        runs_dir=tmp_path,
        run_name="tp",
        telemetry={"progress": False},
    )
    run = tmp_path / "tp"
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS[:3]) + "\n")

    def infer_gpt(source: Path, out: str, *layout: str) -> list[list[int]]:
        args = ["infer", str(source), "--model", "gpt", "--prompts", "prompts.txt"]
        result = CliRunner().invoke(_cli(), [*args, "--tokens", "6", "--out", out, *layout])
        assert result.exit_code == 0, result.output
        return read_sequences(out)

    resharded = infer_gpt(run / "checkpoint", "dcp.safetensors", "--nproc", "2", "--mesh", "pp=2")
    exported = infer_gpt(run / "model.safetensors", "export.safetensors", "--nproc", "1")
    assert resharded == exported
    before = generate_tokens(gpt_run, [list(p.encode()) for p in PROMPTS[:3]], 6)
    assert exported != before  # the step moved the weights: the run's own were read


def test_sequences_round_trip_through_one_file(tmp_path):
    sequences = [[1, 2, 3], [4], [5, 6]]
    assert read_sequences(write_sequences(sequences, tmp_path / "s.safetensors")) == sequences


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompts", "p.txt"], "--prompts goes with --model gpt"),
        (["--mesh", "tp=2"], "use dp=N"),
        (["--data", "x.safetensors"], "no such dataset"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--model", "digits-mlp"], "does not fit a MLP"),
    ],
    ids=["prompts", "mesh", "data", "batch", "wrong-model"],
)
def test_cli_refuses_bad_input_before_starting(cnn, extra, message):
    result = CliRunner().invoke(_cli(), ["infer", str(cnn), "--nproc", "2", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_a_data_file_needs_targets_to_train_but_not_to_predict(tmp_path):
    x = digits("val").tensors[0][:5]
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    (inputs,) = parse_data(str(tmp_path / "x.safetensors"), targets=False).tensors
    assert torch.equal(inputs, x)
    with pytest.raises(ConfigError, match="expected tensors"):
        parse_data(str(tmp_path / "x.safetensors"))
