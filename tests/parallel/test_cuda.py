"""The CUDA paths, on whatever GPUs the machine has: NCCL process groups, DDP with device ids,
fp16 with a gradient scaler, NVML energy, the GPU's matmul rate. Each against its one-process
oracle on the CPU. Run with DISTML_TEST_CUDA=1 (the rest of the suite hides the GPUs, see
conftest.py); skipped where torch sees no GPU (CI has none)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dp_oracle import BATCH, STEPS, single_process, train_worker
from gpt_oracle import single_process as gpt_single_process
from gpt_oracle import train as gpt_train

import distml
from conftest import EXAMPLES, distml_cli, rel_err

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device, and DISTML_TEST_CUDA=1"
    ),
    pytest.mark.distributed,
]


def on_gpu(ctx: distml.Context, fn, *args) -> dict:
    """``fn(ctx, *args)`` with its tensors brought back to the CPU, and where it ran."""
    out = fn(ctx, *args)
    backend = str(dist.get_backend(ctx.mesh.get_group() if ctx.mesh is not None else None))
    params = out.get("params")
    return {
        **out,
        "params": params.cpu() if isinstance(params, torch.Tensor) else params,
        "device": str(ctx.device),
        "backend": backend,
    }


def launch_one_gpu(tmp_path, name: str, fn, *args, **strategy) -> dict:
    return distml.launch(
        on_gpu,
        fn,
        *args,
        nproc=1,
        runs_dir=tmp_path,
        run_name=name,
        strategy=strategy,
        telemetry={"progress": False},
    )


def test_a_gpu_worker_trains_as_one_cpu_process(tmp_path):
    out = launch_one_gpu(tmp_path, "fp32", train_worker, STEPS, BATCH)
    assert out["device"] == "cuda:0" and "nccl" in out["backend"]
    assert rel_err(out["params"], single_process(STEPS, BATCH)) <= 1e-4
    summary = out["summary"]
    assert summary["steps"] == STEPS
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert summary["energy_source"].startswith("estimated:")
    else:  # every GPU since Volta counts its energy
        assert summary["energy_source"] == "measured:nvml" and summary["energy_j"] > 0


def test_fp16_with_a_gradient_scaler_trains_close_to_fp32(tmp_path):
    out = launch_one_gpu(tmp_path, "fp16", train_worker, STEPS, BATCH, mixed_precision="fp16")
    # fp16 keeps 11 bits of mantissa: a drift of a few 1e-3 over 20 steps, the same training.
    assert 1e-7 < rel_err(out["params"], single_process(STEPS, BATCH)) <= 5e-2


def test_the_gpt_on_a_gpu_equals_one_cpu_process(tmp_path):
    out = launch_one_gpu(tmp_path, "gpt", gpt_train, str(tmp_path))
    ref = gpt_single_process()
    assert rel_err(torch.tensor(out["losses"]), torch.tensor(ref["losses"])) <= 1e-4


def test_more_workers_than_gpus_is_refused_before_they_start(tmp_path):
    nproc = torch.cuda.device_count() + 1
    proc = distml_cli(
        "run",
        "--nproc",
        str(nproc),
        "--runs-dir",
        str(tmp_path),
        str(EXAMPLES / "digits" / "train.py"),
    )
    assert proc.returncode == 2, proc.stderr
    assert "NCCL needs a device of its own for each process" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_times_the_gpu_matmul_under_its_datasheet_peak():
    from distml.plan.bench import matmul_flops

    flops = matmul_flops(torch.device("cuda"), 8192)
    # Dense bf16 peaks of the fastest boards (H100/H200 SXM: 989 TFLOP/s, B200: 2.25 PFLOP/s); a
    # rate above them would mean the timing missed the kernels' end. Below 1 TFLOP/s, not a GPU.
    assert 1e12 < flops < 2.5e15
