"""What a step costs on the GPUs users rent: each figure the model needs, and where it is from.

A :class:`Chip` is one GPU as the kernels of a training step see it; a :class:`Network` is the
node it sits in and the fabric between nodes. Both are figures read in public sources, cited
beside each value (where none is published, one derived from another and marked so); none is
fitted to a training run, except :attr:`Chip.sustained`, which ``benchmarks/plan_published.py``
fits (and cross-validates) against published runs.

Sources are cited beside each value by a tag in brackets, listed below.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Sources:
#
# - [A100] NVIDIA A100 Tensor Core GPU datasheet (2021),
#   https://www.nvidia.com/en-us/data-center/a100/ : dense FP16/BF16 312 TFLOP/s, TF32 156,
#   HBM2e 2,039 GB/s (80 GB SXM) and HBM2 1,555 GB/s (40 GB SXM), NVLink 600 GB/s, 400 W.
# - [H100] NVIDIA H100 Tensor Core GPU datasheet (2023),
#   https://www.nvidia.com/en-us/data-center/h100/ : H100 SXM dense BF16 989 TFLOP/s, TF32 494,
#   FP8 1,979, HBM3 3.35 TB/s, NVLink 900 GB/s, 700 W.
# - [H200] NVIDIA H200 datasheet (2024), https://www.nvidia.com/en-us/data-center/h200/ : the
#   H100's tensor cores (BF16 989, FP8 1,979 TFLOP/s dense), 141 GB HBM3e at 4.8 TB/s, 700 W.
# - [B200] NVIDIA DGX B200 datasheet (2024), https://www.nvidia.com/en-us/data-center/dgx-b200/ ,
#   as the B200 column of ml-engineering's H200/B200 comparison quotes it: dense BF16 2,250
#   TFLOP/s, FP8 4,500, about 180 GiB of HBM3e at 8.0 TB/s, 1,000 W; NVLink 5 at 1.8 TB/s.
# - [DGX] NVIDIA DGX A100 and DGX H100 datasheets: 8 GPUs on NVSwitch, 8 single-port ConnectX
#   adapters for the compute fabric, 200 Gb/s HDR InfiniBand (A100) and 400 Gb/s NDR (H100).
# - [MAMF] S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, table
#   "Maximum Achievable Matmul FLOPS comparison" (BF16, best shape found by mamf-finder.py):
#   A100 SXM 267.9 TFLOP/s (85.9%), H100 SXM 792.1 (80.1%), H100/H200 794.5 in a later edition,
#   B200 SXM 1,745 (77.6%); SM counts A100 108, H100 132.
#   https://github.com/stas00/ml-engineering
# - [MMG] NVIDIA, "Matrix Multiplication Background User's Guide" (DU-09799-001, 2023),
#   sections 2.3 (cuBLAS tiles of 128x128 to 256x128 outputs) and 3.1-3.2 (tile and wave
#   quantization): a GEMM runs as tiles of its output, a wave at a time over the SMs.
#   https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/
# - [AZ] Microsoft Azure, AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md,
#   ND_H100_v5_results.md and ND_H200_v5_results.md (2024): STREAM copy 1.61 / 2.90 /
#   4.01 TB/s; flash-attention 2 forward + backward (batch 2, sequence 8192, causal) 179.5 /
#   327.9 / 329.3 TFLOP/s; NCCL all-reduce bus bandwidth of 8 GPUs in a node at 8 GB
#   231.6 / 478.9 / 480.0 GB/s, at 1 KB 0.04 / 0.07 / 0.06 GB/s (about 45 / 26 / 30 us a
#   collective); cuBLASLt GEMMs on A100 (1,024^3 at 119.4 TFLOP/s, 2,048^3 at 221.8, 8,192^3
#   at 253.7, 802,816x192x768 at 157.8). https://github.com/Azure/AI-benchmarking-guide
# - [MSMF] S. Bekman, "Machine Learning Engineering", compute/accelerator/benchmarks/README.md:
#   the sustainable matmul rate (power-saturated, all 8 GPUs busy) against the burst: H200
#   698.6 of 823.9 TFLOP/s (0.85), B200 1,426.4 of 1,751.2 (0.81).
# - [FIT] ``benchmarks/plan_published.py``: :attr:`Chip.sustained`, fitted to the published runs
#   of ``benchmarks/data/published_runs.json`` (zero mean log error per GPU family), and
#   cross-validated there (fitted on half of the sources, tested on the other half). It holds
#   what the kernels' burst rates leave out over a whole run: clocks under power ([MSMF] puts
#   that at about 0.85 on Hopper), the slowest GPU of thousands, and the framework's own time.
# - [NCCL] NVIDIA/nccl-tests issue 290 (2025, an NCCL maintainer): "For NDR @ 400Gbps you should
#   see 46-48GB/s per NIC"; issue 29 (2019): 12.2 GB/s "is as good as you can get" on a 100 Gb/s
#   adapter. https://github.com/NVIDIA/nccl-tests/issues/290


@dataclass(frozen=True)
class Chip:
    """One GPU as a training step's kernels see it."""

    name: str
    memory_bytes: float
    peak_flops: dict[str, float]  # dense tensor-core FLOP/s by input type
    hbm_bw: float  # peak bytes/s
    hbm_achievable: float  # what a streaming kernel reaches (STREAM copy)
    sms: int
    tile: tuple[int, int]  # the output tile a large cuBLAS GEMM runs at
    mamf: float  # best matmul FLOP/s over peak (BF16), over all shapes
    kernel_s: float  # fixed cost of one kernel: launch, prologue, the last wave's tail
    flash_attention_flops: float  # fused attention, forward + backward, causal, FLOP/s
    power_w: float
    sustained: float = 1.0
    """Share of the burst rates a multi-hour run holds (clocks under power and heat, the
    slowest of many GPUs): the one constant fitted to published runs."""

    def peak(self, precision: str) -> float:
        key = {"fp32": "tf32"}.get(precision, precision)
        if key not in self.peak_flops:
            raise ValueError(f"{self.name} has no {precision} tensor cores")
        return self.peak_flops[key]


@dataclass(frozen=True)
class Network:
    """The links a GPU's collectives cross: NVLink inside a node, adapters between nodes."""

    name: str
    gpus_per_node: int
    nvlink_bw: float  # bytes/s per GPU, one direction
    nvlink_busbw: float  # NCCL all-reduce bus bandwidth of a node's GPUs (published)
    nic_bw: float  # bytes/s per GPU to other nodes, line rate
    nic_efficiency: float  # NCCL bus bandwidth across nodes over line rate (published)
    intra_latency_s: float  # one small collective inside a node
    inter_latency_s: float  # one hop of a small collective between nodes

    def with_nic(self, gbit_per_gpu: float) -> Network:
        """The same node on another fabric: ``gbit_per_gpu`` Gb/s for each GPU."""
        return replace(self, nic_bw=gbit_per_gpu * 1e9 / 8)


CHIPS: dict[str, Chip] = {
    "a100": Chip(
        "a100",
        memory_bytes=80e9,  # [A100] 80 GB SXM
        peak_flops={"bf16": 312e12, "fp16": 312e12, "tf32": 156e12},  # [A100]
        hbm_bw=2.039e12,  # [A100]
        hbm_achievable=1.61e12,  # [AZ] ND A100 v4, STREAM copy
        sms=108,  # [MAMF]
        tile=(128, 128),  # [MMG] section 2.3
        mamf=267.9 / 312,  # [MAMF]
        kernel_s=4.5e-6,  # [AZ] 1,024^3 at 119.4 TFLOP/s: 18.0 us, of which 13.5 us the tiles
        flash_attention_flops=179.5e12,  # [AZ] ND A100 v4
        power_w=400.0,  # [A100]
        sustained=0.81,  # [FIT]
    ),
    "h100": Chip(
        "h100",
        memory_bytes=80e9,  # [H100]
        peak_flops={"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp8": 1979e12},
        hbm_bw=3.35e12,  # [H100]
        hbm_achievable=2.90e12,  # [AZ] ND H100 v5, STREAM copy
        sms=132,  # [MAMF]
        tile=(128, 128),  # [MMG] section 2.3; [AZ]'s FP8 GEMMs of 1,024^3 to 4,096^3 fit it
        mamf=792.1 / 989,  # [MAMF]
        kernel_s=4.5e-6,  # [AZ] ND H100 v5 FP8 1,024^3: 7.8 us, of which 3.2 us the tiles
        flash_attention_flops=327.9e12,  # [AZ] ND H100 v5
        power_w=700.0,  # [H100]
        sustained=0.71,  # [FIT]
    ),
}
CHIPS["a100-40gb"] = replace(
    CHIPS["a100"],
    name="a100-40gb",
    memory_bytes=40e9,  # [A100] 40 GB SXM
    hbm_bw=1.555e12,  # [A100]
    hbm_achievable=1.61e12 * 1.555 / 2.039,  # [AZ]'s A100 ratio, at the 40 GB part's peak
)
CHIPS["h200"] = replace(
    CHIPS["h100"],
    name="h200",
    memory_bytes=141e9,  # [H200]
    hbm_bw=4.8e12,  # [H200]
    hbm_achievable=4.01e12,  # [AZ] ND H200 v5, STREAM copy
    mamf=794.5 / 989,  # [MAMF], H100/H200 row of the later edition
    flash_attention_flops=329.3e12,  # [AZ] ND H200 v5
)
CHIPS["b200"] = Chip(
    "b200",
    memory_bytes=180e9,  # [B200]
    peak_flops={"bf16": 2250e12, "fp16": 2250e12, "tf32": 1125e12, "fp8": 4500e12},  # [B200]
    hbm_bw=8.0e12,  # [B200]
    hbm_achievable=8.0e12 * 2.90 / 3.35,  # no published STREAM figure: the H100's share
    sms=148,  # NVIDIA's Blackwell figure for the B200 (not in [B200]'s datasheet table)
    tile=(128, 128),  # [MMG]
    mamf=1745.0 / 2250,  # [MAMF]
    kernel_s=4.5e-6,  # as the H100's
    flash_attention_flops=327.9e12 * 2250 / 989,  # no published figure: the H100's share
    power_w=1000.0,  # [B200]
    # No published run to fit: the Hopper fit, scaled by the two chips' [MSMF] ratios.
    sustained=round(0.71 * (1426.4 / 1751.2) / (698.6 / 823.9), 2),
)

NETWORKS: dict[str, Network] = {
    # DGX A100: NVLink 3 (600 GB/s both ways) on NVSwitch, 8 x 200 Gb/s HDR [A100, DGX].
    "dgx-a100": Network(
        "dgx-a100",
        gpus_per_node=8,
        nvlink_bw=300e9,
        nvlink_busbw=231.6e9,  # [AZ] ND A100 v4, 8 GB
        nic_bw=200e9 / 8,
        nic_efficiency=47.0 / 50.0,  # [NCCL] 46-48 GB/s of NDR's 50
        intra_latency_s=45e-6,  # [AZ] ND A100 v4, 1 KB
        inter_latency_s=20e-6,
    ),
    # DGX H100: NVLink 4 (900 GB/s both ways) on NVSwitch, 8 x 400 Gb/s NDR [H100, DGX].
    "dgx-h100": Network(
        "dgx-h100",
        gpus_per_node=8,
        nvlink_bw=450e9,
        nvlink_busbw=478.9e9,  # [AZ] ND H100 v5, 8 GB, NVLink SHARP
        nic_bw=400e9 / 8,
        nic_efficiency=47.0 / 50.0,  # [NCCL]
        intra_latency_s=26e-6,  # [AZ] ND H100 v5, 1 KB
        inter_latency_s=20e-6,
    ),
}
NETWORKS["hgx-h200"] = replace(
    NETWORKS["dgx-h100"], name="hgx-h200", nvlink_busbw=480.0e9, intra_latency_s=30e-6
)  # [AZ] ND H200 v5
NETWORKS["dgx-b200"] = replace(
    NETWORKS["dgx-h100"],
    name="dgx-b200",
    nvlink_bw=900e9,  # [B200] NVLink 5, 1.8 TB/s both ways
    nvlink_busbw=478.9e9 * 2,  # no published figure: the H100 node's share of its NVLink
)

DEFAULT_NETWORK = {
    "a100": "dgx-a100",
    "a100-40gb": "dgx-a100",
    "h100": "dgx-h100",
    "h200": "hgx-h200",
    "b200": "dgx-b200",
}


def chip(name: str) -> Chip:
    if name not in CHIPS:
        raise ValueError(f"unknown device {name!r}; choose one of: {', '.join(CHIPS)}")
    return CHIPS[name]


def network(name: str) -> Network:
    if name not in NETWORKS:
        raise ValueError(f"unknown network {name!r}; choose one of: {', '.join(NETWORKS)}")
    return NETWORKS[name]
