"""The multi-process harness shared by the tests."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import ipaddress
import multiprocessing.util
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import is_hypothesis_test, settings

# The suite tests the CPU paths, whose worlds of 2-4 workers would each need a GPU per worker on
# a machine with GPUs: there they are hidden, unless DISTML_TEST_CUDA=1 asks for the CUDA tests
# (tests/parallel/test_cuda.py). Set before anything initialises CUDA, which reads it once.
CUDA_TESTS = os.environ.get("DISTML_TEST_CUDA") == "1"
if not CUDA_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Property tests and fuzzers state their example budgets as CI runs them, under
# `--hypothesis-profile ci` (the README's test command); without it, in a developer's loop, they
# run a tenth of them.
settings.register_profile("ci", max_examples=100)
settings.register_profile("dev", max_examples=10)
settings.load_profile("dev")


def examples(full: int) -> int:
    """``full`` examples under the ``ci`` profile; a tenth of them, at least 5, under ``dev``."""
    return max(5, full * settings.default.max_examples // 100)


ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPTS = Path(__file__).resolve().parent / "launch" / "scripts"


def distml_cli(
    *args: str,
    timeout: float = 240,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    **popen,
):
    """Run ``python -m distml ARGS`` and return the CompletedProcess (text, captured); ``env``
    adds to this process's environment."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "distml", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
        **popen,
    )


def distml_invoke(*args: str, cwd: Path):
    """``distml ARGS`` in this process (typer's runner, in ``cwd``): for commands refused before
    anything starts, whose subprocess would mostly be spent importing torch. The result has
    ``exit_code``, ``stdout`` and ``stderr``."""
    from typer.testing import CliRunner

    from distml.cli.main import app

    before = os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(app, list(args), prog_name="distml")
    finally:
        os.chdir(before)


HELPERS = ("resource_tracker", "forkserver")


def cmdline(pid: int) -> bytes:
    """``pid``'s command line, NUL-separated as /proc has it; empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _process_tree() -> dict[int, int]:
    """Every live process's parent (read from /proc); zombies left out."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z":
            parent[int(entry.name)] = int(fields[1])
    return parent


def _forked_from_fork_server(pid: int, parent: dict[int, int]) -> bool:
    # A fork server's children are forks of it: the same command line as their parent's.
    return b"multiprocessing.forkserver" in cmdline(parent.get(pid, 0))


def _is_multiprocessing_helper(pid: int, parent: dict[int, int]) -> bool:
    # Python's multiprocessing keeps one resource tracker and one fork server (distml.launch's
    # workers fork from it) per parent until it exits; the workers forked from it are not helpers.
    command = cmdline(pid)
    helper = any(f"multiprocessing.{name}".encode() in command for name in HELPERS)
    return helper and not _forked_from_fork_server(pid, parent)


def _descendants(pid: int, parent: dict[int, int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for child, ppid in parent.items():
        children.setdefault(ppid, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def child_pids(pid: int) -> list[int]:
    """Every live descendant of ``pid``; zombies and multiprocessing's resource tracker and fork
    server excluded (the workers forked from the fork server included)."""
    parent = _process_tree()
    return [p for p in _descendants(pid, parent) if not _is_multiprocessing_helper(p, parent)]


def worker_pids(pid: int) -> list[int]:
    """The workers among ``pid``'s descendants: the processes forked from a fork server."""
    parent = _process_tree()
    return [p for p in _descendants(pid, parent) if _forked_from_fork_server(p, parent)]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def remote_preprocess(
    csv: Path, transform: str, out: Path, token: str, **options
) -> tuple[dict, threading.Thread]:
    """A preprocessing coordinator with no local workers, in a thread, once it listens: ``job``
    gets its ``url``, then its ``result`` or its ``error``."""
    from distml.data.preprocess import CsvSource
    from distml.jobs.preprocess import PreprocessError, preprocess

    job: dict = {}
    up = threading.Event()

    def coordinator() -> None:
        try:
            job["result"] = preprocess(
                CsvSource(path=str(csv), blocksize=2048), transform, out, workers=0, token=token,
                on_started=lambda url: (job.update(url=url), up.set()), **options,
            )  # fmt: skip
        except PreprocessError as exc:
            job["error"] = str(exc)

    thread = threading.Thread(target=coordinator, daemon=True)
    thread.start()
    assert up.wait(30)
    return job, thread


def save_dcp_metadata(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path
) -> bytes:
    """The ``.metadata`` DCP writes into ``folder`` for ``model``, ``optimizer`` and a step
    counter, as a run's checkpoint holds them."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "extra": {"step": torch.tensor(1)},
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    return (folder / ".metadata").read_bytes()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every property test (hypothesis's ``@given``) is a ``fuzz`` test: its time is its budget
    of examples (see :func:`examples`)."""
    for item in items:
        if is_hypothesis_test(getattr(item, "obj", None)):
            item.add_marker(pytest.mark.fuzz)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build matplotlib's font list now, before the process guard below is armed: where it has
    no cache yet (a fresh machine, an empty MPLCONFIGDIR) matplotlib runs ``fc-list`` in a
    subprocess the first time it draws, which a test that renders a plot would be refused."""
    import matplotlib.font_manager  # noqa: F401  (its import loads or builds the font list)

    # The launches of this session fork their workers from one fork server, started by the
    # first launch: preloading the model-parallel layout (torch's pipelining, tensor-parallel
    # and FSDP modules, about a second of CPU) there spares each worker of a tensor-, pipeline-
    # or FSDP-parallel test that import, and matplotlib's figures (half a second) each run's
    # rank 0, which draws the report.
    from distml.launch import forkserver

    forkserver.WORKER_PRELOAD.extend(["distml.parallel.layout", "matplotlib.figure"])


class StartsAProcess(RuntimeError):
    """A test that is not marked ``distributed`` tried to start a process."""


TURNS = "DISTML_TEST_TURNS"  # the folder of the lock below, which pytest-xdist's workers share
_turns = pytest.StashKey[tempfile.TemporaryDirectory]()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the process that starts pytest-xdist's workers
        config.stash[_turns] = tempfile.TemporaryDirectory(prefix="distml-tests-")
        os.environ[TURNS] = config.stash[_turns].name  # the workers inherit it


def pytest_unconfigure(config: pytest.Config) -> None:
    if _turns in config.stash:
        config.stash[_turns].cleanup()


@contextlib.contextmanager
def _turn(alone: bool) -> Iterator[None]:
    """Under pytest-xdist, a test's turn beside the other workers' tests: one that must run
    ``alone`` waits for those running to end, and no other starts until it ends. A lock that
    all the run's workers open (flock's shared and exclusive modes), behind a gate that a test
    waiting for its turn alone holds, so that the others' tests cannot keep it waiting."""
    folder = os.environ.get(TURNS)
    if folder is None or "PYTEST_XDIST_WORKER" not in os.environ:  # one process: all alone
        yield
        return
    with open(f"{folder}/gate", "a") as gate, open(f"{folder}/lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            # Unlocked here, not only when closed: a process the test forked holds the files too.
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Run each test in its turn (:func:`_turn`): ``alone`` where it measures the machine's speed
    or, marked ``netns``, builds network namespaces, which are the machine's; and hold the
    ``distributed`` marker true: a test without it (fixtures included) may start no process,
    so that ``pytest -m "not distributed"`` stays the fast loop of in-process tests."""
    alone = any(item.get_closest_marker(name) for name in ("alone", "netns"))
    with _turn(alone):
        yield from _guarded(item)


def _guarded(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("distributed"):
        yield
        return

    def refuse(*args, **kwargs):
        raise StartsAProcess(f"{item.nodeid} starts a process: mark it distributed")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", refuse)
        patch.setattr(multiprocessing.util, "spawnv_passfds", refuse)
        patch.setattr(os, "fork", refuse)
        patch.setattr(os, "posix_spawn", refuse)
        yield


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield


def read_events(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in ``tb_dir``'s event files, by tag, as (step, value), in written order."""
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard is not installed (pip install 'distml[tensorboard]')",
    )
    events = accumulator.EventAccumulator(str(tb_dir), size_guidance={accumulator.SCALARS: 0})
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


# -- jobs on a testbed's hosts (tests/launch/test_multinode.py, tests/testbed) ------------------
@pytest.fixture
def testbed_factory():
    """Build :class:`distml.testbed.Testbed` s for a test (skipped where none can be built);
    each is torn down when the test ends, whatever happened."""
    from distml.testbed import Testbed, TestbedError, unavailable

    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with contextlib.ExitStack() as built:

        def make(hosts: int = 2, rate=None, **options) -> Testbed:
            try:
                return built.enter_context(Testbed(hosts, rate, **options))
            except TestbedError as exc:
                pytest.skip(f"cannot build the testbed: {exc}")

        yield make


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<{path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


def wait_all(procs: dict[str, tuple[subprocess.Popen, Path]], timeout: float) -> dict[str, str]:
    """Wait for every process, killing its process group on timeout. Their outcomes, as
    "exit code N" or "timed out"."""
    deadline = time.monotonic() + timeout
    codes: dict[str, str] = {}
    try:
        for name, (proc, _) in procs.items():
            try:
                code = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
                codes[name] = f"exit code {code}"
            except subprocess.TimeoutExpired:
                codes[name] = f"timed out after {timeout:.0f} s, killed"
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
                proc.wait()
    return codes


def outputs(procs: dict[str, tuple[subprocess.Popen, Path]], codes: dict[str, str]) -> str:
    """Each process's outcome and the tail of its log, for an assertion's message."""
    return "\n".join(
        f"===== {name}: {codes.get(name)} (tail of {log}) =====\n{tail(log)}"
        for name, (_, log) in procs.items()
    )


@pytest.fixture(scope="module")
def digits_cnn_checkpoint(tmp_path_factory) -> Path:
    """An exported DigitsCNN (seed 0), as ``summary.json``'s ``export`` names it."""
    # Imported here, not above: distml is imported after CUDA_VISIBLE_DEVICES is set.
    from safetensors.torch import save_model

    from distml.models import DigitsCNN

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("model") / "model.safetensors"
    save_model(DigitsCNN(), str(path))
    return path


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (its own CA) and its key, as PEM files in ``tmp_path``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    loopback = ipaddress.ip_address("127.0.0.1")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(loopback)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return cert_file, key_file
