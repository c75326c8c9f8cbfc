"""Fine-tuning: a trained model changed for a new task, then trained again under any strategy.

The changes are made to the plain model, before ``ctx.setup`` applies the run's strategy to it,
in one visible order (as :func:`distml.parallel.layout.apply_layout` applies a layout):

1. load the base weights (:func:`distml.train.checkpoint.load_weights`: a checkpoint of any
   layout reshards onto the plain model, or an exported safetensors file is read);
2. replace the head (:func:`replace_head`), so that a 10-class classifier becomes a 2-class one;
3. freeze modules by name pattern (:func:`freeze`): they get no gradient, so the strategy has
   nothing of theirs to reduce and the optimizer nothing to update;
4. or add LoRA adapters (:func:`add_lora`, Hu et al. 2021, through ``peft``): the base is frozen
   and each adapted Linear learns a low-rank delta (alpha / r) B A.

The adapters alone are saved as safetensors with their config as JSON (:func:`save_adapter`),
loaded back onto the base (:func:`load_adapter`) or merged into it (:func:`merge_adapter`).
New modules draw their initial values from their own seed, so every rank, and one process,
starts the same fine-tune whatever was drawn before.

>>> from distml.models import DigitsCNN
>>> from distml.train.checkpoint import load_weights
>>> model = DigitsCNN()
>>> load_weights(model, "runs/digits/checkpoint")  # doctest: +SKIP
>>> head = replace_head(model, "head.3", 2)
>>> frozen = freeze(model, ["features.*"])
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from distml.config import ConfigError, describe_errors
from distml.net.untrusted import bounded_json

# peft is imported only for a LoRA fine-tune: it costs seconds to import.

if TYPE_CHECKING:
    from peft import PeftModel

ADAPTER = "default"  # peft's name for a model's one adapter
# The LoraConfig fields distml sets; the JSON beside an adapter holds exactly these.
ADAPTER_CONFIG_BYTES = 4 * 2**20  # the JSON beside an adapter; a real one is a few KB
_LORA_FIELDS = ("r", "lora_alpha", "target_modules", "modules_to_save", "lora_dropout")


class AdapterSettings(BaseModel):
    """The JSON beside an adapter's tensors, as read back: typed and bounded, since the file may
    come from anyone."""

    model_config = ConfigDict(extra="forbid", strict=True)

    r: int = Field(ge=1, le=65536)
    lora_alpha: float = Field(gt=0, allow_inf_nan=False)
    target_modules: list[str] = Field(min_length=1, max_length=100_000)
    modules_to_save: list[str] = Field(max_length=100_000)
    lora_dropout: float = Field(ge=0, lt=1)


def match_modules(model: nn.Module, patterns: Iterable[str], what: str) -> list[str]:
    """Names of ``model``'s modules that ``fnmatch`` patterns name, in module order; a pattern
    that names nothing is an error, not a silent no-op."""
    names = [name for name, _ in model.named_modules() if name]
    matched: set[str] = set()
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ConfigError(f"{what}: {pattern!r} names no module of {type(model).__name__}")
        matched.update(hits)
    return [n for n in names if n in matched]


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted ``name`` of ``model`` (``head.3``: item 3 of ``head``)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def last_linear(model: nn.Module) -> str:
    """The name of ``model``'s last ``nn.Linear`` in module order: its head, in the usual
    layout (the CNN's ``head.3``, the MLP's ``net.3``, the GPT's ``head``)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise ConfigError(f"{type(model).__name__} has no nn.Linear to take as its head")
    return names[-1]


def replace_head(model: nn.Module, name: str, out_features: int, *, seed: int = 0) -> nn.Linear:
    """Replace the Linear at ``name`` by a fresh one with ``out_features`` outputs, the same
    input width and bias, initialised as ``nn.Linear`` does from ``seed``."""
    old = model.get_submodule(name)
    if not isinstance(old, nn.Linear):
        raise ConfigError(f"the head {name!r} is a {type(old).__name__}, not an nn.Linear")
    if out_features < 1:
        raise ConfigError(f"a head needs at least one output, got {out_features}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        new = nn.Linear(old.in_features, out_features, bias=old.bias is not None)
    new = new.to(device=old.weight.device, dtype=old.weight.dtype)
    set_module(model, name, new)
    return new


def freeze(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """Stop the gradients of every parameter of the modules that ``patterns`` name; returns
    the frozen parameters' names."""
    frozen = []
    for module_name in match_modules(model, patterns, "freeze"):
        for param_name, p in model.get_submodule(module_name).named_parameters():
            p.requires_grad_(False)
            frozen.append(f"{module_name}.{param_name}")
    return sorted(set(frozen))


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer should hold: those that still take gradients."""
    return [p for p in model.parameters() if p.requires_grad]


def lora_config(
    model: nn.Module,
    r: int,
    alpha: float | None = None,
    targets: Iterable[str] | None = None,
    train: Iterable[str] = (),
) -> dict[str, Any]:
    """The LoRA settings as plain data: rank ``r``, ``alpha`` (default r), the Linear modules
    ``targets`` names (patterns; default every Linear outside ``train``), and the modules
    ``train`` names, trained whole beside the adapters (a new head)."""
    if r < 1 or (alpha is not None and not alpha > 0):
        raise ConfigError(f"LoRA needs r >= 1 and alpha > 0, got r={r}, alpha={alpha}")
    whole = match_modules(model, train, "LoRA modules to train") if train else []
    if targets is None:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        adapted = [n for n in linears if not any(n == w or n.startswith(w + ".") for w in whole)]
    else:
        adapted = match_modules(model, targets, "LoRA targets")
    for name in adapted:
        if not isinstance(model.get_submodule(name), nn.Linear):
            raise ConfigError(f"LoRA target {name} is not an nn.Linear")
    if not adapted:
        raise ConfigError("LoRA has no Linear layer to adapt")
    return {
        "r": r,
        "lora_alpha": float(r if alpha is None else alpha),
        "target_modules": adapted,
        "modules_to_save": whole,
        "lora_dropout": 0.0,
    }


def add_lora(model: nn.Module, config: dict[str, Any], *, seed: int = 0) -> PeftModel:
    """Wrap ``model`` with LoRA adapters as ``config`` (:func:`lora_config`) says. peft injects
    them in place: ``model`` itself (``.base_model.model`` of the result) keeps its class and
    its module names, which is what strategies and layouts are applied to. Every parameter but
    the adapters' and the whole-trained modules' is frozen; A starts from ``seed``
    (Kaiming-uniform), B at zero, so the adapted model starts as the base."""
    from peft import LoraConfig, get_peft_model

    settings = {k: config[k] for k in _LORA_FIELDS}
    settings["target_modules"] = list(settings["target_modules"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, LoraConfig(**settings))


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict key of an adapted model is the adapter's: LoRA's A and B, or a
    copy of a module trained whole (peft's ``modules_to_save``)."""
    parts = name.split(".")
    return any(
        parts[i] in ("lora_A", "lora_B", "modules_to_save") and parts[i + 1] == ADAPTER
        for i in range(len(parts) - 1)
    )


def adapter_config_path(path: Path | str) -> Path:
    """The JSON config beside an adapter's safetensors file."""
    return Path(path).with_suffix(".json")


def save_adapter(
    peft_model: PeftModel, path: Path | str, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write the adapter's tensors to ``path`` (safetensors) and its config beside it (JSON).

    ``state`` is the whole adapted model's state under the plain model's names, as
    ``ctx.full_state_dict()`` gathers it on rank 0 from any layout; without it, the state of
    ``peft_model`` itself (one process, or a rank of plain data parallelism). The tensors keep
    those names (``head.1.lora_A.default.weight``), so they load back onto the same base.
    """
    path = Path(path)
    config = peft_model.peft_config[ADAPTER]
    inner = peft_model.base_model.model
    state = inner.state_dict() if state is None else state
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items() if is_adapter_key(k)}
    if not tensors:
        raise ValueError("the model holds no adapter tensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    settings = {k: getattr(config, k) for k in _LORA_FIELDS}
    settings["target_modules"] = sorted(settings["target_modules"])
    settings["modules_to_save"] = list(settings["modules_to_save"] or [])
    adapter_config_path(path).write_text(json.dumps(settings, indent=2) + "\n")
    return path


def load_adapter(model: nn.Module, path: Path | str) -> PeftModel:
    """``model`` (the base, with the same head as when the adapter was trained) with the
    adapter of ``path`` (:func:`save_adapter`) on it; reads only JSON and safetensors."""
    path = Path(path)
    config_path = adapter_config_path(path)
    try:
        raw = bounded_json(config_path.read_bytes(), max_bytes=ADAPTER_CONFIG_BYTES)
        settings = AdapterSettings.model_validate(raw).model_dump()
        tensors = load_file(str(path))
    except (OSError, ValueError, SafetensorError) as exc:
        why = describe_errors(exc, 1, "the file") if isinstance(exc, ValidationError) else exc
        raise ConfigError(f"cannot read the adapter {path}: {why}") from None
    peft_model = add_lora(model, settings)
    inner = peft_model.base_model.model
    wanted = {k for k in inner.state_dict() if is_adapter_key(k)}
    if wanted != set(tensors):
        extra, missing = sorted(set(tensors) - wanted), sorted(wanted - set(tensors))
        raise ConfigError(f"{path} does not fit the model: missing {missing}, unexpected {extra}")
    inner.load_state_dict(tensors, strict=False)
    return peft_model


def merge_adapter(peft_model: PeftModel) -> nn.Module:
    """The plain model with the adapters merged in (W + (alpha / r) B A for each adapted
    Linear, the trained copy of each module trained whole): peft's ``merge_and_unload``, done
    in place, so the module names are the base's again and a plain model loads its export."""
    return peft_model.merge_and_unload()
