"""Tune the digits CNN's learning rate, momentum and width, with pruning: an objective for
``distml tune``. Each trial trains in its worker process, in a few seconds on one CPU core.

    distml tune examples/digits/tune.py:objective --trials 30 --workers 2 --direction maximize
    distml tune examples/digits/tune.py:objective --trials 30 --workers 2 --direction maximize \\
        --storage postgresql+psycopg://USER@HOST/DB --study digits          # this host...
    distml tune worker examples/digits/tune.py:objective \\
        --storage postgresql+psycopg://USER@HOST/DB --study digits          # ...and others
    python examples/digits/tune.py --trials 10                              # one process

The trial reports validation accuracy after every epoch; the median pruner stops a trial whose
accuracy falls below the median of earlier trials at the same epoch.
"""

from __future__ import annotations

import argparse

import optuna
import torch
import torch.nn.functional as F

from distml.data import digits
from distml.models import DigitsCNN

EPOCHS = 6
BATCH_SIZE = 64


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(dim=1) == y).float().mean().item()
    model.train()
    return correct


def objective(trial: optuna.Trial) -> float:
    """Validation accuracy of the digits CNN after EPOCHS epochs of SGD (higher is better)."""
    lr = trial.suggest_float("lr", 1e-3, 0.5, log=True)
    momentum = trial.suggest_float("momentum", 0.0, 0.95)
    hidden = trial.suggest_int("hidden", 16, 128, log=True)
    torch.set_num_threads(1)  # the parallelism is in the workers, one trial per core
    torch.manual_seed(trial.number)
    x, y = digits("train").tensors
    x_val, y_val = digits("val").tensors
    model = DigitsCNN(channels=8, hidden=hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    acc = 0.0
    for epoch in range(EPOCHS):
        for batch in torch.randperm(len(y)).split(BATCH_SIZE):
            optimizer.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
        acc = accuracy(model, x_val, y_val)
        trial.report(acc, epoch)
        if trial.should_prune():
            raise optuna.TrialPruned(f"accuracy {acc:.3f} after epoch {epoch}")
    return acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.MedianPruner())
    study.optimize(objective, n_trials=args.trials)
    print(f"best accuracy {study.best_value:.3f} with {study.best_params}")


if __name__ == "__main__":
    main()
