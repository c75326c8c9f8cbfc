"""Fine-tuning in launched worlds of two processes, each checked against one process: from a
checkpoint saved under FSDP (it reshards) or an exported file; a new head, frozen modules, LoRA
adapters under data and pipeline parallelism; adapters saved alone, loaded back and merged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import typer
from safetensors.torch import load_file, save_file, save_model
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

import distml
from conftest import EXAMPLES, distml_cli, rel_err
from distml.cli.finetune import finetune as finetune_command
from distml.config import GPTConfig
from distml.data import ShardedBatchSampler, digits, stdlib_text
from distml.models import GPT, DigitsCNN, lm_loss
from distml.train.checkpoint import load_weights
from distml.train.finetune import (
    add_lora,
    freeze,
    load_adapter,
    lora_config,
    merge_adapter,
    replace_head,
    save_adapter,
    trainable_parameters,
)

pytestmark = pytest.mark.distributed  # every test starts processes

OPTS = {"telemetry": {"progress": False}}
STEPS = 10  # fine-tuning steps
GLOBAL_BATCH = 64


def parity(split: str) -> TensorDataset:
    x, y = digits(split).tensors
    return TensorDataset(x, y % 2)


def pretrained_cnn(path: Path) -> Path:
    """A digits CNN trained for 5 epochs in this process (quick), saved as safetensors."""
    torch.manual_seed(0)
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = digits("train")
    for epoch in range(5):
        for idx in ShardedBatchSampler(len(data), GLOBAL_BATCH, 0, 1, seed=epoch):
            x, y = data[idx]
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    save_model(model, str(path))
    return path


def checkpoint_under_fsdp(ctx: distml.Context, weights: str) -> None:
    """Two more steps under FSDP, then a checkpoint: its tensors are saved sharded."""
    model = DigitsCNN()
    model.load_state_dict(load_file(weights))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ctx.setup(model, optimizer)
    for batch in ctx.dataloader(digits("train"), batch_size=GLOBAL_BATCH // ctx.data_world):
        ctx.train_step(batch, loss=F.cross_entropy)
        if ctx.step == 2:
            break
    ctx.save_checkpoint()
    ctx.finish()


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> Path:
    """A run folder whose checkpoint was saved under fsdp=2, and its export."""
    runs = tmp_path_factory.mktemp("runs")
    weights = str(pretrained_cnn(runs / "pretrained.safetensors"))
    distml.launch(
        checkpoint_under_fsdp,
        weights,
        nproc=2,
        mesh={"fsdp": 2},
        runs_dir=runs,
        run_name="digits",
        **OPTS,
    )
    return runs / "digits"


def one_process_finetune(base: Path, steps: int) -> dict[str, torch.Tensor]:
    """The example's fine-tune in one plain process with the whole global batch."""
    model = DigitsCNN()
    model.load_state_dict(load_file(str(base)))
    replace_head(model, "head.3", 2)
    freeze(model, ["features.*"])
    optimizer = torch.optim.SGD(trainable_parameters(model), lr=0.1, momentum=0.9)
    data = parity("train")
    for i, idx in enumerate(ShardedBatchSampler(len(data), GLOBAL_BATCH, 0, 1, seed=0)):
        if i == steps:
            break
        x, y = data[idx]
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_a_checkpoint_saved_under_fsdp_loads_whole_into_one_process(digits_run):
    model = DigitsCNN()
    assert load_weights(model, digits_run / "checkpoint").name.startswith("step_")
    exported = load_file(str(digits_run / "model.safetensors"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, exported[name]), name


def test_example_finetune_freezes_trains_the_new_head_and_equals_one_process(digits_run, tmp_path):
    proc = distml_cli(
        "run",
        "--nproc",
        "2",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "parity",
        str(EXAMPLES / "digits" / "finetune.py"),
        "--base",
        str(digits_run / "checkpoint"),
        "--steps",
        str(STEPS),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--lr",
        "0.1",
    )
    assert proc.returncode == 0, proc.stderr
    tuned = load_file(str(tmp_path / "parity" / "model.safetensors"))
    base = load_file(str(digits_run / "model.safetensors"))
    oracle = one_process_finetune(digits_run / "model.safetensors", STEPS)
    assert set(tuned) == set(oracle)
    for name in tuned:
        if name.startswith("features."):  # frozen: not a bit changed
            assert torch.equal(tuned[name], base[name]), name
        else:
            assert rel_err(tuned[name], oracle[name]) <= 1e-5, name
    fresh = replace_head(DigitsCNN(), "head.3", 2)
    assert rel_err(tuned["head.3.weight"], fresh.weight.detach()) > 0.05  # the new head moved
    summary = json.loads((tmp_path / "parity" / "summary.json").read_text())
    assert summary["eval"]["accuracy"] > 0.85  # parity, from 10 steps on frozen features


# -- LoRA on the GPT under pipeline parallelism -----------------------------------------------

CFG = GPTConfig(vocab_size=256, seq_len=16, layers=2, hidden=32, heads=4)
LORA = {"r": 4, "alpha": 8.0, "targets": ["blocks.*.attn.q", "blocks.*.attn.v"]}
LM_BATCH, LM_STEPS, LM_LR = 8, 4, 0.5
PROBE = torch.arange(2 * CFG.seq_len).reshape(2, CFG.seq_len) % CFG.vocab_size


def corpus() -> TensorDataset:
    return stdlib_text("train", seq_len=CFG.seq_len, max_bytes=20_000)


def lora_gpt(base: Path) -> tuple[GPT, nn.Module]:
    model = GPT(CFG)
    load_weights(model, base)
    config = lora_config(model, LORA["r"], LORA["alpha"], LORA["targets"])
    return model, add_lora(model, config)


def lora_worker(ctx: distml.Context, base: str, out: str) -> dict:
    model, adapted = lora_gpt(Path(base))
    optimizer = torch.optim.SGD(trainable_parameters(model), lr=LM_LR, momentum=0.9)
    ctx.setup(model, optimizer)
    for batch in ctx.dataloader(corpus(), batch_size=LM_BATCH // ctx.data_world):
        ctx.train_step(batch, loss=lm_loss)
        if ctx.step == LM_STEPS:
            break
    outputs = ctx.forward(PROBE)
    full = ctx.full_state_dict()
    if full is not None:
        save_adapter(adapted, Path(out) / "adapter.safetensors", full[0])
    merge_adapter(adapted)
    summary = ctx.finish()
    return {"outputs": outputs, "state": full[0] if full else None, "export": summary["export"]}


def one_process_lora(base: Path) -> dict[str, torch.Tensor]:
    model, _ = lora_gpt(base)
    optimizer = torch.optim.SGD(trainable_parameters(model), lr=LM_LR, momentum=0.9)
    data = corpus()
    for i, idx in enumerate(ShardedBatchSampler(len(data), LM_BATCH, 0, 1, seed=0)):
        if i == LM_STEPS:
            break
        x, y = data[idx]
        optimizer.zero_grad()
        lm_loss(model(x), y).backward()
        optimizer.step()
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def gpt_lora(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("gpt")
    torch.manual_seed(1)
    save_model(GPT(CFG), str(tmp / "base.safetensors"))
    result = distml.launch(
        lora_worker,
        str(tmp / "base.safetensors"),
        str(tmp),
        nproc=2,
        mesh={"pp": 2},
        parallel={"microbatches": 2},
        model=CFG.model_dump(),
        runs_dir=tmp,
        run_name="lora",
        **OPTS,
    )
    return {**result, "base": tmp / "base.safetensors", "adapter": tmp / "adapter.safetensors"}


def test_lora_under_pp_trains_only_the_adapters_and_equals_one_process(gpt_lora):
    saved = load_file(str(gpt_lora["adapter"]))
    oracle = one_process_lora(gpt_lora["base"])
    assert set(saved) == set(oracle)  # A and B of q and v in both blocks, nothing else
    for name, tensor in saved.items():
        assert rel_err(tensor, oracle[name]) <= 1e-5, name
    base = load_file(str(gpt_lora["base"]))
    for name, tensor in gpt_lora["state"].items():
        if ".lora_" not in name:  # the frozen base, across both pipeline stages
            assert torch.equal(tensor, base[name.replace(".base_layer", "")]), name


def test_a_saved_adapter_loads_back_onto_the_base_with_the_same_outputs(gpt_lora):
    settings = json.loads(gpt_lora["adapter"].with_suffix(".json").read_text())
    assert settings["r"] == LORA["r"] and settings["lora_alpha"] == LORA["alpha"]
    model = GPT(CFG)
    load_weights(model, gpt_lora["base"])
    adapted = load_adapter(model, gpt_lora["adapter"]).eval()
    with torch.no_grad():
        assert torch.allclose(adapted(PROBE), gpt_lora["outputs"], atol=1e-5, rtol=0)


def test_merged_weights_are_base_plus_the_low_rank_delta(gpt_lora):
    merged = load_file(gpt_lora["export"])
    base, adapter = load_file(str(gpt_lora["base"])), load_file(str(gpt_lora["adapter"]))
    scale = LORA["alpha"] / LORA["r"]
    adapted_layers = {k.split(".lora_")[0] for k in adapter}
    assert len(adapted_layers) == 2 * CFG.layers
    for name in base:
        layer = name.rsplit(".", 1)[0]
        if layer in adapted_layers and name.endswith(".weight"):
            b, a = (
                adapter[f"{layer}.lora_B.default.weight"],
                adapter[f"{layer}.lora_A.default.weight"],
            )
            assert torch.allclose(merged[name], base[name] + scale * b @ a, atol=1e-6, rtol=0)
        else:
            assert torch.equal(merged[name], base[name]), name
    model = GPT(CFG)
    model.load_state_dict(merged, strict=True)  # a plain GPT again
    with torch.no_grad():
        assert torch.allclose(model(PROBE), gpt_lora["outputs"], atol=1e-5, rtol=0)


# -- the command line -----------------------------------------------------------------------


def _cli() -> typer.Typer:
    """The command mounted the way ``distml`` mounts it."""
    root = typer.Typer()
    root.command(name="finetune")(finetune_command)

    @root.command()
    def other() -> None: ...

    return root


def test_cli_lora_with_a_new_head_writes_adapter_and_merged_model(digits_run, tmp_path):
    for split in ("train", "val"):
        x, y = parity(split).tensors
        save_file({"x": x, "y": y}, str(tmp_path / f"{split}.safetensors"))
    args = [
        "finetune",
        str(digits_run / "checkpoint"),
        "--data",
        str(tmp_path / "train.safetensors"),
    ]
    args += ["--val", str(tmp_path / "val.safetensors"), "--head", "2", "--lora", "4"]
    args += ["--steps", "8", "--global-batch", "64", "--lr", "0.1", "--nproc", "2"]
    args += ["--runs-dir", str(tmp_path), "--run-name", "lora"]
    result = CliRunner().invoke(_cli(), args)
    assert result.exit_code == 0, result.output
    run = tmp_path / "lora"
    spec = json.loads((run / "finetune.json").read_text())
    assert spec["head"] == 2 and spec["lora_r"] == 4
    merged = DigitsCNN(classes=2)
    merged.load_state_dict(load_file(str(run / "model.safetensors")), strict=True)
    base = DigitsCNN()
    load_weights(base, digits_run)
    replace_head(base, "head.3", 2)
    adapted = load_adapter(base, run / "adapter.safetensors").eval()
    x = parity("val").tensors[0]
    with torch.no_grad():
        assert torch.allclose(adapted(x), merged(x), atol=1e-5, rtol=0)
    exported = load_file(str(digits_run / "model.safetensors"))
    for name, tensor in merged.state_dict().items():
        if name.startswith("features."):  # not adapted, not trained
            assert torch.equal(tensor, exported[name]), name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval"]["accuracy"] > 0.8


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--freeze", "nothing.*"], "names no module"),
        (["--lora", "2", "--mesh", "tp=2"], "LoRA fine-tuning runs under"),
        (["--model", "digits-mlp"], "does not fit a MLP"),
        (["--global-batch", "3"], "does not split over 2"),
        (["--data", "nowhere.safetensors"], "no such dataset"),
    ],
    ids=["pattern", "lora-tp", "wrong-model", "batch", "data"],
)
def test_cli_refuses_bad_input_before_starting(digits_run, extra, message):
    result = CliRunner().invoke(_cli(), ["finetune", str(digits_run), "--nproc", "2", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output
