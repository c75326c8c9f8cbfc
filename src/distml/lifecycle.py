"""The whole lifecycle of a model, distributed, on one machine: what ``distml demo`` runs.

1. **preprocess** — scikit-learn's digits, written out as a raw CSV, are cut into shards that
   worker processes turn into features: pixels scaled to [0, 1], and each image mirrored (the
   new scanner the model will be adapted to). Parquet parts out.
2. **train** — data-parallel SGD of a CNN on the features, a checkpoint per epoch.
3. **fine-tune** — from that checkpoint, LoRA adapters (the base frozen) learn the mirrored
   images, in worker processes again.
4. **validate** — distributed validation of the base and the fine-tuned model, on held-out
   images of both kinds.
5. **batch inference** — the fine-tuned model predicts every held-out mirrored image, the data
   sharded over the workers, the predictions written in input order.
6. **serve** — two replicas behind the load-balancing router; a few requests, whose answers
   must be those of batch inference.
7. **report** — one page with what each stage did, took and cost.

Everything lands in one folder::

    runs/<name>/raw/digits.csv            the input
    runs/<name>/features/                 the preprocessed parts
    runs/<name>/train/, finetune/         two run folders, each with its own report
    runs/<name>/predictions.safetensors   batch inference's output
    runs/<name>/serve/                    the replicas' logs
    runs/<name>/summary.json, report.html the lifecycle's
"""

from __future__ import annotations

import json
import secrets
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import torch
import torch.nn.functional as F
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

from distml.config import RunConfig
from distml.data.datasets import digits_arrays, holdout_indices
from distml.data.digit_features import PIXELS
from distml.data.preprocess import CsvSource, read_table
from distml.data.preprocess.reader import column_tensor
from distml.jobs.finetune import FineTuneSpec, run_finetune
from distml.jobs.infer import run_inference
from distml.jobs.preprocess import preprocess
from distml.jobs.replicas import ReplicaCommand, ReplicaSet
from distml.launch.api import launch
from distml.models import DigitsCNN
from distml.net import BackgroundServer
from distml.runtime.context import Context
from distml.serve.protocol import InferRequest, RequestInput
from distml.serve.router import Router
from distml.serve.router_app import create_router_app
from distml.telemetry.lifecycle_report import write_lifecycle_report

TRANSFORM = "distml.data.digit_features:digit_features"  # torch-free: what the workers import
MODEL = "digits-cnn"
STAGES = ("preprocess", "train", "fine-tune", "validate", "batch inference", "serve", "report")


# -- 1. preprocess -----------------------------------------------------------------------------


def write_raw_digits(path: Path) -> int:
    """scikit-learn's digits as the raw CSV a preprocessing job starts from: ``id, val, label``
    and the 64 pixel intensities (0-16); ``val`` marks :func:`distml.data.digits`'s held-out
    rows. Returns the number of rows."""

    images, labels = digits_arrays()
    pixels = images.reshape(len(labels), PIXELS).numpy().astype(np.int64)
    n = len(labels)
    val = np.zeros(n, dtype=np.int8)
    val[holdout_indices(n, "val").numpy()] = 1
    columns = {"id": np.arange(n), "val": val, "label": labels.numpy()}
    columns.update({f"p{i}": pixels[:, i] for i in range(PIXELS)})
    path.parent.mkdir(parents=True, exist_ok=True)
    pacsv.write_csv(pa.table(columns), str(path))
    return n


def preprocess_digits(folder: Path, workers: int) -> dict[str, Any]:

    raw = folder / "raw" / "digits.csv"
    rows = write_raw_digits(raw)
    # Blocks of ~64 KiB: the 1,797 rows (~300 KiB) make several shards for the workers.
    result = preprocess(
        CsvSource(path=str(raw), blocksize=64 * 1024),
        TRANSFORM,
        folder / "features",
        workers=workers,
    )
    return {
        "rows": rows,
        "shards": len(result.manifest["parts"]),
        "retried": result.stats["retried"],
        "workers": workers,
        "seconds": result.seconds,
        "output": str(folder / "features"),
    }


def feature_datasets(features: Path | str) -> dict[str, TensorDataset]:
    """The preprocessed digits as four datasets: ``train`` and ``val``, and the same images
    mirrored, ``mirrored_train`` and ``mirrored_val``; images (N, 1, 8, 8), labels."""

    table = read_table(features, ["val", "label", "x", "x_mirrored"])
    held_out = column_tensor(table["val"]).bool()
    y = column_tensor(table["label"]).long()
    out = {}
    for prefix, column in (("", "x"), ("mirrored_", "x_mirrored")):
        x = column_tensor(table[column]).float().view(-1, 1, 8, 8)
        out[prefix + "train"] = TensorDataset(x[~held_out], y[~held_out])
        out[prefix + "val"] = TensorDataset(x[held_out], y[held_out])
    return out


# -- 2. train ------------------------------------------------------------------------------------


def train_digits(
    ctx: Context, features: str, epochs: int, batch_size: int = 32, lr: float = 0.05
) -> dict[str, Any]:
    """One rank of the training run: data-parallel SGD on the preprocessed digits, a checkpoint
    per epoch (a restarted run resumes from it), validation on both kinds of held-out image."""
    data = feature_datasets(features)
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.dataloader(data["train"], batch_size=batch_size)
    ctx.load_checkpoint()
    while loader.epoch < epochs:
        for x, y in loader:
            ctx.train_step((x, y), lambda b: F.cross_entropy(model(b[0]), b[1]))
        ctx.save_checkpoint()
    mirrored = ctx.evaluate(model, data["mirrored_val"])
    return ctx.finish(
        eval={**ctx.evaluate(model, data["val"]), "mirrored_accuracy": mirrored["accuracy"]}
    )


def _costs(summary: dict[str, Any]) -> dict[str, Any]:
    """The costs of distribution a run measured."""
    keys = ("wall_s", "steps", "comm_bytes", "sync_wait_s", "energy_j", "energy_source")
    return {k: summary.get(k) for k in keys}


# -- 3. fine-tune, 4. validate -----------------------------------------------------------------


def finetune_mirrored(
    folder: Path, base: Path, data: dict[str, TensorDataset], nproc: int, epochs: int
) -> dict[str, Any]:
    """LoRA adapters of rank 4 on the CNN's Linear layers, the rest frozen, on mirrored images."""

    spec = FineTuneSpec(model=MODEL, base=base, lora_r=4, epochs=epochs, global_batch=32, lr=0.02)
    return run_finetune(
        spec,
        data["mirrored_train"],
        data["mirrored_val"],
        nproc=nproc,
        runs_dir=folder,
        run_name="finetune",
    )


# -- 5. batch inference ------------------------------------------------------------------------


def batch_inference(
    folder: Path, model_dir: Path, val: TensorDataset, nproc: int
) -> dict[str, Any]:

    x, y = val.tensors
    started = time.perf_counter()
    out = run_inference(
        model_dir, DigitsCNN, TensorDataset(x), folder / "predictions.safetensors", nproc=nproc
    )
    seconds = time.perf_counter() - started
    predictions = load_file(str(out))["predictions"]
    return {
        "samples": len(y),
        "workers": nproc,
        "seconds": seconds,
        "accuracy": int((predictions == y).sum()) / len(y),  # as ctx.evaluate counts it
        "output": str(out),
        "predictions": predictions,
    }


# -- 6. serve ------------------------------------------------------------------------------------


def serve_and_query(
    model_dir: Path, images: torch.Tensor, log_dir: Path, *, replicas: int = 2, rows: int = 8
) -> dict[str, Any]:
    """Serve ``model_dir`` from ``replicas`` processes behind a router in this process, send
    ``images`` as requests of ``rows`` images each over HTTP, return the answers and latencies."""

    token = secrets.token_urlsafe(24)
    command = ReplicaCommand(str(model_dir), MODEL, max_batch_size=32)
    started = time.perf_counter()
    with ReplicaSet(command, replicas, token, log_dir=log_dir) as replica_set:
        replica_set.wait_ready()
        router = Router(replica_set.urls, token)
        with BackgroundServer(create_router_app(router, token)) as server:
            ready_s = time.perf_counter() - started
            answers, latencies = [], []
            headers = {"Authorization": f"Bearer {token}"}
            with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
                for chunk in images.split(rows):
                    item = RequestInput(
                        name="input",
                        shape=list(chunk.shape),
                        datatype="FP32",
                        data=chunk.flatten().tolist(),
                    )
                    sent = time.perf_counter()
                    response = http.post(
                        f"/v2/models/{MODEL}/infer",
                        json=InferRequest(inputs=[item]).model_dump(exclude_none=True),
                    )
                    latencies.append(time.perf_counter() - sent)
                    response.raise_for_status()
                    out = response.json()["outputs"][0]
                    logits = torch.tensor(out["data"]).view(out["shape"])
                    answers.append(logits.argmax(dim=1))
            served = [_requests_served(url, headers) for url in replica_set.urls]
    return {
        "replicas": replicas,
        "requests": len(latencies),
        "rows_per_request": rows,
        "ready_s": ready_s,
        "latency_ms_p50": 1000 * statistics.median(latencies),
        "latency_ms_max": 1000 * max(latencies),
        "served_per_replica": served,
        "answers": torch.cat(answers),
    }


def _requests_served(url: str, headers: dict[str, str]) -> int:
    """Inference requests a replica answered, from its Prometheus ``/metrics``."""

    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "distml_replica_requests_total"
            and sample.labels.get("outcome") == "ok"
        )
    )


# -- the whole of it -------------------------------------------------------------------------------


def run_lifecycle(
    config: RunConfig,
    *,
    epochs: int = 8,
    finetune_epochs: int = 8,
    serve_requests: int = 16,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every stage into ``config.run_dir`` with ``config.nproc`` workers; returns the
    summary that ``summary.json`` holds."""

    folder = config.run_dir
    nproc = config.nproc
    stages: dict[str, dict[str, Any]] = {}

    def timed(
        name: str, what: str, fn: Callable[[], dict[str, Any]], keep: Callable = dict
    ) -> dict[str, Any]:
        """Run a stage; its record in the summary is ``keep(result)`` and the seconds."""
        log(f"[{STAGES.index(name) + 1}/{len(STAGES)}] {name}: {what}")
        started = time.perf_counter()
        result = fn()
        stages[name] = {"seconds": time.perf_counter() - started, **keep(result)}
        return result

    timed(
        "preprocess",
        f"the raw digits CSV into features, {nproc} workers",
        lambda: preprocess_digits(folder, nproc),
    )
    data = feature_datasets(folder / "features")

    train_config = config.model_copy(update={"runs_dir": folder, "run_name": "train"})
    train = timed(
        "train",
        f"a CNN, data parallel over {nproc} processes, {epochs} epochs",
        lambda: launch(train_digits, str(folder / "features"), epochs, config=train_config),
        keep=_costs,
    )

    finetune = timed(
        "fine-tune",
        "LoRA adapters for mirrored images, from the training checkpoint",
        lambda: finetune_mirrored(
            folder, folder / "train" / "checkpoint", data, nproc, finetune_epochs
        ),
        keep=_costs,
    )
    stages["validate"] = {
        "seconds": 0.0,  # inside the two runs: each evaluated in its worker processes
        "base_accuracy": train["eval"]["accuracy"],
        "base_accuracy_mirrored": train["eval"]["mirrored_accuracy"],
        "finetuned_accuracy_mirrored": finetune["eval"]["accuracy"],
    }
    validate = stages["validate"]
    log(
        f"[4/{len(STAGES)}] validate, on held-out mirrored images: accuracy "
        f"{validate['base_accuracy_mirrored']:.3f} before fine-tuning, "
        f"{validate['finetuned_accuracy_mirrored']:.3f} after"
    )

    inference = timed(
        "batch inference",
        f"the fine-tuned model over the held-out mirrored images, {nproc} workers",
        lambda: batch_inference(folder, folder / "finetune", data["mirrored_val"], nproc),
    )
    predictions = stages["batch inference"].pop("predictions")

    images = data["mirrored_val"].tensors[0][: serve_requests * 8]
    timed(
        "serve",
        f"2 replicas behind the router, {serve_requests} requests",
        lambda: serve_and_query(folder / "finetune", images, folder / "serve"),
    )
    answers = stages["serve"].pop("answers")
    stages["serve"]["answers_match_batch_inference"] = bool(
        torch.equal(answers, predictions[: len(answers)])
    )

    consistent = inference["accuracy"] == finetune["eval"]["accuracy"]
    summary = {
        "run_name": config.run_name,
        "workers": nproc,
        "seconds": sum(s["seconds"] for s in stages.values()),
        "stages": stages,
        "runs": {"train": str(folder / "train"), "fine-tune": str(folder / "finetune")},
        "batch_inference_matches_validation": consistent,
    }
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["report"] = str(write_lifecycle_report(folder, summary))
    log(f"[{len(STAGES)}/{len(STAGES)}] report: {summary['report']}")
    return summary
