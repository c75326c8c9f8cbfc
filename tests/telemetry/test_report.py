"""The HTML run report: self-contained, five embedded PNG plots, survives an empty run."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

from distml.telemetry.report import write_report

_IMG = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def _records(ranks: int, steps: int) -> list[list[dict[str, Any]]]:
    return [
        [
            {
                "step": t,
                "rank": r,
                "loss": 2.0 / (t + 1) + 0.01 * r,
                "samples": 32,
                "step_s": 0.1 + 0.02 * r,
                "compute_s": 0.07 + 0.02 * r,
                "exposed_comm_s": 0.03,
                "sync_wait_s": 0.02 * (1 - r),
                "comm_s": 0.01,
                "comm_bytes": {"all_reduce": 4096},
                "wire_bytes": {"all_reduce": 4096},
                "comm_calls": {"all_reduce": 1},
                "energy_j": 5.0 + t,
                "peak_mem_bytes": 1 << 20,
            }
            for t in range(steps)
        ]
        for r in range(ranks)
    ]


def _summary(name: str) -> dict[str, Any]:
    return {
        "run_name": name,
        "world_size": 2,
        "strategy": {"kind": "ddp"},
        "steps": 5,
        "final_loss": 0.4,
        "eval": {"accuracy": 0.9},
        "samples_per_s": 550.0,
        "comm_bytes": {"all_reduce": 20480},
        "comm_s": 0.05,
        "sync_wait_s": 0.1,
        "compute_s": 0.4,
        "energy_j": 70.0,
        "energy_source": "estimate <tdp>",
        "stragglers": [{"rank": 1, "median_compute_s": 0.09, "ratio": 1.12}],
        "ranks": [
            {
                "rank": r,
                "step_s": 0.5,
                "compute_s": 0.4,
                "comm_s": 0.05,
                "sync_wait_s": 0.05,
                "energy_j": 35.0,
                "peak_mem_bytes": 1 << 20,
            }
            for r in range(2)
        ],
    }


def test_report_is_self_contained(tmp_path: Path) -> None:
    path = write_report(tmp_path, _records(2, 5), _summary("run-<alpha>"))
    assert path == tmp_path / "report.html" and path.exists()
    text = path.read_text(encoding="utf-8")
    assert "run-&lt;alpha&gt;" in text and "run-<alpha>" not in text
    assert text.count('<img src="data:image/png;base64,') == 5
    payloads = _IMG.findall(text)
    assert len(payloads) == 5
    for payload in payloads:
        assert base64.b64decode(payload, validate=True).startswith(b"\x89PNG")
    assert not re.search(r"https?://", text)


def test_empty_run_still_writes_report(tmp_path: Path) -> None:
    summary = {"run_name": "empty", "world_size": 2, "steps": 0, "final_loss": None}
    path = write_report(tmp_path / "out", [[], []], summary)
    text = path.read_text(encoding="utf-8")
    assert "empty" in text and "</html>" in text
    assert "data:image/png" not in text
