"""``distml serve``: the default command and the subcommands coexist, a bad checkpoint is a
usage error, a deployment started from the command line serves and stops cleanly, and a first
run on the loopback without a token makes one, prints it with a request that works, and keeps
it off every command line and log (beyond the loopback it refuses to start without one)."""

from __future__ import annotations

import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
import typer
from safetensors.torch import save_model
from typer.testing import CliRunner

from conftest import child_pids, cmdline
from distml.cli.serve import _stop_on_sigterm, serve_app
from distml.models import DigitsCNN
from distml.net import TOKEN_ENV
from distml.net.ports import free_port

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
@pytest.mark.parametrize("balance", [None, "router"])
def test_serve_command_serves_and_stops(tmp_path, balance):
    """By default (``balance`` None) the replicas share the port on Linux; elsewhere, and with
    ``--balance router``, a router stands in front."""
    save_model(DigitsCNN(), str(tmp_path / "model.safetensors"))
    port = free_port()
    argv = [sys.executable, "-m", "distml.cli.serve", str(tmp_path), "--replicas", "1"]
    argv += ["--model", "digits-cnn", "--port", str(port), "--log-dir", str(tmp_path / "logs")]
    argv += [] if balance is None else ["--balance", balance]
    env = {**os.environ, TOKEN_ENV: TOKEN}
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
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
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    shared = balance is None and sys.platform == "linux"
    assert ("serving 1 replica(s), sharing the port" in err) == shared, err


@pytest.mark.distributed
def test_a_sigterm_before_the_replicas_serve_stops_them_too(tmp_path):
    """Stopped while its replicas are still starting, ``distml serve`` unwinds and exits cleanly
    (a SIGTERM's default action would end it at once, before it stops its replicas)."""
    save_model(DigitsCNN(), str(tmp_path / "model.safetensors"))
    argv = [sys.executable, "-m", "distml.cli.serve", str(tmp_path), "--replicas", "2"]
    argv += ["--model", "digits-cnn", "--port", str(free_port())]
    proc = subprocess.Popen(argv, env={**os.environ, TOKEN_ENV: TOKEN}, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while len(child_pids(proc.pid)) < 2:  # started, not yet serving
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "stopped before the replicas were serving" in err


def test_tls_on_a_shared_port_is_a_usage_error(tmp_path):
    save_model(DigitsCNN(), str(tmp_path / "model.safetensors"))
    command = ["serve", str(tmp_path), "--balance", "kernel", "--ssl-certfile", "c.pem"]
    result = CliRunner().invoke(_root(), command, env={TOKEN_ENV: TOKEN})
    assert result.exit_code == 2 and "--balance router" in result.output, result.output


def test_no_token_beyond_the_loopback_is_a_usage_error():
    runner = CliRunner()
    for command in (
        ["serve", "ckpt", "--host", "0.0.0.0"],
        ["serve", "replica", "ckpt", "--host", "0.0.0.0"],
        ["serve", "replica", "ckpt", "--grpc-port", "9001", "--grpc-host", "0.0.0.0"],
        ["serve", "replica", "ckpt", "--shared-port", "9001", "--shared-host", "0.0.0.0"],
    ):
        result = runner.invoke(_root(), command, env={TOKEN_ENV: None})
        assert result.exit_code == 2, result.output
        assert f"set {TOKEN_ENV}" in result.output and "0.0.0.0" in result.output
        assert "loopback" in result.output
    # A router's token is its replicas': one made for it would fit none of them.
    result = runner.invoke(
        _root(), ["serve", "router", "--replica", "http://a:1"], env={TOKEN_ENV: None}
    )
    assert result.exit_code == 2 and f"set {TOKEN_ENV}" in result.output


def _lines(stream) -> queue.Queue[str]:
    """The lines of ``stream`` as they come, read by a thread (the process keeps writing)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    return lines


@pytest.mark.distributed
def test_a_first_run_on_the_loopback_makes_a_token_and_prints_a_working_request(tmp_path):
    save_model(DigitsCNN(), str(tmp_path / "model.safetensors"))
    port, logs = free_port(), tmp_path / "logs"
    argv = [sys.executable, "-m", "distml.cli.serve", str(tmp_path), "--replicas", "1"]
    argv += ["--model", "digits-cnn", "--port", str(port), "--log-dir", str(logs)]
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    printed = _lines(proc.stderr)
    try:
        deadline, shown = time.monotonic() + 120, []
        while not shown or not shown[-1].lstrip().startswith("curl "):
            assert proc.poll() is None, "".join(shown)
            shown.append(printed.get(timeout=max(0.1, deadline - time.monotonic())))
        curl = shlex.split(shown[-1])
        token = curl[curl.index("-H") + 1].removeprefix("Authorization: Bearer ")
        assert len(token) >= 16 and f"{TOKEN_ENV}={token}" in "".join(shown)
        # The printed request works as it stands, and so does an inference with the token.
        if shutil.which("curl"):
            answer = subprocess.run(curl + ["-sS"], capture_output=True, text=True, timeout=60)
            assert json.loads(answer.stdout)["name"] == "digits-cnn", answer
        url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {token}"}
        x = torch.randn(3, 1, 8, 8)
        item = {"name": "input", "shape": [3, 1, 8, 8], "datatype": "FP32"}
        payload = {"inputs": [{**item, "data": x.flatten().tolist()}]}
        r = httpx.post(url + "/v2/models/digits-cnn/infer", json=payload, headers=auth)
        assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [3, 10]
        assert httpx.post(url + "/v2/models/digits-cnn/infer", json=payload).status_code == 401
        # The replicas got it through their environment: no command line and no log holds it.
        for pid in [proc.pid, *child_pids(proc.pid)]:
            assert token.encode() not in cmdline(pid)
        assert all(token not in log.read_text() for log in logs.iterdir())
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0


def test_a_grpc_port_without_the_grpc_extra_is_a_usage_error(monkeypatch):
    """With grpcio missing, ``--grpc-port`` stops at once with the extra to install."""
    monkeypatch.setitem(sys.modules, "grpc", None)  # what importing an absent package does
    monkeypatch.delitem(sys.modules, "distml.serve.grpc_service", raising=False)
    runner = CliRunner()
    for command in (["serve", "ckpt"], ["serve", "replica", "ckpt"]):
        result = runner.invoke(_root(), [*command, "--grpc-port", "9001"], env={TOKEN_ENV: TOKEN})
        assert result.exit_code == 2, result.output
        assert "pip install 'distml[grpc]'" in result.output


def test_a_sigterm_whose_interrupt_python_ignores_is_still_seen(monkeypatch):
    """The interrupt a SIGTERM raises is lost where it lands in a finalizer (or a callback of
    the import machinery, as it once did in CI): ``distml serve`` still sees the signal came."""
    ignored: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: ignored.append(u.exc_type))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        stopping = _stop_on_sigterm()

        class Finalized:
            def __del__(self) -> None:
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(10_000):  # the handler runs here, and its interrupt is ignored
                    pass

        Finalized()  # collected at once: no KeyboardInterrupt reaches this frame
        assert stopping.is_set()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert ignored == [KeyboardInterrupt]  # "Exception ignored in ...", as Python reports it
