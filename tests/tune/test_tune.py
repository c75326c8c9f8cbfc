"""Tuning with real worker processes on a real SQLite database: the known minimum of a
quadratic is found by two workers that share the trials, the median pruner stops the worse
trials, a SIGKILLed job resumes to exactly its budget (a stale trial keeps its place for its
retry), and the digits example learns and prunes."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from conftest import EXAMPLES, read_events, wait_for
from distml.tune import build_tune_config, load_objective, open_storage, tune
from distml.tune.budget import SURPLUS, BudgetSpent, gate
from distml.tune.job import run_folder
from distml.tune.liveness import WORKER, mark_ended, mark_started
from distml.tune.storage import GRACE_FACTOR
from distml.tune.study import prepare_study

HERE = Path(__file__).resolve().parent
HOLD_ENV = "DISTML_TEST_HOLD"  # see objectives.held_quadratic
OBJECTIVES = HERE / "objectives.py"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def objective(name: str) -> str:
    return f"{OBJECTIVES}:{name}"


def sqlite_url(folder: Path) -> str:
    return f"sqlite:///{folder / 'study.db'}"


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """Jobs write their event files under ./runs: here, the test's own folder."""
    monkeypatch.chdir(tmp_path)


def trials_of(url: str, study_name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study_name, storage=open_storage(url)).get_trials()


def pid_of(trial: optuna.trial.FrozenTrial) -> int:
    return trial.user_attrs[WORKER]["pid"]


def run_job(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a job to its end; on a timeout, kill it with its workers before failing."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def real_failures(trials: list[optuna.trial.FrozenTrial]) -> list[int]:
    return [
        t.number for t in trials if t.state == TrialState.FAIL and not t.user_attrs.get(SURPLUS)
    ]


@pytest.mark.distributed
def test_two_workers_find_the_known_minimum_and_share_the_trials(tmp_path):
    url = sqlite_url(tmp_path)
    result = tune(
        objective("quadratic"), n_trials=24, workers=2, storage=url, seed=0, pruner="none"
    )
    assert (result.complete, result.pruned, result.failed) == (24, 0, 0)
    # The minimum of (x - 2)^2 is 0 at x = 2. TPE's best after 24 trials was below 0.2 for
    # each of 150 seeds (one process); 0.5 leaves room for two workers' interleaving.
    assert result.best_value < 0.5
    assert result.best_value == pytest.approx((result.best_params["x"] - 2.0) ** 2)
    trials = trials_of(url, result.study_name)
    assert sum(t.state in FINISHED for t in trials) == 24 and not real_failures(trials)
    pids = {pid_of(t) for t in trials if t.state == TrialState.COMPLETE}
    assert len(pids) == 2 and os.getpid() not in pids
    first, second = trials[0], trials[1]  # they wait for each other: run at once, apart
    assert pid_of(first) != pid_of(second)
    assert first.datetime_start < second.datetime_complete
    assert second.datetime_start < first.datetime_complete


@pytest.mark.distributed
def test_the_median_pruner_stops_the_worse_trials(tmp_path, monkeypatch):
    url = sqlite_url(tmp_path)
    result = tune(
        objective("staircase"),
        n_trials=16,
        workers=2,
        storage=url,
        seed=1,
        pruner="median:startup=3",
        runs_dir=tmp_path / "runs",
    )
    assert result.finished == 16 and result.failed == 0
    assert result.pruned >= 1 and result.complete >= 3
    trials = trials_of(url, result.study_name)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    assert all(len(t.intermediate_values) == 5 for t in complete)
    assert all(len(t.intermediate_values) < 5 for t in pruned)
    # Every curve is x * (step + 1): the trial of the smallest x is never above a median, so
    # the best trial is never pruned.
    assert min(t.params["x"] for t in complete) < min(t.params["x"] for t in pruned)
    # The study as TensorBoard has it, read back with tensorboard's own reader (float32).
    events = read_events(tmp_path / "runs" / run_folder(result.study_name) / "tb")

    def same(tag: str, expected: list[tuple[int, float]]) -> None:
        assert [step for step, _ in events[tag]] == [step for step, _ in expected]
        assert [v for _, v in events[tag]] == pytest.approx([v for _, v in expected], rel=1e-6)

    for t in complete + pruned:
        same(f"trial{t.number}/reported", sorted(t.intermediate_values.items()))
    ordered = sorted(complete, key=lambda t: t.number)
    same("value", [(t.number, t.value) for t in ordered])
    best = [min(t.value for t in ordered[: i + 1]) for i in range(len(ordered))]
    same("best_value", [(t.number, b) for t, b in zip(ordered, best, strict=True)])

    # Without a pruner every trial runs to the end. The objective is a function this time:
    # the workers import it by its module's name, from this process's sys.path.
    monkeypatch.syspath_prepend(str(HERE))
    staircase = importlib.import_module("objectives").staircase
    flat = tune(staircase, n_trials=4, workers=1, storage=url, seed=1, pruner="none")
    assert flat.study_name == "objectives:staircase"
    assert (flat.complete, flat.pruned) == (4, 0)


@pytest.mark.distributed
def test_a_killed_job_resumes_to_exactly_its_trials(tmp_path):
    url, study, n_trials = sqlite_url(tmp_path), "resume", 10
    argv = [sys.executable, "-m", "distml.cli.tune", objective("held_quadratic")]
    argv += ["--trials", str(n_trials), "--workers", "2", "--storage", url, "--study", study]
    argv += ["--heartbeat", "1", "--seed", "0", "--pruner", "none"]
    storage = open_storage(url)

    def count(state: TrialState) -> int:
        """Trials in ``state``; the running ones only once they have sampled their x."""
        try:
            study_id = storage.get_study_id_from_name(study)
        except KeyError:
            return 0
        trials = storage.get_all_trials(study_id, deepcopy=False, states=(state,))
        return sum(state != TrialState.RUNNING or "x" in t.params for t in trials)

    hold = tmp_path / "hold"
    hold.touch()  # trials 3 and up wait while it exists: the job is mid-run when killed
    env = {**os.environ, HOLD_ENV: str(hold)}
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(argv, stdout=log, stderr=log, env=env, start_new_session=True)
        try:
            wait_for(
                lambda: count(TrialState.COMPLETE) == 3 and count(TrialState.RUNNING) == 2,
                timeout=90,
                what="3 complete trials and 2 running, held",
            )
        finally:
            os.killpg(first.pid, signal.SIGKILL)  # the job and its workers
            first.wait()
    hold.unlink()
    before = {t.number: t for t in trials_of(url, study)}
    killed = [n for n, t in before.items() if t.state == TrialState.RUNNING]
    done = {n: t.value for n, t in before.items() if t.state == TrialState.COMPLETE}
    assert len(killed) == 2 and len(done) == 3

    second = run_job(argv + ["--json"])
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["finished"] == n_trials

    after = trials_of(url, study)
    by_number = {t.number: t for t in after}
    assert sum(t.state in FINISHED for t in after) == n_trials
    assert {n: by_number[n].value for n in done} == done  # earlier results kept
    retries = {t.system_attrs["failed_trial"]: t for t in after if "failed_trial" in t.system_attrs}
    for n in killed:
        assert by_number[n].state == TrialState.FAIL  # failed once its heartbeat went stale
        assert retries[n].state in FINISHED  # and run again, with the same parameters
        assert retries[n].params == by_number[n].params


class StaleFailure:
    """A study of 3 trials: 2 complete and one started by a worker that died in it, which
    another worker has just failed for its stale heartbeat, as Optuna's ``fail_stale_trials``
    does it: the FAIL first, then, in a second write, the retry queued."""

    def __init__(self, folder: Path, *, ended: bool = False):
        url, name = sqlite_url(folder), "stale"
        config = build_tune_config(
            objective=objective("quadratic"), n_trials=3, storage=url, study_name=name
        )
        prepare_study(config, open_storage(url))
        self.grace_s = GRACE_FACTOR * 1  # a heartbeat every second
        self.storage = open_storage(url, heartbeat_s=1)
        self.study = optuna.load_study(study_name=name, storage=self.storage)
        for _ in range(2):
            done = self.study.ask()
            self.study.tell(done, done.suggest_float("x", 0, 1))
        self.dead = self.study.ask()
        self.dead.suggest_float("x", 0, 1)
        mark_started(self.dead, self.storage, self.study._study_id)
        if ended:
            mark_ended(self.dead)
        self.storage.set_trial_state_values(self.dead._trial_id, TrialState.FAIL)

    def queue_retry(self) -> None:
        retry = self.storage.get_heartbeat_stale_trial_callback()
        retry(self.study, self.storage.get_trial(self.dead._trial_id))


# Optuna warns that a heartbeat is meant for study.optimize; these tests drive ask and tell.
ignore_heartbeat_warning = pytest.mark.filterwarnings("ignore:Heartbeat of storage")


@ignore_heartbeat_warning
def test_a_trial_failed_as_stale_holds_its_place_until_its_retry_is_queued(tmp_path):
    stale = StaleFailure(tmp_path)
    newcomer = stale.study.ask()  # taken between the failure and the retry
    with pytest.raises(BudgetSpent):
        gate(newcomer, 3, stale.grace_s)
    stale.study.tell(newcomer, state=TrialState.FAIL)
    stale.queue_retry()
    retry = stale.study.ask()
    assert retry.params == stale.dead.params  # the queued retry, not a new sample
    gate(retry, 3, stale.grace_s)  # the place is the retry's: it runs


@ignore_heartbeat_warning
def test_a_stale_trial_whose_retry_never_comes_frees_its_place_after_the_grace(tmp_path):
    stale = StaleFailure(tmp_path)  # the worker that failed it died before queuing the retry
    gate(stale.study.ask(), 3, grace_s=0)


@ignore_heartbeat_warning
def test_a_trial_whose_objective_raised_frees_its_place_at_once(tmp_path):
    stale = StaleFailure(tmp_path, ended=True)
    gate(stale.study.ask(), 3, stale.grace_s)


@pytest.mark.distributed
def test_a_trial_whose_worker_died_before_it_started_does_not_hold_the_job(tmp_path):
    # A trial created and never run: RUNNING, with neither a heartbeat nor a worker's mark.
    url, name = sqlite_url(tmp_path), "orphan"
    config = build_tune_config(
        objective=objective("quadratic"), n_trials=3, storage=url, study_name=name, pruner="none"
    )
    orphan = prepare_study(config, open_storage(url)).ask()
    result = tune(
        config.objective,
        n_trials=3,
        workers=1,
        storage=url,
        study_name=name,
        heartbeat_s=1,
        pruner="none",
    )
    assert (result.complete, result.failed) == (3, 1)
    assert trials_of(url, name)[orphan.number].state == TrialState.FAIL


@pytest.fixture(scope="module")
def digits_objective():
    return load_objective(f"{EXAMPLES / 'digits' / 'tune.py'}:objective")


def test_the_digits_example_learns_reports_each_epoch_and_prunes(digits_objective):
    study = optuna.create_study(
        direction="maximize", pruner=optuna.pruners.MedianPruner(n_startup_trials=1)
    )
    study.enqueue_trial({"lr": 0.1, "momentum": 0.9, "hidden": 64})
    study.enqueue_trial({"lr": 0.001, "momentum": 0.0, "hidden": 16})  # barely moves
    study.optimize(digits_objective, n_trials=2)
    good, bad = study.trials
    assert good.state == TrialState.COMPLETE and good.value > 0.9
    assert len(good.intermediate_values) == 6
    assert bad.state == TrialState.PRUNED and len(bad.intermediate_values) < 6
