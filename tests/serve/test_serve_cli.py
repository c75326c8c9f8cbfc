"""``distml serve``: the default command and the subcommands coexist, a bad checkpoint is a
usage error, and a deployment started from the command line serves and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
import typer
from safetensors.torch import save_model
from typer.testing import CliRunner

from distml.cli.serve import serve_app
from distml.launch.elastic import free_port
from distml.models import DigitsCNN
from distml.net import TOKEN_ENV

TOKEN = "serving-cli-token-0123456789"


def _root() -> typer.Typer:
    """``serve_app`` mounted the way ``distml`` mounts it."""
    root = typer.Typer()

    @root.command()
    def other() -> None: ...

    root.add_typer(serve_app, name="serve")
    return root


def test_checkpoint_first_means_deploy():
    runner = CliRunner()
    assert "serve deploy" in runner.invoke(_root(), ["serve", "ckpt", "--help"]).output
    assert "serve replica" in runner.invoke(_root(), ["serve", "replica", "--help"]).output
    assert "serve router" in runner.invoke(_root(), ["serve", "router", "--help"]).output


def test_missing_checkpoint_or_token_is_a_usage_error(tmp_path):
    runner = CliRunner()
    args = ["serve", str(tmp_path / "none"), "--model", "digits-cnn"]
    result = runner.invoke(_root(), args, env={TOKEN_ENV: TOKEN})
    assert result.exit_code == 2 and "no checkpoint" in result.output
    assert runner.invoke(_root(), args, env={TOKEN_ENV: "short"}).exit_code == 2


def test_a_batch_larger_than_the_row_cap_is_a_usage_error(tmp_path):
    runner = CliRunner()
    for command in (["serve", "ckpt"], ["serve", "replica", "ckpt"]):
        args = [*command, "--max-batch-size", "64", "--max-batch-rows", "8"]
        result = runner.invoke(_root(), args, env={TOKEN_ENV: TOKEN})
        assert result.exit_code == 2, result.output
        assert "--max-batch-rows (8)" in result.output


@pytest.mark.distributed
def test_serve_command_serves_and_stops(tmp_path):
    save_model(DigitsCNN(), str(tmp_path / "model.safetensors"))
    port = free_port()
    argv = [sys.executable, "-m", "distml.cli.serve", str(tmp_path), "--replicas", "1"]
    argv += ["--model", "digits-cnn", "--port", str(port), "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.Popen(argv, env={**os.environ, TOKEN_ENV: TOKEN})
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {TOKEN}"}
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(url + "/v2/health/ready", headers=auth).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        x = torch.zeros(2, 1, 8, 8)
        payload = {
            "inputs": [
                {
                    "name": "input",
                    "shape": [2, 1, 8, 8],
                    "datatype": "FP32",
                    "data": x.flatten().tolist(),
                }
            ]  # noqa: E501
        }
        r = httpx.post(url + "/v2/models/digits-cnn/infer", json=payload, headers=auth)
        assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [2, 10]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0
