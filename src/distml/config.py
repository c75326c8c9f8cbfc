"""Every user-facing setting, as typed data validated before any process starts.

A run's resolved configuration is written to ``runs/<name>/config.toml`` and handed to the
workers through the ``DISTML_CONFIG`` environment variable, so that every rank reads the same
object the launcher validated.
"""

from __future__ import annotations

import difflib
import os
import re
import signal
import time
import tomllib
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

CONFIG_ENV = "DISTML_CONFIG"

# One name per concept, imported wherever the concept is used.
StrategyName = Literal["ddp", "local-sgd", "ps"]
Consistency = Literal["bsp", "asp", "ssp"]  # the parameter servers' rules
Schedule = Literal["gpipe", "1f1b", "interleaved"]  # pipeline schedules
Compression = Literal["none", "fp16", "bf16", "powersgd"]  # of DDP's gradients
Precision = Literal["fp32", "bf16", "fp16"]
Recompute = Literal["none", "selective", "full"]  # activation checkpointing
MeshDim = Literal[
    "dp", "fsdp", "tp", "pp"
]  # outermost last: torchtitan's order is pp, dp, fsdp, tp

STRATEGY_NAMES: tuple[str, ...] = get_args(StrategyName)
CONSISTENCIES: tuple[str, ...] = get_args(Consistency)
MESH_DIMS: tuple[str, ...] = get_args(MeshDim)


class ConfigError(ValueError):
    """A setting is invalid. The message is meant for the user, as it is."""


class _Model(BaseModel):
    # TOML has inf and nan; no setting means either (a timeout of inf overflows the clock)
    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        allow_inf_nan=False,
        use_attribute_docstrings=True,  # a field's docstring is its help (distml run --help)
    )


class GPTConfig(_Model):
    """The size of a :class:`distml.models.GPT`; ``mlp_ratio`` x ``hidden`` is the MLP's width."""

    vocab_size: Annotated[int, Field(ge=2)] = 256
    """Tokens in the vocabulary."""
    seq_len: Annotated[int, Field(ge=1)] = 64
    """Longest sequence, in tokens."""
    layers: Annotated[int, Field(ge=1)] = 4
    """Transformer blocks."""
    hidden: Annotated[int, Field(ge=1)] = 128
    """Width of the residual stream."""
    heads: Annotated[int, Field(ge=1)] = 4
    """Attention heads; they divide hidden."""
    mlp_ratio: Annotated[int, Field(ge=1)] = 4
    """The MLP's width, as a multiple of hidden."""

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> GPTConfig:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class StrategyConfig(_Model):
    """How the model is distributed. ``ddp``: synchronous data parallelism (all-reduce every
    step). ``local-sgd``: H local steps, then averaged parameters through an outer optimizer.
    ``ps``: parameter servers hold the parameters (see :class:`PSConfig`)."""

    name: StrategyName = "ddp"
    """ddp, local-sgd or ps."""
    compression: Compression = "none"
    """ddp: how gradients travel (a DDP communication hook)."""
    powersgd_rank: Annotated[int, Field(ge=1)] = 2
    """compression=powersgd: the rank of the low-rank approximation."""
    powersgd_start_iter: Annotated[int, Field(ge=1)] = 2
    """compression=powersgd: plain all-reduce before this step."""
    grad_accum: Annotated[int, Field(ge=1)] = 1
    """Micro-batches a step is cut into; gradients sync on the last."""
    mixed_precision: Precision = "fp32"
    """Autocast dtype of forward and backward."""
    bucket_cap_mb: Annotated[float, Field(gt=0)] | None = None
    """ddp: size of a gradient bucket (none: DDP's default)."""
    sync_every: Annotated[int, Field(ge=1)] = 8
    """local-sgd: local steps between synchronisations (H)."""
    outer_lr: Annotated[float, Field(gt=0)] = 1.0
    """local-sgd: the outer optimizer's rate (1.0 with no momentum: averaging)."""
    outer_momentum: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """local-sgd: the outer Nesterov momentum (DiLoCo: 0.9)."""

    @model_validator(mode="after")
    def _fits_strategy(self) -> StrategyConfig:
        if self.name == "local-sgd" and self.compression != "none":
            raise ValueError("local-sgd averages parameters; gradient compression is for ddp")
        return self


class PSConfig(_Model):
    """A parameter-server job: ``servers`` shards started with the job (or ``addresses`` of
    shards already running, ``distml ps serve``), and the consistency rule they apply.

    ``ssp`` waits while the slowest worker is more than ``staleness`` steps behind. ``bsp``
    completes a step with the first (workers - ``backup_workers``) gradients. A worker silent for
    ``heartbeat_timeout_s`` leaves the barrier until it registers again.
    """

    consistency: Consistency = "bsp"
    """bsp, asp or ssp."""
    staleness: Annotated[int, Field(ge=0)] = 0
    """ssp: steps the fastest worker may run ahead of the slowest."""
    backup_workers: Annotated[int, Field(ge=0)] = 0
    """bsp: gradients a step does not wait for."""
    servers: Annotated[int, Field(ge=1)] = 1
    """Server shards started with the job."""
    addresses: list[str] | None = None
    """URLs of shards already running (distml ps serve), instead of servers."""
    staleness_lr: bool = False
    """Divide a push's learning rate by 1 + its staleness."""
    snapshot_every: Annotated[int, Field(ge=1)] = 50
    """Versions between a shard's snapshots."""
    heartbeat_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """Seconds of silence before a worker leaves the barrier."""
    max_body_mb: Annotated[float, Field(gt=0)] = 256.0
    """Largest request body a shard accepts."""

    @field_validator("addresses")
    @classmethod
    def _urls(cls, v: list[str] | None) -> list[str] | None:
        for url in v or []:
            if not re.fullmatch(r"https?://[^/\s]+/?", url):
                raise ValueError(f"{url!r} is not http(s)://HOST:PORT")
        return v


class ParallelConfig(_Model):
    """How the model is split when the mesh has ``fsdp``, ``tp`` or ``pp`` above 1.

    ``split_points`` name the modules where a new pipeline stage begins (``["blocks.2"]``);
    without them, stages are cut at block boundaries balanced by parameter count.
    ``tp_plan`` maps module names (``fnmatch`` patterns, e.g. ``"blocks.*.mlp.up"``) to
    ``colwise`` or ``rowwise``; without it, the GPT's Megatron plan is used.
    ``reshard_after_forward = false`` keeps FSDP's gathered parameters from forward to backward
    (ZeRO-2-like: one all-gather a step instead of two, at the memory of whole parameters).
    """

    schedule: Schedule = "1f1b"
    """Pipeline schedule."""
    microbatches: Annotated[int, Field(ge=1)] = 4
    """Pipeline micro-batches a step."""
    stages_per_rank: Annotated[int, Field(ge=1)] | None = None
    """Pipeline stages a rank holds (none: 2 if interleaved, else 1)."""
    split_points: list[str] | None = None
    """Modules where a pipeline stage begins (none: balanced blocks)."""
    tp_plan: dict[str, Literal["colwise", "rowwise"]] | None = None
    """Module pattern -> colwise or rowwise (none: the GPT's Megatron plan)."""
    sequence_parallel: bool = False
    """tp: shard norms and dropout along the sequence."""
    activation_checkpointing: Recompute = "none"
    """Recompute activations in backward."""
    reshard_after_forward: bool = True
    """fsdp: free gathered parameters after forward (false: ZeRO-2-like)."""

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages held by each pipeline rank."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.schedule == "interleaved" else 1

    @model_validator(mode="after")
    def _schedule_fits(self) -> ParallelConfig:
        if self.schedule == "interleaved" and self.virtual_stages < 2:
            raise ValueError("the interleaved schedule needs stages_per_rank >= 2")
        if self.schedule != "interleaved" and self.virtual_stages != 1:
            raise ValueError(
                f"stages_per_rank {self.virtual_stages} needs the interleaved schedule"
            )
        return self


class TelemetryConfig(_Model):
    """What every run measures. Energy is estimated from CPU time where no counter exists."""

    straggler_factor: Annotated[float, Field(gt=1.0)] = 1.25
    """A rank this many times slower than the median is a straggler."""
    simulate_straggler: tuple[int, float] | None = None
    """[RANK, FACTOR]: slow one rank's compute, to test the above."""
    watts_per_cpu_core: Annotated[float, Field(gt=0)] = 10.0
    """Power of a busy core, where no energy counter exists."""
    comm_sample_every: Annotated[int, Field(ge=1)] = 20
    """Model-parallel layouts: collectives are intercepted on steps 0, 1 and every N-th."""
    progress: bool = True
    """Show a progress line on the terminal."""
    mlflow_uri: str | None = None
    """Also log the run to MLflow at this tracking URI (e.g. sqlite:///mlflow.db)."""
    mlflow_experiment: Annotated[str, Field(min_length=1)] = "distml"
    """The MLflow experiment a run is logged under."""


RDZV_TIMEOUTS = ("timeout", "join_timeout", "last_call_timeout", "close_timeout", "read_timeout")
_TRUE, _FALSE = ("1", "true", "t", "yes", "y"), ("0", "false", "f", "no", "n")  # torch's words


class RunConfig(_Model):
    """A whole run: where it goes, how many processes, what strategy, what is measured."""

    run_name: str = Field(default_factory=lambda: time.strftime("run-%Y%m%d-%H%M%S"))
    """Folder name under runs_dir (default: run-DATE-TIME)."""
    runs_dir: Path = Path("runs")
    """Where run folders go."""
    nproc: Annotated[int, Field(ge=1)] = 1
    """Worker processes on each node."""
    min_nodes: Annotated[int, Field(ge=1)] = 1
    """Fewest nodes the rendezvous waits for."""
    max_nodes: Annotated[int, Field(ge=1)] = 1
    """Most nodes that may join."""
    node_rank: Annotated[int, Field(ge=0)] | None = None
    """Fixed rank of this node (static rendezvous)."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the rendezvous, for more than one node."""
    rdzv_id: str | None = None
    """The rendezvous id, the same on every node of a run (none: the run name)."""
    rdzv_backend: Literal["c10d", "static"] | None = None
    """c10d or static (none: static where node_rank is given, else c10d)."""
    rdzv_conf: dict[str, int | bool | str] = Field(default_factory=dict)
    """Rendezvous options, in whole seconds: timeout (static), join_timeout, last_call_timeout,
    close_timeout, read_timeout (c10d); and is_host (c10d: this node hosts the store)."""
    local_addr: str | None = None
    """This node's address for the other nodes (none: its address on the route to the
    rendezvous)."""
    role: Annotated[str, Field(pattern=r"^\S{1,128}$")] = "default"
    """The workers' role (ROLE_NAME)."""
    log_dir: Path | None = None
    """Where the workers' logs go (none: logs in the run folder)."""
    redirects: str = "0"
    """Workers' streams into log files: 0 none, 1 stdout, 2 stderr, 3 both; or by local rank,
    as 0:1,1:2."""
    tee: str = "0"
    """Workers' streams into log files and to the console, as redirects."""
    no_python: bool = False
    """Execute the script itself, not through python."""
    run_path: bool = False
    """Run the script with runpy.run_path in the worker (what distml does with any script);
    wins over no_python."""
    monitor_interval: Annotated[float, Field(gt=0)] = 0.1
    """Seconds between the agent's checks on its workers."""
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    """Signals the agent passes on to its workers, comma-separated."""
    max_restarts: Annotated[int, Field(ge=0)] = 0
    """Restarts of the workers after a failure."""
    timeout_s: Annotated[float, Field(gt=0)] = 120.0
    """Seconds before a hung peer counts as failed."""
    seed: int = 0
    """Base random seed, the same on every rank."""
    mesh: dict[str, int] | None = None
    """Device mesh, {dp = N} or e.g. {dp = 2, tp = 2}."""
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    model: GPTConfig | None = None
    ps: PSConfig = Field(default_factory=PSConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    plan: Annotated[dict[str, Any] | None, Field(json_schema_extra={"settable": False})] = None
    """Under --strategy auto: the planner's pick and its prediction, which the run's summary and
    report set beside what the run measured (distml.plan.auto.plan_record)."""

    @field_validator("run_name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", v):
            raise ValueError("use letters, digits, '.', '_' and '-' (it becomes a folder name)")
        return v

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None:
            parse_endpoint(v)
        return v

    @field_validator("rdzv_id")
    @classmethod
    def _safe_id(cls, v: str | None) -> str | None:
        # torch names the workers' log folder after it
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", v):
            raise ValueError("use letters, digits, '.', '_' and '-'")
        return v

    @field_validator("rdzv_conf")
    @classmethod
    def _rdzv_conf(cls, conf: dict[str, int | bool | str]) -> dict[str, int | bool]:
        """torch's rendezvous reads these options as it meets them, one at a time and some
        only on a failure: each is checked here, before anything starts."""
        out: dict[str, int | bool] = {}
        for key, value in conf.items():
            text = str(value).strip().lower()
            if key == "is_host":
                if text not in _TRUE + _FALSE:
                    raise ValueError(f"is_host={value!r}: expected true or false")
                out[key] = text in _TRUE
            elif key in RDZV_TIMEOUTS:
                if isinstance(value, bool) or not text.isdigit() or int(text) < 1:
                    raise ValueError(f"{key}={value!r}: expected whole seconds >= 1")
                out[key] = int(text)
            else:
                known = ", ".join((*RDZV_TIMEOUTS, "is_host"))
                raise ValueError(f"unknown rendezvous option {key!r}; known: {known}")
        return out

    @field_validator("redirects", "tee")
    @classmethod
    def _std(cls, v: str) -> str:
        # torch's Std.from_str takes these forms (and only one-digit local ranks)
        if not re.fullmatch(r"[0-3]|(\d:[0-3],)*\d:[0-3]", v):
            raise ValueError(f"{v!r}: expected 0-3, or LOCAL_RANK:0-3 pairs as 0:1,1:2")
        return v

    @field_validator("signals_to_handle")
    @classmethod
    def _signals(cls, v: str) -> str:
        names = [name.strip() for name in v.split(",")]
        unknown = [n for n in names if not isinstance(getattr(signal, n, None), signal.Signals)]
        if unknown:
            raise ValueError(f"{', '.join(map(repr, unknown))}: not a signal name (SIGTERM, ...)")
        return ",".join(names)

    @field_validator("local_addr")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[\w.:\[\]-]+", v):
            raise ValueError(f"{v!r} is not a host name or address")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.max_nodes < self.min_nodes:
            raise ValueError(f"--nnodes {self.min_nodes}:{self.max_nodes}: MAX is below MIN")
        if self.max_nodes > 1 and self.rdzv_endpoint is None:
            raise ValueError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT")
        if self.node_rank is not None and self.node_rank >= self.max_nodes:
            raise ValueError(f"--node-rank {self.node_rank} is not below --nnodes {self.max_nodes}")
        if self.rdzv_backend == "static" and self.max_nodes > 1:
            if self.node_rank is None:
                raise ValueError("--rdzv-backend static needs --node-rank on every node")
            if self.min_nodes != self.max_nodes:
                raise ValueError("--rdzv-backend static is a fixed world: give --nnodes N")
        if self.mesh is not None and self.min_nodes == self.max_nodes:
            world = self.world_size
            product = 1
            for size in self.mesh.values():
                product *= size
            if product != world:
                dims = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
                raise ValueError(
                    f"mesh {dims} = {product} processes, but the world size is {world} "
                    f"({self.max_nodes} node(s) x {self.nproc} process(es))"
                )
        self._check_model_parallel()
        self._check_ps()
        straggler = self.telemetry.simulate_straggler
        if straggler is not None and self.min_nodes == self.max_nodes:
            rank, factor = straggler
            if not 0 <= rank < self.world_size or factor < 1.0:
                raise ValueError(
                    f"--simulate-straggler {rank}:{factor}: RANK must be in [0, {self.world_size})"
                    " and FACTOR >= 1"
                )
        return self

    def _check_ps(self) -> None:
        if self.strategy.name != "ps":
            return
        ps, workers = self.ps, self.world_size
        if ps.backup_workers >= workers:
            raise ValueError(
                f"--backup-workers {ps.backup_workers} leaves no worker to wait for: "
                f"there are {workers} workers"
            )
        if ps.backup_workers and ps.consistency != "bsp":
            raise ValueError("backup workers are a BSP option; ASP and SSP never wait for all")
        if self.max_nodes > 1 and ps.addresses is None:
            raise ValueError(
                "a parameter-server job across machines needs the servers' --ps-servers URLs "
                "(start them with `distml ps serve`)"
            )
        if self.strategy.compression != "none" or self.strategy.grad_accum != 1:
            raise ValueError("compression and grad_accum are ddp options")

    def _check_model_parallel(self) -> None:
        """Refuse, before anything starts, a layout that the model or the strategy cannot take."""
        mesh = self.mesh or {}
        tp, pp = mesh.get("tp", 1), mesh.get("pp", 1)
        if not any(mesh.get(k, 1) > 1 for k in ("fsdp", "tp", "pp")):
            return
        if self.strategy.name != "ddp":
            raise ValueError(f"--strategy {self.strategy.name} runs on a mesh of dp=N only")
        if self.strategy.compression != "none":
            raise ValueError("gradient compression is for a mesh of dp=N (DDP) only")
        par = self.parallel
        stages = pp * par.virtual_stages
        if pp > 1 and par.split_points is not None and len(par.split_points) != stages - 1:
            raise ValueError(
                f"{len(par.split_points)} split point(s) make {len(par.split_points) + 1} "
                f"stages, but pp={pp} x {par.virtual_stages} stage(s) per rank = {stages}"
            )
        if pp > 1 and self.strategy.grad_accum > 1:
            raise ValueError("with pp > 1 use --microbatches, not grad_accum")
        if pp > 1 and par.microbatches < pp and par.schedule != "gpipe":
            raise ValueError(
                f"the {par.schedule} schedule needs microbatches >= pp: {par.microbatches} < {pp}"
            )
        model = self.model
        if model is None:
            return
        if model.heads % tp:
            raise ValueError(f"heads {model.heads} are not divisible by tp={tp}")
        if (model.mlp_ratio * model.hidden) % tp:
            raise ValueError(
                f"the MLP width {model.mlp_ratio * model.hidden} is not divisible by tp={tp}"
            )
        if pp > 1 and stages > model.layers:
            raise ValueError(
                f"pp={pp} x {par.virtual_stages} stage(s) per rank = {stages} stages, "
                f"but the model has {model.layers} blocks"
            )

    @property
    def world_size(self) -> int:
        return self.max_nodes * self.nproc

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.run_name


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"endpoint {endpoint!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4), as torchrun reads ``--nnodes``."""
    m = re.fullmatch(r"(\d+)(?::(\d+))?", text.strip())
    if not m:
        raise ConfigError(f"--nnodes {text!r}: expected N or MIN:MAX")
    lo = int(m.group(1))
    hi = int(m.group(2) or lo)
    return lo, hi


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=2,tp=2"`` -> {"dp": 2, "tp": 2}."""
    mesh: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, size = part.partition("=")
        if not sep or name not in MESH_DIMS or not size.isdigit() or int(size) < 1:
            raise ConfigError(
                f"--mesh {text!r}: expected NAME=SIZE pairs with NAME in {', '.join(MESH_DIMS)}"
            )
        if name in mesh:
            raise ConfigError(f"--mesh {text!r}: {name} is given twice")
        mesh[name] = int(size)
    if not mesh:
        raise ConfigError(f"--mesh {text!r} names no dimension")
    return mesh


def parse_straggler(text: str) -> tuple[int, float]:
    rank, sep, factor = text.partition(":")
    try:
        return int(rank), float(factor)
    except ValueError:
        raise ConfigError(f"--simulate-straggler {text!r}: expected RANK:FACTOR") from None


def parse_strategy(text: str) -> dict[str, object]:
    """``"ddp"``, ``"ddp:compression=fp16,grad_accum=2"``, ``"local-sgd:8"`` (H = 8) or
    ``"local-sgd:sync_every=8,outer_momentum=0.9"`` -> StrategyConfig fields."""
    name, _, options = text.partition(":")
    if name not in STRATEGY_NAMES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGY_NAMES)}")
    fields: dict[str, object] = {"name": name}
    if name == "ps" and options:
        raise ConfigError("--strategy ps takes no options: use --consistency, --servers, ...")
    if name == "local-sgd" and options.strip().isdigit():
        return {**fields, "sync_every": options.strip()}
    return {**fields, **parse_options(options, f"--strategy {text!r}")}


def parse_consistency(text: str) -> dict[str, object]:
    """``"bsp"``, ``"asp"`` or ``"ssp:S"`` -> PSConfig fields."""
    name, _, bound = text.partition(":")
    if (
        name not in CONSISTENCIES
        or (name == "ssp") != bool(bound)
        or not (bound.isdigit() or not bound)
    ):
        raise ConfigError(f"--consistency {text!r}: expected bsp, asp or ssp:S (S >= 0)")
    return {"consistency": name, "staleness": int(bound or 0)}


def parse_options(text: str, flag: str) -> dict[str, object]:
    """``"layers=4,hidden=128"`` -> {"layers": "4", "hidden": "128"}; pydantic converts the
    values. ``flag`` names the option in the error message."""
    fields: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"{flag}: option {part!r} is not KEY=VALUE")
        fields[key.strip()] = value.strip()
    return fields


def settings(model: type[BaseModel] | None = None, prefix: str = "") -> dict[str, FieldInfo]:
    """Every setting of a run by its dotted key (``ps.servers``), as ``--set KEY=VALUE`` and
    the TOML config name it: the fields of :class:`RunConfig` and of its sections."""
    out: dict[str, FieldInfo] = {}
    for name, info in (model or RunConfig).model_fields.items():
        if (info.json_schema_extra or {}).get("settable") is False:
            continue
        section = _section(info.annotation)
        if section is not None:
            out.update(settings(section, f"{prefix}{name}."))
        else:
            out[prefix + name] = info
    return out


def _section(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (``GPTConfig | None`` counts), if it is a section."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def set_value(fields: dict[str, Any], key: str, value: Any) -> None:
    """Set the setting ``key`` (dotted) in the nested ``fields`` a RunConfig is built from;
    an unknown key is a :class:`ConfigError` that names the nearest known ones."""
    known = settings()
    if key not in known:
        near = difflib.get_close_matches(key, known, n=3)
        hint = f"did you mean {' or '.join(near)}?" if near else "`distml run --help` lists them"
        raise ConfigError(f"unknown setting {key!r}; {hint}")
    *sections, name = key.split(".")
    for section in sections:
        fields = fields.setdefault(section, {})
    fields[name] = value


def parse_assignment(text: str) -> tuple[str, Any]:
    """``"KEY=VALUE"`` (``--set``) -> (key, value). VALUE is read as a TOML value where it is
    one (``4``, ``true``, ``[1, 2.0]``, ``{dp = 2, tp = 2}``) and the setting is not text;
    pydantic validates it either way."""
    key, sep, raw = text.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key:
        raise ConfigError(f"--set {text!r} is not KEY=VALUE")
    info = settings().get(key)
    if info is not None and _type_name(info.annotation).split(" | ")[0] in ("str", "Path"):
        return key, raw
    try:
        return key, tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return key, raw


def describe_settings() -> list[tuple[str, str]]:
    """(``KEY (TYPE) [default: ...]``, what it means) for each setting; for ``--help``."""
    rows = []
    for key, info in settings().items():
        if info.default_factory is not None:
            default = ""
        else:
            default = f" [default: {_toml_text(info.default)}]"
        rows.append((f"{key} ({_type_name(info.annotation)}){default}", info.description or ""))
    return rows


def _toml_text(value: Any) -> str:
    if value is None:
        return "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _type_name(annotation: Any) -> str:
    """``int``, ``fp32|bf16|fp16``, ``float | none``, ``list[str]``: a type as a user reads it."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join("none" if a is type(None) else _type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def build_config(**fields: object) -> RunConfig:
    """Validate settings into a RunConfig, turning pydantic's report into one ConfigError."""
    try:
        return RunConfig(**fields)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def describe_errors(exc: ValidationError, count: int | None = None, whole: str = "") -> str:
    """``where: what`` for the first ``count`` errors of ``exc`` (all by default), joined by
    "; "; ``whole`` names where an error about the input as a whole is. The input values are
    left out: they may be large, or secret."""
    parts = []
    for error in exc.errors(include_url=False)[:count]:
        where = ".".join(str(p) for p in error["loc"]) or whole
        msg = error["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


def format_validation_error(exc: ValidationError) -> str:
    return "invalid configuration: " + describe_errors(exc)


def save_config(config: RunConfig, path: Path) -> None:
    data = _toml_ready(config.model_dump(exclude_none=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(data))


def _toml_ready(value: Any) -> Any:
    """``value`` with paths as text and tuples as lists; TOML's own types (dates among them, which
    a free-form table such as ``[model]`` may hold) are kept, so the file reads back the same."""
    if isinstance(value, dict):
        return {k: _toml_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_toml_ready(v) for v in value]
    return str(value) if isinstance(value, Path) else value


MAX_CONFIG_BYTES = 2**20  # a resolved config.toml is about 1 KB


def load_config(path: Path) -> RunConfig:
    """The run config of the TOML file at ``path``; any file that is not one (too large, not
    UTF-8, not TOML, nested too deeply, invalid settings) is a :class:`ConfigError`."""
    return build_config(**read_toml(path, "config"))


def read_toml(path: Path, what: str = "TOML file") -> dict[str, Any]:
    """The TOML document at ``path``, of at most ``MAX_CONFIG_BYTES``, or :class:`ConfigError`."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{what} {path} is over {MAX_CONFIG_BYTES >> 10} KiB")
        return tomllib.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"cannot read {what} {path}: nested too deeply") from None


def config_from_env() -> RunConfig | None:
    """The config the launcher wrote for this run, or None outside ``distml run``."""
    path = os.environ.get(CONFIG_ENV)
    return load_config(Path(path)) if path else None
