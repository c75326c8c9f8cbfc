"""How a world of processes is split: one description for the planner and the runtime.

The grid is world = pp x dp x fsdp x tp, in torchtitan's order: pipeline outermost, tensor
parallelism innermost, so that the ranks of one tensor-parallel group are neighbours (on a GPU
cluster, the GPUs of one node). Rank r sits at ``arange(world).reshape(pp, dp, fsdp, tp)[coords]``.
``dp`` ranks hold replicas and ``fsdp`` ranks shards, so a step sees ``dp x fsdp`` batches.

What the ``fsdp`` ranks shard is ZeRO's stage, ``sharding``: 3 the parameters, gradients and
optimizer state (FSDP, the runtime's default), 2 the gradients and optimizer state (FSDP keeping
its gathered parameters from forward to backward), 1 the optimizer state alone (which the planner
models and the runtime does not run). The planner speaks of ``data_parallel`` ranks and a ZeRO
stage (:attr:`Layout.zero`, 0 when nothing is sharded); :meth:`Layout.sharded` builds a layout
in those terms.

>>> layout = Layout.from_mesh({"dp": 2, "tp": 2}, world_size=4)
>>> layout.data_parallel, layout.model_parallel, layout.zero
(2, True, 0)
>>> Layout.sharded(4, zero=2).mesh_sizes()
{'fsdp': 4}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from distml.config import ConfigError, ParallelConfig, Schedule

ORDER = ("pp", "dp", "fsdp", "tp")
RUNNABLE_ZERO = (0, 2, 3)  # the ZeRO stages a distml mesh can express


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    sharding: Literal[1, 2, 3] = 3
    """What the fsdp ranks shard, as a ZeRO stage (ignored when fsdp is 1)."""
    schedule: Schedule = "1f1b"
    chunks: int = 1
    """Model chunks (pipeline stages) a pipeline rank holds: above 1 only when interleaved."""

    def __post_init__(self) -> None:
        for name in (*ORDER, "chunks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"layout {name}={getattr(self, name)} must be at least 1")
        if self.sharding not in (1, 2, 3):
            raise ConfigError(f"sharding is a ZeRO stage 1, 2 or 3, not {self.sharding}")

    @classmethod
    def sharded(
        cls,
        data_parallel: int,
        zero: int = 0,
        *,
        tp: int = 1,
        pp: int = 1,
        schedule: Schedule = "1f1b",
        chunks: int = 1,
    ) -> Layout:
        """The planner's terms: ``data_parallel`` ranks sharing their state as ZeRO ``zero``
        (0: replicas)."""
        if zero == 0 or data_parallel == 1:
            return cls(pp=pp, dp=data_parallel, tp=tp, schedule=schedule, chunks=chunks)
        return cls(
            pp=pp, fsdp=data_parallel, tp=tp, sharding=zero, schedule=schedule, chunks=chunks
        )

    @classmethod
    def from_mesh(
        cls,
        mesh: dict[str, int] | None,
        world_size: int,
        parallel: ParallelConfig | None = None,
    ) -> Layout:
        """A run's layout from its ``mesh`` and ``[parallel]`` settings; ``mesh=None`` is pure
        data parallelism over the whole world."""
        parallel = parallel or ParallelConfig()
        unknown = set(mesh or {}) - set(ORDER)
        if unknown:
            raise ConfigError(f"mesh has unknown dimensions {sorted(unknown)}; use {ORDER}")
        layout = cls(
            **(mesh or {"dp": world_size}),
            sharding=3 if parallel.reshard_after_forward else 2,
            schedule=parallel.schedule,
            chunks=parallel.virtual_stages,
        )
        if layout.world_size != world_size:
            raise ConfigError(
                f"mesh {layout} = {layout.world_size} processes, but the world size is {world_size}"
            )
        return layout

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
    def zero(self) -> int:
        """ZeRO stage of the data-parallel ranks: 0 when nothing is sharded."""
        return self.sharding if self.fsdp > 1 else 0

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
        """Every dimension's size, ones included."""
        return {name: getattr(self, name) for name in ORDER}

    def record(self) -> dict[str, Any]:
        """The layout as summaries and the planner's JSON give it: the grid, the ZeRO stage,
        the schedule."""
        return {
            **self.as_dict(),
            "zero": self.zero,
            "schedule": self.schedule,
            "chunks": self.chunks,
        }

    def mesh_sizes(self) -> dict[str, int]:
        """The run's ``mesh`` setting for this layout: the dimensions above one."""
        return {k: v for k, v in self.as_dict().items() if v > 1} or {"dp": 1}

    def parallel_settings(self) -> dict[str, Any]:
        """The ``[parallel]`` setting a sharding stage needs; the schedule and the stages a
        rank holds are the run's own."""
        if self.zero not in RUNNABLE_ZERO:
            raise ConfigError(f"distml has no ZeRO stage {self.zero}; it offers 0, 2 and 3")
        return {"reshard_after_forward": False} if self.zero == 2 else {}
