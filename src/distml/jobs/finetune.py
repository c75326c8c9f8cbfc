"""A fine-tuning run: a model of the registry, its base weights, the changes of
:mod:`distml.train.finetune`, trained in N worker processes under the run's strategy.

What the ``distml finetune`` command runs, and the same from Python:

>>> from torch.utils.data import TensorDataset
>>> from distml.data import digits
>>> x, y = digits("train").tensors
>>> spec = FineTuneSpec(model="digits-cnn", base="runs/digits", head=2, freeze=["features.*"])
>>> summary = run_finetune(spec, TensorDataset(x, y % 2), nproc=2)  # doctest: +SKIP

The run folder is that of any run (``summary.json``, ``report.html``, ``model.safetensors``), plus
``finetune.json`` (the spec) and, with LoRA, ``adapter.safetensors`` and ``adapter.json``; the
exported model then has the adapters merged in, so a plain model with the new head loads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn
from torch.utils.data import Dataset

from distml.config import ConfigError, GPTConfig, RunConfig, build_config, format_validation_error
from distml.launch.api import launch
from distml.models.gpt import lm_loss
from distml.models.registry import model_entry
from distml.train.checkpoint import (
    check_weights,
    load_weights,
    model_settings_near,
    resolve_weights,
)
from distml.train.evaluate import LM_METRICS, METRICS
from distml.train.finetune import (
    add_lora,
    freeze,
    last_linear,
    lora_config,
    merge_adapter,
    replace_head,
    save_adapter,
    trainable_parameters,
)

if TYPE_CHECKING:
    from peft import PeftModel

    from distml.runtime.context import Context


class FineTuneSpec(BaseModel):
    """What to start from, what to change, how long to train. ``head`` replaces the Linear
    ``head_module`` (default: the model's last) by one with ``head`` outputs; with ``lora_r``
    the base is frozen, adapters go on ``lora_targets`` (default: every Linear but a new head)
    and a new head is trained whole. ``global_batch`` is split over the data-parallel ranks."""

    model_config = ConfigDict(extra="forbid")

    model: str
    base: Path
    gpt: GPTConfig | None = None  # the GPT's size (default: the base run's [model])
    head: Annotated[int, Field(ge=1)] | None = None
    head_module: str | None = None
    freeze: list[str] = []
    lora_r: Annotated[int, Field(ge=1)] | None = None
    lora_alpha: Annotated[float, Field(gt=0)] | None = None
    lora_targets: list[str] | None = None
    epochs: Annotated[int, Field(ge=1)] = 1
    steps: Annotated[int, Field(ge=0)] = 0  # stop after this many steps; 0: after the epochs
    global_batch: Annotated[int, Field(ge=1)] = 32
    lr: Annotated[float, Field(gt=0)] = 0.05
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    seed: int = 0  # of the new head and the adapters


def with_gpt_size(spec: FineTuneSpec) -> FineTuneSpec:
    """``spec`` with the GPT's size, when it gives none, read from the base run's ``[model]``:
    the size its weights were trained at. Once filled in, the spec is returned as it is."""
    if spec.model != "gpt" or spec.gpt is not None:
        return spec
    try:
        gpt = GPTConfig(**model_settings_near(spec.base))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None
    return spec.model_copy(update={"gpt": gpt})


def build_base(spec: FineTuneSpec) -> nn.Module:
    """The plain model of the spec's architecture, before its base weights are loaded."""
    config = spec.gpt.model_dump() if spec.model == "gpt" and spec.gpt is not None else {}
    try:
        return model_entry(spec.model, config).build()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def adapt(model: nn.Module, spec: FineTuneSpec) -> tuple[nn.Module, PeftModel | None]:
    """The spec's changes to the base model: new head, frozen modules, LoRA adapters, in that
    order (:mod:`distml.train.finetune`)."""
    head = spec.head_module or last_linear(model)
    if spec.head is not None:
        replace_head(model, head, spec.head, seed=spec.seed)
    if spec.freeze:
        freeze(model, spec.freeze)
    if spec.lora_r is None:
        return model, None
    train = [head] if spec.head is not None else []
    config = lora_config(model, spec.lora_r, spec.lora_alpha, spec.lora_targets, train)
    return model, add_lora(model, config, seed=spec.seed)


def prepare_model(spec: FineTuneSpec) -> tuple[nn.Module, PeftModel | None]:
    """The model to train: the base with its weights, then the spec's changes."""
    model = build_base(spec)
    load_weights(model, spec.base)
    return adapt(model, spec)


def check_spec(spec: FineTuneSpec, run: RunConfig) -> None:
    """Refuse, before any process starts, a fine-tune that cannot run as asked: base weights
    that do not fit, patterns that name nothing, a layout LoRA is not built for, a batch that
    does not split over the ranks."""
    model = build_base(spec)
    check_weights(model, resolve_weights(spec.base))
    adapt(model, spec)  # a pattern that names nothing raises here
    mesh = run.mesh or {"dp": run.world_size}
    data = mesh.get("dp", 1) * mesh.get("fsdp", 1)
    sharded = mesh.get("fsdp", 1) > 1 or mesh.get("tp", 1) > 1 or mesh.get("pp", 1) > 1
    if spec.lora_r is not None and (mesh.get("tp", 1) > 1 or (sharded and data > 1)):
        raise ConfigError(
            "LoRA fine-tuning runs under data parallelism (dp=N) or pipeline parallelism "
            "(pp=P) only; tensor parallelism and FSDP would split the adapted layers"
        )
    if spec.global_batch % data:
        raise ConfigError(
            f"--global-batch {spec.global_batch} does not split over {data} data-parallel ranks"
        )
    micro = run.parallel.microbatches
    if mesh.get("pp", 1) > 1 and (spec.global_batch // data) % micro:
        raise ConfigError(
            f"a batch of {spec.global_batch // data} per rank does not split into {micro} "
            "pipeline micro-batches"
        )


def _loss_and_metrics(spec: FineTuneSpec) -> tuple[Any, dict]:
    if spec.model == "gpt":
        return lm_loss, LM_METRICS
    return F.cross_entropy, METRICS


def finetune_worker(
    ctx: Context, spec: dict[str, Any], train: Dataset, val: Dataset | None
) -> dict[str, Any]:
    """One rank of the run: prepare, set up under the run's strategy, train, evaluate, save
    the adapter (gathered from every rank's share), merge it, write the run folder."""
    spec_ = FineTuneSpec(**spec)
    model, peft_model = prepare_model(spec_)
    optimizer = torch.optim.SGD(trainable_parameters(model), lr=spec_.lr, momentum=spec_.momentum)
    ctx.setup(model, optimizer)
    loss, metrics = _loss_and_metrics(spec_)
    loader = ctx.dataloader(train, batch_size=spec_.global_batch // ctx.data_world)

    def done() -> bool:
        return ctx.step >= spec_.steps if spec_.steps else loader.epoch >= spec_.epochs

    while not done():
        for batch in loader:
            ctx.train_step(batch, loss=loss)
            if done():
                break
    scores = ctx.evaluate(ctx.model, val, metrics) if val is not None else {}
    if peft_model is not None:
        full = ctx.full_state_dict()  # a collective: every rank's share of the adapters
        if full is not None:
            save_adapter(peft_model, ctx.run_dir / "adapter.safetensors", full[0])
        merge_adapter(peft_model)
    if ctx.rank == 0:
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        (ctx.run_dir / "finetune.json").write_text(spec_.model_dump_json(indent=2) + "\n")
    return ctx.finish(eval=scores)


def run_finetune(
    spec: FineTuneSpec,
    train: Dataset,
    val: Dataset | None = None,
    *,
    nproc: int = 2,
    mesh: dict[str, int] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """Fine-tune in ``nproc`` worker processes; returns the run's summary. ``settings`` are
    :class:`distml.config.RunConfig` fields (``run_name``, ``runs_dir``, ``parallel``, ...)."""
    spec = with_gpt_size(spec)
    if spec.model == "gpt":
        settings.setdefault("model", spec.gpt.model_dump())
    config = build_config(nproc=nproc, mesh=mesh, **settings)
    check_spec(spec, config)
    if len(train) < spec.global_batch:
        raise ConfigError(
            f"{len(train)} training samples, fewer than one batch of {spec.global_batch}"
        )
    return launch(finetune_worker, spec.model_dump(mode="json"), train, val, config=config)
