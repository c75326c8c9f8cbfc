"""Start-up: how long ``distml.launch`` takes to run a trivial function in N workers, against
torch's elastic launcher with spawned workers (what torchrun does for a function), same run.

    python benchmarks/launch.py                 # 2 workers, 5 launches of each
    python benchmarks/launch.py --nproc 4 --repeats 9

Each launch runs, in every worker, what a training function needs before its first step: join
the process group (gloo, a c10d rendezvous on loopback) and pass a barrier; the launch returns
rank 0's value. distml's workers fork from a fork server that imported torch once; the peer's
are spawned, and each imports torch. The first distml launch, which starts the fork server, is
reported apart from the median of the others. The rows alternate, so that the machine's drift
falls on both.

Then the commands, each a new process as a user types it: ``distml run --nproc N SCRIPT`` against
``torchrun --standalone --nproc-per-node N SCRIPT``, SCRIPT a torchrun script that joins the
group and passes a barrier. distml's workers fork from a fork server it starts as the command
begins; torchrun's are new interpreters.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from typing import Any

from _common import machine_info, median, print_table, scratch_dir, spread, write_json

import distml
from distml.net.ports import free_port


def joined(ctx: distml.Context) -> int:
    """distml's worker: the Context has joined the group; one barrier, as a step would."""
    import torch.distributed as dist

    dist.barrier()
    return ctx.world_size


def torch_worker() -> int:
    """The peer's worker: what a function under torchrun does first."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    world = dist.get_world_size()
    dist.destroy_process_group()
    return world


def torch_launch(nproc: int) -> Any:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    return elastic_launch(config, torch_worker)()[0]


SCRIPT = """\
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def command(argv: list[str], cwd: str) -> bool:
    subprocess.run(argv, cwd=cwd, check=True, capture_output=True)
    return True


def timed(fn, *args) -> float:
    start = time.perf_counter()
    out = fn(*args)
    assert out is not None
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    times: dict[str, list[float]] = {"distml": [], "torch": []}
    with scratch_dir("launch") as tmp:

        def distml_launch(i: int) -> Any:
            return distml.launch(
                joined,
                nproc=args.nproc,
                runs_dir=tmp,
                run_name=f"launch-{i}",
                telemetry={"progress": False},
            )

        first = timed(distml_launch, 0)
        for i in range(args.repeats):
            times["torch"].append(timed(torch_launch, args.nproc))
            times["distml"].append(timed(distml_launch, i + 1))

        script = tmp / "barrier.py"
        script.write_text(SCRIPT)
        n = str(args.nproc)
        argvs = {
            "distml run": [sys.executable, "-m", "distml", "run", "--nproc", n, str(script)],
            "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node", n, str(script)],
        }  # fmt: skip
        for _ in range(args.repeats):
            for name, argv in argvs.items():
                times.setdefault(name, []).append(timed(command, argv, str(tmp)))
    med = {k: median(v) for k, v in times.items()}
    out = {
        "machine": machine_info(),
        "args": vars(args),
        "first_distml_s": first,
        "times_s": times,
        "median_s": med,
        "speedup": med["torch"] / med["distml"],
        "command_speedup": med["torchrun"] / med["distml run"],
    }
    rows = [
        ["distml.launch, first (starts the fork server)", f"{first:.2f}", "-"],
        ["distml.launch, later", f"{med['distml']:.2f}", spread(times["distml"])],
        ["torch elastic_launch, spawn", f"{med['torch']:.2f}", spread(times["torch"])],
        [f"distml run --nproc {n} SCRIPT", f"{med['distml run']:.2f}", spread(times["distml run"])],
        [f"torchrun --nproc-per-node {n} SCRIPT", f"{med['torchrun']:.2f}",
         spread(times["torchrun"])],
    ]  # fmt: skip
    print_table(
        f"Launching {args.nproc} workers into a process group "
        f"(distml {out['speedup']:.1f}x faster after its first launch; "
        f"distml run {out['command_speedup']:.2f}x torchrun)",
        ["launch", "median s", "spread"],
        rows,
    )
    print(f"results: {write_json('launch', out)}")


if __name__ == "__main__":
    main()
