"""Distributed batch inference whose output file equals that of one process.

Rank r predicts a contiguous block of the dataset (:func:`distml.data.eval_shard`: the first
``len mod N`` ranks take one sample more; nothing is padded, nothing dropped), and rank 0
receives every block in rank order, which is input order, and writes one safetensors file:
``outputs`` (the model's output per sample) and, for a classifier, ``predictions`` (the arg-max
class). Blocks travel point to point with their exact shapes, described first as JSON.

Under data parallelism every rank holds the whole model and reads its own block; under a
tensor- or pipeline-parallel layout (a model too big for one device) every rank reads the whole
dataset and the layout's forward computes it together.

>>> run_inference("runs/digits", "digits-cnn", digits("val"), "preds.safetensors", nproc=2)
... # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from distml.comm.collectives import all_gather_json
from distml.config import ConfigError, build_config
from distml.data.sampler import eval_shard
from distml.launch.api import launch
from distml.layout import Layout
from distml.train.checkpoint import check_weights, load_weights, resolve_weights

if TYPE_CHECKING:
    from collections.abc import Callable

    from distml.runtime.context import Context


def _inputs(batch: Any) -> torch.Tensor:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


@torch.no_grad()
def predict(
    forward: Callable[[torch.Tensor], torch.Tensor],
    dataset: Dataset,
    rows: range,
    *,
    device: torch.device,
    batch_size: int = 256,
) -> torch.Tensor | None:
    """``forward``'s outputs for samples ``rows`` of ``dataset``, in order, on the CPU; None
    for no rows (the output's shape is then unknown here)."""
    outputs = [
        forward(_inputs(batch).to(device)).cpu()
        for batch in DataLoader(Subset(dataset, rows), batch_size=batch_size)
    ]
    return torch.cat(outputs) if outputs else None


def gather_blocks(block: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Every rank's block, concatenated in rank order, on rank 0 (None elsewhere); a collective
    of the whole world. Shapes and dtypes are exchanged as JSON, then each block is sent whole:
    no padding, and nothing but tensors travels."""
    mine = None if block is None else [list(block.shape), str(block.dtype).removeprefix("torch.")]
    described = all_gather_json(mine, device)
    rank = dist.get_rank()
    if rank != 0:
        if block is not None:
            dist.send(block.contiguous().to(device), dst=0)
        return None
    blocks = [block] if block is not None else []
    for src, desc in enumerate(described[1:], start=1):
        if desc is None:
            continue
        shape, dtype = desc
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.recv(t, src=src)
        blocks.append(t.cpu())
    return torch.cat(blocks) if blocks else None


def splits_model(mesh: dict[str, int] | None) -> bool:
    """Whether batch inference under ``mesh`` splits the model (tp, pp) or the data (dp=N, or
    no mesh). A mesh that does both, FSDP included, is refused: where the model is split every
    rank reads the whole dataset, so each data-parallel rank would compute the same outputs."""
    layout = Layout(**(mesh or {}))
    if layout.model_parallel and layout.data_parallel > 1:
        raise ConfigError(
            "batch inference splits either the data (dp=N) or the model (tp, pp), not both"
        )
    return layout.model_parallel


def batch_predict(
    ctx: Context, model: nn.Module, dataset: Dataset, *, batch_size: int = 256
) -> torch.Tensor | None:
    """The outputs of ``model`` for the whole ``dataset`` in input order, on rank 0 (None on
    the others); every rank calls it. ``model`` is the plain model: laid out here by the run's
    mesh when it splits the model, else used whole on this rank's block."""
    model.eval()
    if splits_model(ctx.layout.as_dict()):
        ctx.setup(model, None)
        out = predict(
            ctx.forward, dataset, range(len(dataset)), device=ctx.device, batch_size=batch_size
        )
        return out if ctx.rank == 0 else None
    model = model.to(ctx.device)
    rows = eval_shard(dataset, ctx.rank, ctx.world_size)
    block = predict(model, dataset, rows, device=ctx.device, batch_size=batch_size)
    return gather_blocks(block, ctx.device)


def write_predictions(outputs: torch.Tensor, path: Path | str) -> Path:
    """``outputs`` and, for a classifier's (N, classes) scores, their arg-max ``predictions``,
    as one safetensors file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"outputs": outputs.contiguous()}
    if outputs.dim() == 2 and outputs.is_floating_point():
        tensors["predictions"] = outputs.argmax(dim=1)
    save_file(tensors, str(path), metadata={"rows": str(len(outputs))})
    return path


def write_sequences(sequences: list[list[int]], path: Path | str) -> Path:
    """Token sequences of any lengths as one safetensors file, nothing padded: ``tokens``,
    all of them end to end in input order, and ``lengths``, each sequence's length."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = torch.tensor([t for seq in sequences for t in seq], dtype=torch.long)
    lengths = torch.tensor([len(seq) for seq in sequences], dtype=torch.long)
    save_file({"tokens": tokens, "lengths": lengths}, str(path))
    return path


def read_sequences(path: Path | str) -> list[list[int]]:
    """The sequences :func:`write_sequences` wrote, in order."""
    tensors = load_file(str(path))
    return [t.tolist() for t in tensors["tokens"].split(tensors["lengths"].tolist())]


def _inference_worker(
    ctx: Context,
    build: Callable[[], nn.Module],
    source: str,
    dataset: Dataset,
    out: str,
    batch_size: int,
) -> str | None:
    model = build()
    load_weights(model, source)
    outputs = batch_predict(ctx, model, dataset, batch_size=batch_size)
    return str(write_predictions(outputs, out)) if outputs is not None else None


def run_inference(
    source: Path | str,
    build: Callable[[], nn.Module],
    dataset: Dataset,
    out: Path | str,
    *,
    nproc: int = 2,
    mesh: dict[str, int] | None = None,
    batch_size: int = 256,
    **settings: Any,
) -> Path:
    """Predict ``dataset`` with the model ``build()`` makes and the weights of ``source`` (a
    run folder, a checkpoint of any layout or a safetensors file) in ``nproc`` processes;
    returns the output file. ``build`` travels to the workers by value (cloudpickle), as any
    function given to :func:`distml.launch` does."""
    if len(dataset) == 0:
        raise ConfigError("the dataset to predict is empty")
    check_weights(build(), resolve_weights(source))
    config = build_config(nproc=nproc, mesh=mesh, **settings)
    splits_model(config.mesh)  # refuses a mesh that splits both
    args = (build, str(source), dataset, str(out), batch_size)
    return Path(launch(_inference_worker, *args, config=config))
