"""The ``--data`` of the commands: for ``distml finetune`` and ``distml infer`` a bundled dataset by
name or a safetensors file of tensors ``x`` (inputs) and ``y`` (targets); for ``distml fl client``
and the hub's commands a client's part of the digits or such a file."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from distml.config import ConfigError

if TYPE_CHECKING:  # torch is imported when data is read, not when the command line is parsed
    from torch.utils.data import TensorDataset

DATA_HELP = (
    "digits[:train|val|all] (scikit-learn's digits), text[:train|val] (the standard library's "
    "source as bytes, for the GPT), or FILE.safetensors with tensors x and y (y optional for "
    "inference)."
)


def parse_data(spec: str, *, seq_len: int | None = None, targets: bool = True) -> TensorDataset:
    """The dataset ``spec`` names; ``seq_len`` sizes text windows; ``targets`` whether a file
    must hold ``y``. Refusals are :class:`ConfigError` with the spec in the message."""
    name, _, split = spec.partition(":")
    if name == "digits":
        from distml.data import digits

        if split not in ("", "train", "val", "all"):
            raise ConfigError(f"--data {spec!r}: the digits splits are train, val and all")
        return digits(split or "train")
    if name == "text":
        from distml.data import stdlib_text

        if split not in ("", "train", "val"):
            raise ConfigError(f"--data {spec!r}: the text splits are train and val")
        if seq_len is None:
            raise ConfigError(f"--data {spec!r}: text data is for the GPT (--model gpt)")
        return stdlib_text(split or "train", seq_len)
    return _file_data(Path(spec), targets)


def _file_data(path: Path, targets: bool) -> TensorDataset:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from torch.utils.data import TensorDataset

    if path.suffix != ".safetensors" or not path.is_file():
        raise ConfigError(f"--data {str(path)!r}: no such dataset name or .safetensors file")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"--data {str(path)!r}: not a safetensors file ({exc})") from None
    wanted = {"x", "y"} if targets else {"x"}
    if not wanted <= set(tensors) <= {"x", "y"}:
        raise ConfigError(f"--data {str(path)!r}: expected tensors {sorted(wanted)}")
    x = tensors["x"]
    x = x.float() if x.is_floating_point() else x.long()
    if "y" not in tensors:
        return TensorDataset(x)
    y = tensors["y"]
    if len(y) != len(x):
        raise ConfigError(f"--data {str(path)!r}: x and y differ in length")
    return TensorDataset(x, y.long() if not y.is_floating_point() else y)


def load_client_data(spec: str):
    """A client's local dataset from ``spec`` (see ``distml fl client --data``)."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from torch.utils.data import TensorDataset

    if spec.startswith("digits:"):
        from distml.data import digits

        k, _, n = spec.removeprefix("digits:").partition("/")
        if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
            raise ValueError(f"--data {spec!r}: expected digits:K/N with 0 <= K < N")
        train = digits("train")
        idx = torch.arange(len(train)).tensor_split(int(n))[int(k)]
        return TensorDataset(*(t[idx] for t in train.tensors))
    try:
        tensors = load_file(spec)
    except SafetensorError as exc:
        raise ValueError(f"{spec}: not a safetensors file ({exc})") from None
    if set(tensors) != {"x", "y"} or len(tensors["x"]) != len(tensors["y"]):
        raise ValueError(f"{spec}: expected tensors x and y of the same length")
    return TensorDataset(tensors["x"].float(), tensors["y"].long())
