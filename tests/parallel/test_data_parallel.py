"""Oracle: N data-parallel workers with batch B = one process with batch N*B."""

from __future__ import annotations

import pytest
from dp_oracle import BATCH, STEPS, single_process, train_worker

import distml
from conftest import rel_err

pytestmark = pytest.mark.distributed  # every test starts processes


def launch_dp(tmp_path, name: str, nproc: int = 2, **strategy) -> dict:
    return distml.launch(
        train_worker,
        STEPS,
        BATCH,
        nproc=nproc,
        runs_dir=tmp_path,
        run_name=name,
        strategy=strategy,
        telemetry={"progress": False},
    )


@pytest.mark.parametrize("nproc", [2, 4])
def test_n_workers_batch_b_equal_one_process_batch_nb(nproc, tmp_path):
    out = launch_dp(tmp_path, "dp", nproc)
    expected = single_process(STEPS, nproc * BATCH)
    assert rel_err(out["params"], expected) <= 1e-5
    summary = out["summary"]
    assert summary["world_size"] == nproc and summary["steps"] == STEPS
    # Every step all-reduces every fp32 gradient once: 4 bytes per parameter.
    assert summary["comm_bytes"]["all_reduce"] == STEPS * 4 * expected.numel()
    # A ring all-reduce sends 2(N-1)/N of the payload from each rank.
    assert summary["wire_bytes"]["all_reduce"] == pytest.approx(
        STEPS * 4 * expected.numel() * 2 * (nproc - 1) / nproc, rel=1e-6
    )


def test_gradient_accumulation_equals_the_whole_batch(tmp_path):
    out = launch_dp(tmp_path, "accum", grad_accum=4)
    assert rel_err(out["params"], single_process(STEPS, 2 * BATCH)) <= 1e-5
    # Micro-batches under no_sync send nothing: still one all-reduce of the gradients per step.
    assert out["summary"]["comm_bytes"]["all_reduce"] == STEPS * 4 * out["params"].numel()


def test_fp16_compression_halves_the_payload_and_stays_close(tmp_path):
    out = launch_dp(tmp_path, "fp16", compression="fp16")
    numel = out["params"].numel()
    assert out["summary"]["comm_bytes"]["all_reduce"] == STEPS * 2 * numel
    assert rel_err(out["params"], single_process(STEPS, 2 * BATCH)) <= 1e-2


@pytest.mark.parametrize("bucket_cap_mb", [None, 0.0001])
def test_powersgd_sends_low_rank_factors(tmp_path, bucket_cap_mb):
    # A bucket per parameter (0.0001 MB): on gloo the buckets' compressions must not race,
    # or the ranks issue their all-reduces in different orders and abort.
    options = {"powersgd_rank": 1, "powersgd_start_iter": 2, "bucket_cap_mb": bucket_cap_mb}
    out = launch_dp(tmp_path, "psgd", compression="powersgd", **options)
    # Two vanilla steps, then per step: the 32x16 and 10x32 weights as rank-1 factors
    # (32+16 and 10+32 elements), the biases (32 + 10) uncompressed.
    numel = out["params"].numel()
    compressed = (32 + 16) + (10 + 32) + 32 + 10
    expected = 2 * 4 * numel + (STEPS - 2) * 4 * compressed
    assert out["summary"]["comm_bytes"]["all_reduce"] == expected


def test_bf16_mixed_precision_trains_close_to_fp32(tmp_path):
    out = launch_dp(tmp_path, "bf16", mixed_precision="bf16")
    fp32 = single_process(STEPS, 2 * BATCH)
    # bf16 keeps 8 bits of mantissa: a few 1e-3 of drift over 20 steps, but the same training.
    assert 1e-6 < rel_err(out["params"], fp32) <= 5e-2
