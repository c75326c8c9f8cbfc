"""Simulations of many clients in a pool of processes against the real server: the CLI's JSON,
client-level DP against opacus' accountant, and Byzantine clients against robust rules."""

import json
import subprocess
import sys

import pytest
from opacus.accountants import RDPAccountant
from typer.testing import CliRunner

from distml.federated.server import ServerConfig
from distml.federated.strategy import LocalConfig, make_strategy
from distml.jobs.fl_simulation import SimulationConfig, simulate


def distml_fl(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "distml", "fl", *args], capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.mark.distributed
def test_simulate_prints_a_json_line_per_round_and_accounts_privacy(tmp_path):
    result = distml_fl(
        "simulate", "--clients", "20", "--rounds", "3", "--fraction", "0.5",
        "--partition", "dirichlet:0.3", "--dp-noise", "1.0", "--dp-clip", "0.5",
        "--lr", "0.3", "--json", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    rounds, final = lines[:-1], lines[-1]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        assert set(r) == {"round", "status", "participants", "accuracy", "loss", "epsilon",
                          "bytes"}  # fmt: skip
        assert r["participants"] == 10 and r["bytes"] > 0
    # The server's ledger: one RDP step per round at q = 10 / 20, sigma = 1.
    accountant = RDPAccountant()
    for r in rounds:
        accountant.step(noise_multiplier=1.0, sample_rate=0.5)
        assert r["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    assert final["rounds"] == 3 and final["epsilon"] == rounds[-1]["epsilon"]
    assert final["clients"] == 20 and final["partition"] == "dirichlet:0.3"
    assert final["energy_j"] > 0 and final["straggler_wait_s"] >= 0
    history = json.loads((tmp_path / "history.json").read_text())
    assert [h["round"] for h in history] == [1, 2, 3] and history[0]["energy_j"] > 0
    report = (tmp_path / "report.html").read_text()
    assert 'alt="accuracy"' in report and 'alt="epsilon"' in report and 'alt="bytes"' in report


@pytest.mark.parametrize(
    "args, message",
    [
        (["--partition", "zipf"], "expected iid, dirichlet"),
        (["--strategy", "fedmagic"], "unknown strategy"),
        (["--strategy", "krum:f=2"], "strategy krum:"),
        (["--dp-noise", "1.0"], "needs both --dp-noise and --dp-clip"),
        (["--strategy", "median", "--dp-noise", "1", "--dp-clip", "1"], "needs each update"),
        (["--epochs", "0"], "epochs"),
        (["--attack", "nudge:2"], "expected sign-flip:S or scale:S"),
    ],
)
def test_simulate_refuses_bad_settings_before_starting(args, message):
    from distml.cli.main import app

    result = CliRunner().invoke(app, ["fl", "simulate", "--clients", "4", "--rounds", "1", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def run(strategy, attackers, **options):
    local = LocalConfig(epochs=2, batch_size=10, lr=0.3)
    summary = simulate(
        SimulationConfig(clients=20, byzantine=attackers, attack="sign-flip:10"),
        ServerConfig(rounds=12, min_available=20),
        make_strategy(strategy, fraction_fit=0.5, local=local, **options),
    )
    assert summary["rounds"] == 12 and summary["byzantine"] == round(20 * attackers)
    return summary["accuracy"]


@pytest.mark.distributed
def test_robust_rules_withstand_a_fifth_of_byzantine_clients_where_fedavg_collapses():
    # Krum's choice among the same kind of updates is checked in test_strategies.
    clean = run("fedavg", 0.0)
    assert clean > 0.85
    assert run("fedavg", 0.2) < 0.3  # ten times the flipped update outweighs the honest ones
    assert run("median", 0.2) > clean - 0.05
