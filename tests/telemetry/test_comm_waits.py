"""The time a rank spends blocked in communication counts its waits on collectives issued
asynchronously (``Work.wait()``: how FSDP2 and the pipeline wait on gloo), not only the
operators themselves."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distml.comm.accounting import CommAccounting
from distml.net.ports import free_port

pytestmark = pytest.mark.distributed
LATE_S = 0.3  # how long after rank 0 issued its all-gather rank 1 joins it


def _rank(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    store = dist.distributed_c10d._get_default_store()
    x, gathered = torch.full((1024,), float(rank)), torch.empty(2048)
    if rank == 1:
        store.wait(["issued"])  # rank 0 waits on its all-gather from now on
        time.sleep(LATE_S)
        dist.all_gather_into_tensor(gathered, x)
    else:
        original, reports = dist.Work.wait, []
        with CommAccounting(lambda *report: reports.append(report)) as comm:
            work = dist.all_gather_into_tensor(gathered, x, async_op=True)
            store.set("issued", "1")
            work.wait()
        results.update(
            blocked_s=comm.blocked_s,
            reports=reports,
            restored=dist.Work.wait is original,
            gathered=gathered.tolist() == [0.0] * 1024 + [1.0] * 1024,
        )
    dist.barrier()
    dist.destroy_process_group()


def test_a_wait_on_an_asynchronous_collective_is_time_blocked_in_it():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(free_port(), results), nprocs=2)
        results = dict(results)
    assert results["gathered"] and results["restored"]
    assert results["blocked_s"] >= LATE_S, results
    assert ("all_gather", 4096, 4096) in results["reports"]  # its shard; (N-1)/N of 8 KiB
