"""The distml command: bad input gets one readable message and exit code 2."""

from __future__ import annotations

import json

import pytest
import typer

from conftest import EXAMPLES, distml_cli, distml_invoke
from distml.cli.messages import report_failure

TRAIN = str(EXAMPLES / "digits" / "train.py")
GPT = str(EXAMPLES / "gpt" / "train.py")


@pytest.mark.parametrize(
    "args,message",
    [
        (["run", "--strategy", "zero9", TRAIN], "unknown strategy 'zero9'"),
        (["run", "--nproc", "0", TRAIN], "nproc"),
        (["run", "--nproc", "2", "--mesh", "dp=3", TRAIN], "world size is 2"),
        (
            ["run", "--nproc", "2", "--mesh", "tp=2", "--model", "heads=3,hidden=96", GPT],
            "heads 3 are not divisible by tp=2",
        ),
        (
            ["run", "--nproc", "4", "--mesh", "pp=4", "--model", "layers=2", GPT],
            "pp=4 x 1 stage(s) per rank = 4 stages, but the model has 2 blocks",
        ),
        (
            ["run", "--nproc", "4", "--mesh", "dp=2,tp=4", GPT],
            "mesh dp=2 x tp=4 = 8 processes, but the world size is 4",
        ),
        (
            ["run", "--nproc", "2", "--mesh", "pp=2", "--microbatches", "1", GPT],
            "the 1f1b schedule needs microbatches >= pp: 1 < 2",
        ),
        (["run", "--nproc", "2", "--mesh", "pp=2", "--schedule", "zigzag", GPT], "schedule"),
        (
            ["run", "--nproc", "2", "--mesh", "tp=2", "--strategy", "local-sgd:4", GPT],
            "runs on a mesh of dp=N only",
        ),
        (["run", "--model", "layers", GPT], "option 'layers' is not KEY=VALUE"),
        (["generate", "no-such-run"], "no weights at no-such-run"),
        (["run", "--mesh", "xx=2", TRAIN], "NAME=SIZE"),
        (["run", "no/such/script.py"], "no such script: no/such/script.py"),
        (["run", "--nnodes", "2", TRAIN], "needs --rdzv-endpoint"),
        (["run", "--nnodes", "3:2", "--rdzv-endpoint", "h:1", TRAIN], "MAX is below MIN"),
        (["run", "--rdzv-endpoint", "nohost", TRAIN], "not HOST:PORT"),
        (["run", "--nproc", "2", "--simulate-straggler", "5:2", TRAIN], "RANK must be in"),
        (["run", "--strategy", "ddp:compression=zip", TRAIN], "compression"),
        (["run", "--run-name", "../escape", TRAIN], "run_name"),
        (["run", "--nproc", "two", TRAIN], "--nproc 'two': expected a number, auto, cpu or gpu"),
        (["demo", "--epochs", "0"], "--epochs must be >= 1"),
        (["demo", "--finetune-epochs", "0"], "--finetune-epochs must be >= 1"),
    ],
)
def test_bad_input_exits_2_with_one_message(args, message, tmp_path):
    result = distml_invoke(*args, cwd=tmp_path)
    assert result.exit_code == 2, (result.stderr, result.exception)
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


@pytest.mark.distributed
def test_config_file_is_read_and_flags_override_it(tmp_path):
    # The command as a program: its exit code is the process's.
    (tmp_path / "run.toml").write_text('nproc = 3\n[strategy]\ncompression = "bogus"\n')
    proc = distml_cli("run", "--config", "run.toml", TRAIN, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "strategy.compression" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.distributed
def test_failed_worker_exits_1_and_names_the_rank(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit('rank one gives up')\n"
    )
    proc = distml_cli("run", "--nproc", "2", str(script), cwd=tmp_path, timeout=120)
    assert proc.returncode == 1
    assert "rank 1 (exit code 1)" in proc.stderr


@pytest.mark.distributed
def test_run_module_with_its_arguments(tmp_path):
    (tmp_path / "hello_mod.py").write_text(
        "import os, sys\n"
        "open(f\"out{os.environ['RANK']}.txt\", 'w').write(' '.join(sys.argv[1:]))\n"
    )
    proc = distml_cli(
        "run", "--nproc", "2", "-m", "hello_mod", "--steps", "3", "x", cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [(tmp_path / f"out{r}.txt").read_text() for r in (0, 1)] == ["--steps 3 x"] * 2


@pytest.mark.distributed
def test_a_script_sees_what_python_would_give_it_and_its_exception_is_reported(tmp_path):
    # Workers fork from a fork server and run the script in it: as `python sub/probe.py` would.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helper.py").write_text("VALUE = 'imported from the script folder'\n")
    (tmp_path / "sub" / "probe.py").write_text(
        "import atexit, json, os, sys\n"
        "import helper\n"
        "if __name__ == '__main__':\n"
        "    rank = os.environ['RANK']\n"
        "    atexit.register(lambda: open(f'atexit{rank}', 'w').close())\n"
        "    seen = [sys.argv, sys.path[0], os.getcwd(), helper.VALUE]\n"
        "    open(f'seen{rank}.json', 'w').write(json.dumps(seen))\n"
        "    if rank == '1':\n"
        "        while not os.path.exists('atexit0'):  # rank 0 has ended; else it is stopped\n"
        "            pass\n"
        "        raise ValueError('rank one cannot go on')\n"
    )
    proc = distml_cli("run", "--nproc", "2", "sub/probe.py", "--x", "1", cwd=tmp_path, timeout=120)
    assert proc.returncode == 1
    for rank in (0, 1):
        argv, path0, cwd, value = json.loads((tmp_path / f"seen{rank}.json").read_text())
        assert argv == ["sub/probe.py", "--x", "1"]
        assert path0 == str((tmp_path / "sub").resolve()) and cwd == str(tmp_path)
        assert value == "imported from the script folder"
    assert (tmp_path / "atexit0").exists() and (tmp_path / "atexit1").exists()
    report = proc.stderr[proc.stderr.index("distml run failed") :]
    assert "rank 1 (exit code 1)" in report and "ValueError: rank one cannot go on" in report


def test_a_failure_is_reported_with_its_cause_and_exits_1(capsys):
    with pytest.raises(typer.Exit) as raised:
        report_failure("distml infer failed", RuntimeError("rank 1 (exit code 1)"))
    assert raised.value.exit_code == 1
    assert raised.value.__suppress_context__  # the cause is told, not its traceback
    assert capsys.readouterr().err == "distml infer failed: rank 1 (exit code 1)\n"


@pytest.mark.distributed
def test_the_command_imports_torch_only_for_commands_that_need_it():
    """`distml --help`, `distml plan`, `distml serve router`, `distml preprocess`: none needs
    torch (about 2 s to import), and a replica must set OpenMP's wait policy before it is."""
    import subprocess
    import sys

    code = "import sys, distml.cli.main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
