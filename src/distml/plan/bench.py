"""Measuring this machine for the cost model: matmul FLOP/s, collective and point-to-point
bandwidth, latency, memory. The result is a cluster file (TOML) that ``distml plan`` reads.

Bus bandwidth follows the NCCL-tests definition: an all-reduce of n bytes over d ranks in t
seconds moves ``2*(d-1)/d * n / t`` bytes per second through each rank's link.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w
import torch
import torch.distributed as dist

from distml.config import GPTConfig
from distml.plan.calibration import Calibration
from distml.plan.cost_model import Cluster, Device
from distml.plan.timing import best_time, mean_time, median_time

# pynvml is optional (GPUs only); the profiler's modules load only when a GPT is profiled.


def matmul_flops(
    device: torch.device, n: int = 1024, repeats: int = 5, per_block: int = 4
) -> float:
    """Dense matmul FLOP/s of one worker while every worker of the world computes too (bf16 on
    GPU, fp32 on CPU): workers that share a machine's cores share its FLOP/s, so each block of
    ``per_block`` products starts and ends at a barrier. Median over ``repeats`` blocks."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    together = dist.is_initialized()

    def block() -> None:
        if together:
            dist.barrier()
        for _ in range(per_block):
            torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if together:
            dist.barrier()

    return 2 * n**3 * per_block / median_time(block, repeats)


def bus_bandwidth(
    device: torch.device,
    group: dist.ProcessGroup | None,
    sizes_mb=(1, 4, 16),
    repeats: int = 5,
    time_of: Callable[[Callable[[], Any], int], float] = median_time,
) -> float:
    """The all-reduce bus bandwidth of ``group`` (bytes/s): the best over ``sizes_mb``, each
    size timed over ``repeats`` by ``time_of`` (the median). Every rank of the group calls
    it."""
    ranks = dist.get_world_size(group)
    best = 0.0
    for mb in sizes_mb:
        x = torch.ones(int(mb * 2**18), device=device)  # fp32: mb MiB
        t = time_of(lambda x=x: dist.all_reduce(x, group=group), repeats)
        best = max(best, 2 * (ranks - 1) / ranks * x.numel() * 4 / t)
    return best


def allgather_bandwidth(
    device: torch.device,
    group: dist.ProcessGroup | None,
    shard_mb: float,
    burst: int = 4,
    repeats: int = 5,
) -> float:
    """Bytes/s each rank sends in all-gathers of ``shard_mb`` MiB a rank, ``burst`` of them back
    to back as FSDP gathers one block after another, over ``repeats`` bursts in all
    (all-gather's bus bandwidth in NCCL-tests' terms, ``(d-1)/d`` of the gathered bytes over
    the time). The mean, not the median: on a slow lossy link the bursts' rates are bimodal,
    and a step pays the slow ones too (BENCHMARKS.md, slow links). Every rank of the group
    calls it."""
    ranks = dist.get_world_size(group)
    shard = torch.ones(int(shard_mb * 2**18), device=device)  # fp32: shard_mb MiB
    gathered = torch.empty(ranks * shard.numel(), device=device)

    def gathers() -> None:
        for _ in range(burst):
            dist.all_gather_into_tensor(gathered, shard, group=group)

    return (ranks - 1) * shard.numel() * 4 * burst / mean_time(gathers, repeats)


def exchange_bandwidth(
    device: torch.device, peer: int, message_mb: float = 0.25, burst: int = 4, repeats: int = 5
) -> float:
    """Bytes/s each way while this rank and ``peer`` send each other ``burst`` messages of
    ``message_mb`` MiB at once, as neighbouring pipeline stages do (activations one way, their
    gradients the other), over ``repeats`` bursts in all (the mean, as for
    :func:`allgather_bandwidth`). Both ranks call it."""
    out = torch.ones(int(message_mb * 2**18), device=device)  # fp32: message_mb MiB
    into = torch.empty_like(out)

    def exchange() -> None:
        for _ in range(burst):
            ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    return out.numel() * 4 * burst / mean_time(exchange, repeats)


# The sizes (MiB) at which ``distml bench`` measures between nodes all-gathers (a rank's shard:
# FSDP gathers a block a collective) and both ways at once (a message: a pipeline sends a
# micro-batch's activations). On a slow link either reaches a rate that depends on its size,
# differently at different rates (BENCHMARKS.md, slow links).
ALLGATHER_SHARDS_MB = (0.25, 1.0)
EXCHANGE_MB = (0.125, 0.5)


def node_links(
    device: torch.device, sizes_mb=(0.25, 1, 4), repeats: int = 3, inter_mb: float = 4
) -> dict[str, Any]:
    """Across nodes, the two kinds of link measured apart: inside each node (the node's ranks
    together, every node at once) and between nodes (one rank a node, ``LOCAL_RANK`` 0). The
    ranks of a node are consecutive, as torchrun's launcher numbers them. Every rank calls it;
    ``intra_bw`` is None where a node has one rank.

    Between nodes only a large message (``inter_mb`` MiB) counts for the all-reduce: a
    rate-limited link lets a burst through at once (a token bucket's, a switch's buffer), so a
    small message can measure more than the line rate, which no gradient bucket sees. Its
    figure is the best of 5: what the link carries, where a busy core on either host only
    ever lowers it (the median of 3 by 7% on a 100 Mbit/s link with a core kept busy). Between
    nodes there are two more figures, for the transfers that move differently from an
    all-reduce, each as (bytes, bytes/s) pairs by size: all-gathers by shard
    (``inter_allgather_bw``), and the first two nodes sending each other messages at once
    (``inter_exchange_bw``, each way), in bursts of several as FSDP and a pipeline send them."""
    world, rank = dist.get_world_size(), dist.get_rank()
    nodes = _nodes()
    local = world // nodes
    leaders = dist.new_group([node * local for node in range(nodes)])
    inter, gathers, exchange = 0.0, [0.0] * len(ALLGATHER_SHARDS_MB), [0.0] * len(EXCHANGE_MB)
    if rank % local == 0:
        inter = bus_bandwidth(device, leaders, (inter_mb,), 5, time_of=best_time)
        gathers = [allgather_bandwidth(device, leaders, mb) for mb in ALLGATHER_SHARDS_MB]
        if rank < 2 * local:  # the first two nodes' leaders, both ways at once
            exchange = [exchange_bandwidth(device, local - rank, mb) for mb in EXCHANGE_MB]
    dist.barrier()
    intra = None
    if local > 1:
        own, _ = dist.new_subgroups(group_size=local)
        intra = bus_bandwidth(device, own, sizes_mb, repeats)
    out = torch.tensor(
        [inter, intra or 0.0, *gathers, *exchange], dtype=torch.float64, device=device
    )
    dist.broadcast(out, 0)
    rates = out[2:].tolist()

    def by_size(sizes_mb: tuple[float, ...], values: list[float]) -> list[list[float]]:
        return [[mb * 2**20, bw] for mb, bw in zip(sizes_mb, values, strict=True)]

    return {
        "nodes": nodes,
        "devices_per_node": local,
        "inter_bw": out[0].item(),
        "intra_bw": out[1].item() if local > 1 else None,
        "inter_allgather_bw": by_size(ALLGATHER_SHARDS_MB, rates[: len(ALLGATHER_SHARDS_MB)]),
        "inter_exchange_bw": by_size(EXCHANGE_MB, rates[len(ALLGATHER_SHARDS_MB) :]),
    }


def network(device: torch.device, sizes_mb=(1, 4, 16), repeats: int = 5) -> dict[str, float]:
    """All-reduce bus bandwidth, point-to-point bandwidth (ranks 0 and 1) and small-message
    latency, measured inside a running process group; the same result on every rank."""
    rank = dist.get_rank()
    bus = bus_bandwidth(device, None, sizes_mb, repeats)
    p2p = []
    for mb in sizes_mb:
        x = torch.ones(int(mb * 2**18), device=device)  # fp32: mb MiB
        nbytes = x.numel() * 4

        def ping(x=x) -> None:
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
                dist.send(x, 0)

        p2p.append(2 * nbytes / median_time(ping, repeats))
    tiny = torch.ones(1, device=device)
    latency = median_time(lambda: dist.all_reduce(tiny), repeats * 4)
    out = torch.tensor([bus, max(p2p), latency], dtype=torch.float64, device=device)
    dist.broadcast(out, 0)
    return {"allreduce_bus_bw": out[0].item(), "p2p_bw": out[1].item(), "latency_s": out[2].item()}


def network_of(collectives: dict[str, dict[str, list[float]]], world: int) -> dict[str, float]:
    """What :func:`network` measures, read off a profile's collectives fitted to alpha + n/beta
    (:func:`distml.plan.profile.collective_costs`) instead of timing them again: the world's
    all-reduce at large n has bus bandwidth 2 (w - 1) / w x beta, and alpha is its latency."""
    alpha, beta = collectives["all_reduce"][str(world)]
    return {
        "allreduce_bus_bw": 2 * (world - 1) / world * beta,
        "p2p_bw": collectives["p2p"]["2"][1],
        "latency_s": alpha,
    }


def _board_power_w(device: torch.device) -> float:
    """The GPU's power limit as NVML reports it; an H100 SXM's 700 W where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        return pynvml.nvmlDeviceGetPowerManagementLimit(handle) / 1e3  # milliwatts
    except Exception:  # pynvml absent, or no power reading on this board
        return 700.0


def measure(
    watts_per_core: float = 10.0,
    gpt: GPTConfig | None = None,
    global_batch: int = 16,
    microbatches: int = 8,
    passes: int = 1,
) -> dict[str, Any]:
    """Run inside every worker of a launched world; rank 0's result describes the machine.
    With ``gpt``, also the pieces of its step under every layout of this world with that batch
    (:mod:`distml.plan.profile`, each piece the median of ``passes``), as the cluster file's
    ``[calibration]``."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    # A product large enough to fill a GPU (8192^3 in bf16: about 1 ms on an H100); 1024 keeps a
    # CPU's block under a second.
    matmul_n = 8192 if device.type == "cuda" else 1024
    flops = matmul_flops(device, matmul_n)
    calibration = {}
    if gpt is not None:
        from distml.plan.auto import profile_shapes, sharded_profile_shapes
        from distml.plan.profile import profile_gpt

        world = dist.get_world_size()
        shapes = profile_shapes(gpt, world, global_batch, microbatches)
        sharded = sharded_profile_shapes(gpt, world, global_batch, microbatches)
        calibration = {"calibration": profile_gpt(gpt, shapes, sharded, device, passes=passes)}
        net = network_of(calibration["calibration"]["collectives"], world)
    else:  # across nodes, smaller messages keep a slow link's measurement short
        net = network(device, sizes_mb=(0.25, 1, 4) if _nodes() > 1 else (1, 4, 16))
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
        name = torch.cuda.get_device_name(device)
        power = _board_power_w(device)
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / dist.get_world_size()
        name = "cpu"
        power = watts_per_core * torch.get_num_threads()
    world = dist.get_world_size()
    per_node, intra, inter = world, net["allreduce_bus_bw"], net["allreduce_bus_bw"]
    measured: dict[str, Any] = {"p2p_bw": net["p2p_bw"], "matmul_n": matmul_n}
    between: dict[str, Any] = {}
    if _nodes() > 1:
        links = node_links(device)
        per_node, inter = links["devices_per_node"], links["inter_bw"]
        between = {k: links[k] for k in ("inter_exchange_bw", "inter_allgather_bw")}
        # One rank a node measures no link inside a node: the planner then needs none.
        intra = links["intra_bw"] if links["intra_bw"] is not None else inter
        measured |= {"nodes": links["nodes"], "intra_measured": links["intra_bw"] is not None}
    return {
        "devices": world,
        "devices_per_node": per_node,
        "device": {
            "name": name,
            "memory_bytes": float(memory),
            "peak_flops": flops,
            "intra_bw": intra,
            "inter_bw": inter,
            "latency_s": net["latency_s"],
            "power_w": power,
            **between,
        },
        "measured": measured,
        **calibration,
    }


def _nodes() -> int:
    """Nodes in the world: its ranks over the ranks of one node (torchrun's LOCAL_WORLD_SIZE)."""
    world = dist.get_world_size()
    return world // int(os.environ.get("LOCAL_WORLD_SIZE", world))


def write_cluster_file(result: dict[str, Any], path: Path) -> Path:
    path = Path(path)
    path.write_text(tomli_w.dumps(result))
    return path


def cluster_from_dict(data: dict[str, Any]) -> Cluster:
    """A Cluster from what :func:`measure` returns (a cluster file's contents)."""
    dev = data["device"]
    device = Device(
        str(dev["name"]),
        float(dev["memory_bytes"]),
        float(dev["peak_flops"]),
        float(dev["intra_bw"]),
        float(dev["inter_bw"]),
        float(dev["latency_s"]),
        float(dev["power_w"]),
        inter_allgather_bw=tuple(
            (float(size), float(bw)) for size, bw in dev.get("inter_allgather_bw", ())
        ),
        inter_exchange_bw=tuple(
            (float(size), float(bw)) for size, bw in dev.get("inter_exchange_bw", ())
        ),
    )
    calibration = data.get("calibration")
    return Cluster(
        device,
        int(data["devices"]),
        int(data.get("devices_per_node", 8)),
        Calibration.from_dict(calibration) if calibration else None,
    )


def read_cluster_file(path: Path) -> Cluster:
    """A Cluster from a file written by ``distml bench`` (or by hand, in the same shape)."""
    try:
        return cluster_from_dict(tomllib.loads(Path(path).read_text()))
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"cluster file {path}: {exc!r}") from None
