"""A plain torchrun script, no distml inside, that keeps its own checkpoint.

    torchrun --nproc-per-node 2 torchrun_ckpt.py OUT_DIR STEPS [STEP_DELAY_S]

Writes OUT_DIR/ckpt.pt every step (rank 0) and resumes from it; at the end rank 0 writes the
parameters to OUT_DIR/final.safetensors and each rank its pid per attempt to OUT_DIR/pids.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP

out, steps = Path(sys.argv[1]), int(sys.argv[2])
delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
(out / "pids").mkdir(parents=True, exist_ok=True)
(out / "pids" / f"rank{rank}.{os.getpid()}").touch()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
start = 0
ckpt = out / "ckpt.pt"
if ckpt.exists():
    state = torch.load(ckpt, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    start = int(state["step"])
model = DDP(model)

for step in range(start, steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    time.sleep(delay)
    if rank == 0:
        state = {
            "model": model.module.state_dict(),
            "optim": optimizer.state_dict(),
            "step": step + 1,
        }
        torch.save(state, out / "ckpt.tmp")
        os.replace(out / "ckpt.tmp", ckpt)
    dist.barrier()

if rank == 0:
    save_file(
        {k: v.contiguous() for k, v in model.module.state_dict().items()}, out / "final.safetensors"
    )
dist.destroy_process_group()
