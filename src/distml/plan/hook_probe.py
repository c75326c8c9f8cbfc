"""What torch's PowerSGD hook costs a step on this machine, on its own: the cost model counts
its bytes on the links, and this is the rest (the matrices it multiplies and orthogonalises,
its error feedback, its bookkeeping per tensor): on CPU workers, milliseconds a step even for
a small model (8 ms for examples/gpt's GPT of 0.87 M parameters at one thread), as much as its
bytes take on a link of about 100 Mbit/s.

The hook's work depends on the gradients' shapes alone, not on the model that computes them:
the probe holds parameters of the model's shapes, in its order, whose backward pass costs next
to nothing, so that any model the planner describes can be probed without running it. The hook
is timed from inside, installed as distml installs it on gloo (one bucket at a time), under a
DDP of one process whose collectives cost nothing. That world of one lives in a process of its
own (``python -m distml.plan.hook_probe``), so that the planner's process (``distml plan``, the
launcher of ``distml run --strategy auto``) never joins a distributed world nor keeps gloo's
threads.

>>> powersgd_hook_s(gpt_shapes(GPTConfig()), ranks=(2, 8), threads=1)  # doctest: +SKIP
{2: 0.0091, 8: 0.0098}
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

PROBE_MAX_PARAMS = 100e6
"""The largest model probed: the probe holds its parameters, their gradients and PowerSGD's
error feedback (12 bytes a parameter), and a step of the hook grows with the model."""


def powersgd_hook_s(
    shapes: Sequence[Sequence[int]],
    ranks: Sequence[int],
    threads: int,
    steps: int = 9,
    start_iter: int = 2,
) -> dict[int, float]:
    """Seconds a step the hook of each rank in ``ranks`` spends on its own for gradients of
    ``shapes`` (a model's parameters, in its order), computing on ``threads`` threads as a
    worker would: the median over ``steps`` steps past its plain start. Raises
    ``RuntimeError`` where the probe fails."""
    request = {"shapes": [list(shape) for shape in shapes], "ranks": list(ranks),
               "threads": threads, "steps": steps, "start_iter": start_iter}  # fmt: skip
    argv = [sys.executable, "-m", "distml.plan.hook_probe", json.dumps(request)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise RuntimeError("the PowerSGD probe failed: no answer in 300 s") from None
    if done.returncode != 0:
        raise RuntimeError(f"the PowerSGD probe failed: {done.stderr.strip()[-2000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])  # the last line is the probe's
    return {int(rank): seconds for rank, seconds in answer.items()}


def _time_hooks(
    shapes: list[list[int]], ranks: list[int], steps: int, start_iter: int
) -> dict[int, float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from distml.config import StrategyConfig
    from distml.parallel.data import choose_hook

    class Weights(torch.nn.Module):
        """Parameters of the model's shapes, in its order; the loss, half their squared sum,
        hands backward each one's gradient (itself) last parameter first, as a model does."""

        def __init__(self) -> None:
            super().__init__()
            self.weights = torch.nn.ParameterList(torch.randn(shape) for shape in shapes)

        def forward(self) -> torch.Tensor:
            return sum((w * w).sum() for w in self.weights) / 2

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    costs = {}
    for rank in ranks:
        torch.manual_seed(0)
        model = DistributedDataParallel(Weights())
        compression = StrategyConfig(
            compression="powersgd", powersgd_rank=rank, powersgd_start_iter=start_iter
        )
        hook, state = choose_hook(compression, None)  # as a run installs it on this gloo world
        spent = [0.0]

        def timed(state, bucket, hook=hook, spent=spent):  # noqa: ANN001, ANN202
            start = time.perf_counter()
            future = hook(state, bucket)
            spent[0] += time.perf_counter() - start
            return future

        model.register_comm_hook(state, timed)
        per_step = []
        for step in range(start_iter + 1 + steps):  # the plain steps, a first compressed one
            spent[0] = 0.0
            model().backward()
            if step > start_iter:
                per_step.append(spent[0])
        costs[rank] = statistics.median(per_step)
    return costs


def main(argv: list[str]) -> None:
    import torch

    request = json.loads(argv[0])
    torch.set_num_threads(request["threads"])
    costs = _time_hooks(
        request["shapes"], request["ranks"], request["steps"], request["start_iter"]
    )
    print(json.dumps(costs))


if __name__ == "__main__":
    main(sys.argv[1:])
