"""The process grid: world = pp x dp x fsdp x tp, as one DeviceMesh.

The order follows torchtitan: pipeline outermost, tensor parallelism innermost, so that the ranks
of one tensor-parallel group are neighbours (on a GPU cluster, the GPUs of one node). Rank r sits at
``arange(world).reshape(pp, dp, fsdp, tp)[coordinates]``.

>>> dims = ParallelDims.from_mesh({"dp": 2, "tp": 2}, world_size=4)
>>> dims.data_parallel, dims.model_parallel
(2, True)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distml.config import ConfigError

ORDER = ("pp", "dp", "fsdp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    tp: int = 1

    @classmethod
    def from_mesh(cls, mesh: dict[str, int] | None, world_size: int) -> ParallelDims:
        """``mesh=None`` is pure data parallelism over the whole world."""
        dims = cls(**(mesh or {"dp": world_size}))
        if dims.world_size != world_size:
            raise ConfigError(
                f"mesh {dims} = {dims.world_size} processes, but the world size is {world_size}"
            )
        return dims

    def __str__(self) -> str:
        return " x ".join(f"{name}={getattr(self, name)}" for name in ORDER)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.fsdp * self.tp

    @property
    def data_parallel(self) -> int:
        """How many different batches a step sees: replicas x shards."""
        return self.dp * self.fsdp

    @property
    def model_parallel(self) -> bool:
        """True when the model is sharded or split: anything beyond plain DDP."""
        return self.fsdp > 1 or self.tp > 1 or self.pp > 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global ``rank`` sits on the grid: ``{"pp": 0, "dp": 1, "fsdp": 0, "tp": 1}``."""
        coords = {}
        for name in reversed(ORDER):
            size = getattr(self, name)
            coords[name] = rank % size
            rank //= size
        return {name: coords[name] for name in ORDER}

    def data_rank(self, rank: int) -> int:
        """Which of the ``data_parallel`` batches of a step global ``rank`` reads."""
        c = self.coordinates(rank)
        return c["dp"] * self.fsdp + c["fsdp"]

    def stage_leaders(self) -> list[int]:
        """One global rank per pipeline stage: the first of each pp slice of the grid."""
        per_stage = self.world_size // self.pp
        return [k * per_stage for k in range(self.pp)]

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in ORDER}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """All four dimensions, sizes of one included, so that ``mesh["tp"]`` always exists."""
        if not self.model_parallel:
            return init_device_mesh(device_type, (self.dp,), mesh_dim_names=("dp",))
        return init_device_mesh(device_type, tuple(self.as_dict().values()), mesh_dim_names=ORDER)
