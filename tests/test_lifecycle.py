"""``distml demo``: the whole lifecycle — preprocess, train, fine-tune, validate, batch inference,
serve, report — each stage checked against the same computation done in this process."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import distml_cli
from distml.data import digits
from distml.data.preprocess import read_manifest
from distml.lifecycle import STAGES, feature_datasets
from distml.models import DigitsCNN

pytestmark = pytest.mark.distributed  # every test starts processes


def test_demo_runs_the_lifecycle_and_each_stage_equals_one_process(tmp_path):
    proc = distml_cli("demo", "--run-name", "demo", cwd=tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "runs" / "demo"
    assert "report: runs/demo/report.html" in proc.stderr
    summary = json.loads((folder / "summary.json").read_text())
    stages = summary["stages"]
    assert list(stages) == [s for s in STAGES if s != "report"]

    # Preprocessing: several shards over the workers; the features are the digits, in order.
    assert stages["preprocess"]["shards"] >= 2 and stages["preprocess"]["rows"] == 1797
    assert read_manifest(folder / "features")["rows"] == 1797
    data = feature_datasets(folder / "features")
    x_all = torch.cat([data["train"].tensors[0], data["val"].tensors[0]])
    expected = digits("all").tensors[0]
    assert torch.equal(x_all.sort(dim=0).values, expected.sort(dim=0).values)
    val_x = digits("val").tensors[0]
    assert torch.equal(data["val"].tensors[0].sort(dim=0).values, val_x.sort(dim=0).values)
    assert torch.equal(data["mirrored_val"].tensors[0], data["val"].tensors[0].flip(-1))

    # Training and fine-tuning measured their costs; the fine-tune adapted to mirrored images.
    for stage in ("train", "fine-tune"):
        assert stages[stage]["comm_bytes"]["all_reduce"] > 0 and stages[stage]["energy_j"] > 0
    assert (folder / "train" / "checkpoint" / "latest").exists()
    assert (folder / "finetune" / "adapter.safetensors").exists()
    scores = stages["validate"]
    assert scores["base_accuracy"] > 0.85
    assert scores["finetuned_accuracy_mirrored"] > scores["base_accuracy_mirrored"] + 0.2

    # Batch inference: the predictions of 2 workers are those of the model in this process.
    model = DigitsCNN()
    model.load_state_dict(load_file(str(folder / "finetune" / "model.safetensors")))
    mirrored_x = data["mirrored_val"].tensors[0]
    with torch.no_grad():
        expected_predictions = model.eval()(mirrored_x).argmax(dim=1)
    written = load_file(str(folder / "predictions.safetensors"))
    assert torch.equal(written["predictions"], expected_predictions)
    assert summary["batch_inference_matches_validation"]

    # Serving: every request answered, by two replicas, as batch inference answered it.
    serve = stages["serve"]
    assert serve["replicas"] == 2 and sum(serve["served_per_replica"]) == serve["requests"] == 16
    assert serve["answers_match_batch_inference"]
    report = (folder / "report.html").read_text()
    assert all(stage in report for stage in stages)
