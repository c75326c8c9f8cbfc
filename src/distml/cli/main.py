"""The ``distml`` command."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from distml.cli.messages import err, fail_usage, report_failure
from distml.config import (
    ConfigError,
    RunConfig,
    build_config,
    describe_settings,
    load_config,
    parse_assignment,
    parse_consistency,
    parse_mesh,
    parse_nnodes,
    parse_options,
    parse_straggler,
    parse_strategy,
    set_value,
)
from distml.launch.slurm import slurm_settings

app = typer.Typer(
    name="distml",
    help="Distributed machine learning for PyTorch, from one laptop to a cluster.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _default_nproc() -> int:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def resolve_run_config(config_file: Path | None, assignments: list[tuple[str, Any]]) -> RunConfig:
    """The settings ``assignments`` (dotted key, value; later ones win) over the config file
    over defaults, validated as one RunConfig."""
    fields: dict[str, Any] = {}
    if config_file is not None:
        fields = load_config(config_file).model_dump(exclude_unset=True)
    for key, value in assignments:
        set_value(fields, key, value)
    if "nproc" not in fields:
        fields["nproc"] = _default_nproc()
    return build_config(**fields)


def parse_nproc(text: str | int) -> int:
    """``--nproc``: a number, or torchrun's ``auto`` (the GPUs, else the cores), ``gpu`` or
    ``cpu`` (the cores)."""
    text = str(text).strip()
    if text.isdigit():
        return int(text)
    if text in ("auto", "gpu", "cpu"):
        import torch  # only for these words: `distml run --help` does not import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if text == "gpu" and not gpus:
            raise ConfigError("--nproc gpu: this machine has no GPU")
        return gpus if text != "cpu" and gpus else os.cpu_count() or 1
    raise ConfigError(f"--nproc {text!r}: expected a number, auto, cpu or gpu")


def _each(prefix: str, parse: Callable[[str], dict[str, Any]]) -> Callable[[Any], list]:
    return lambda text: [(prefix + k, v) for k, v in parse(text).items()]


# The short flags of `distml run`, each a name for one or more settings (`--set KEY=VALUE`
# reaches every setting, with no flag of its own): flag -> the settings its value gives.
ALIASES: dict[str, Callable[[Any], list[tuple[str, Any]]]] = {
    "nproc": lambda text: [("nproc", parse_nproc(text))],
    "nnodes": lambda text: list(zip(("min_nodes", "max_nodes"), parse_nnodes(text), strict=True)),
    "node_rank": lambda n: [("node_rank", n)],
    "rdzv_endpoint": lambda text: [("rdzv_endpoint", text)],
    "rdzv_id": lambda text: [("rdzv_id", text)],
    "rdzv_backend": lambda text: [("rdzv_backend", text)],
    "rdzv_conf": lambda text: [("rdzv_conf", parse_options(text, f"--rdzv-conf {text!r}"))],
    "role": lambda text: [("role", text)],
    "log_dir": lambda path: [("log_dir", path)],
    "redirects": lambda text: [("redirects", text)],
    "tee": lambda text: [("tee", text)],
    "local_addr": lambda text: [("local_addr", text)],
    "no_python": lambda on: [("no_python", True)] if on else [],
    "run_path": lambda on: [("run_path", True)] if on else [],
    "monitor_interval": lambda s: [("monitor_interval", s)],
    "signals_to_handle": lambda text: [("signals_to_handle", text)],
    "max_restarts": lambda n: [("max_restarts", n)],
    "run_name": lambda text: [("run_name", text)],
    "runs_dir": lambda path: [("runs_dir", path)],
    "timeout": lambda s: [("timeout_s", s)],
    "seed": lambda n: [("seed", n)],
    "strategy": _each("strategy.", parse_strategy),
    "mesh": lambda text: [("mesh", parse_mesh(text))],
    "schedule": lambda text: [("parallel.schedule", text)],
    "microbatches": lambda n: [("parallel.microbatches", n)],
    "parallel": _each("parallel.", lambda text: parse_options(text, f"--parallel {text!r}")),
    "model": _each("model.", lambda text: parse_options(text, f"--model {text!r}")),
    "simulate_straggler": lambda text: [("telemetry.simulate_straggler", parse_straggler(text))],
    "consistency": _each("ps.", parse_consistency),
    "servers": lambda n: [("ps.servers", n)],
    "backup_workers": lambda n: [("ps.backup_workers", n)],
    "ps_servers": lambda text: [("ps.addresses", [u for u in text.split(",") if u])],
}


def assignments_of(flags: dict[str, Any], sets: list[str]) -> list[tuple[str, Any]]:
    """The settings that ``distml run``'s flags (by parameter name; None: not given) and its
    ``--set KEY=VALUE`` options give, in that order (``--set`` has the last word)."""
    out = [a for name, value in flags.items() if value is not None for a in ALIASES[name](value)]
    return out + [parse_assignment(text) for text in sets]


def _settings_help() -> str:
    rows = describe_settings()
    return "Settings, for --set KEY=VALUE or a --config TOML file:\n\n" + "\n\n".join(
        escape(f"{key}: {what}")
        for key, what in rows  # typer reads the epilog as rich markup
    )


RunName = Annotated[str | None, typer.Option("--run-name", help="Folder name under runs/.")]
RunsDir = Annotated[Path | None, typer.Option("--runs-dir", help="Where run folders go.")]


@app.command(
    context_settings={
        "allow_extra_args": True,
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
    },
    epilog=_settings_help(),
)
def run(
    ctx: typer.Context,
    script: Annotated[str, typer.Argument(help="The training script (or module with -m).")],
    # torchrun's spellings and its PET_* variables (Kubeflow's PyTorchJob, TorchX) name the same
    # settings as distml's own flags; a flag has the last word over its variable.
    nproc: Annotated[
        str | None,
        typer.Option(
            "--nproc",
            "--nproc-per-node",
            "--nproc_per_node",
            envvar="PET_NPROC_PER_NODE",
            help="Worker processes on this node: N, or auto, cpu or gpu as torchrun reads them.",
        ),
    ] = None,
    nnodes: Annotated[
        str | None, typer.Option(envvar="PET_NNODES", help="N or MIN:MAX nodes.")
    ] = None,
    node_rank: Annotated[
        int | None,
        typer.Option(
            "--node-rank", "--node_rank", envvar="PET_NODE_RANK", help="Fixed rank of this node."
        ),
    ] = None,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            "--rdzv-endpoint",
            "--rdzv_endpoint",
            envvar="PET_RDZV_ENDPOINT",
            help="HOST:PORT of the rendezvous.",
        ),
    ] = None,
    max_restarts: Annotated[
        int | None,
        typer.Option(
            "--max-restarts",
            "--max_restarts",
            envvar="PET_MAX_RESTARTS",
            help="Restarts after a failure.",
        ),
    ] = None,
    master_addr: Annotated[
        str | None,
        typer.Option(
            "--master-addr",
            "--master_addr",
            envvar="PET_MASTER_ADDR",
            help="torchrun's: the rendezvous host, when --rdzv-endpoint is not given.",
        ),
    ] = None,
    master_port: Annotated[
        int | None,
        typer.Option(
            "--master-port",
            "--master_port",
            envvar="PET_MASTER_PORT",
            help="torchrun's: the rendezvous port with --master-addr (default: 29500).",
        ),
    ] = None,
    standalone: Annotated[
        bool,
        typer.Option("--standalone", help="One node, with a rendezvous of its own (the default)."),
    ] = False,
    rdzv_id: Annotated[
        str | None,
        typer.Option(
            "--rdzv-id",
            "--rdzv_id",
            envvar="PET_RDZV_ID",
            help="The rendezvous id, the same on every node (default: the run name).",
        ),
    ] = None,
    rdzv_backend: Annotated[
        str | None,
        typer.Option(
            "--rdzv-backend",
            "--rdzv_backend",
            envvar="PET_RDZV_BACKEND",
            help="c10d or static (default: static with --node-rank, else c10d).",
        ),
    ] = None,
    rdzv_conf: Annotated[
        str | None,
        typer.Option(
            "--rdzv-conf",
            "--rdzv_conf",
            envvar="PET_RDZV_CONF",
            help="Rendezvous options: timeout, join_timeout, last_call_timeout, close_timeout, "
            "read_timeout (seconds), is_host; as KEY=VALUE,...",
        ),
    ] = None,
    local_addr: Annotated[
        str | None,
        typer.Option(
            "--local-addr",
            "--local_addr",
            envvar="PET_LOCAL_ADDR",
            help="This node's address for the others (default: the one on the route to the "
            "rendezvous).",
        ),
    ] = None,
    role: Annotated[
        str | None,
        typer.Option(envvar="PET_ROLE", help="The workers' role, ROLE_NAME (default: default)."),
    ] = None,
    log_dir: Annotated[
        Path | None,
        typer.Option(
            "--log-dir",
            "--log_dir",
            envvar="PET_LOG_DIR",
            help="Where workers' logs go (default: logs in the run folder).",
        ),
    ] = None,
    redirects: Annotated[
        str | None,
        typer.Option(
            "-r",
            "--redirects",
            envvar="PET_REDIRECTS",
            help="Workers' streams into log files: 0-3 (none, stdout, stderr, both), or by "
            "local rank as 0:1,1:2.",
        ),
    ] = None,
    tee: Annotated[
        str | None,
        typer.Option(
            "-t",
            "--tee",
            envvar="PET_TEE",
            help="Workers' streams into log files and to the console, as --redirects.",
        ),
    ] = None,
    no_python: Annotated[
        bool,
        typer.Option(
            "--no-python",
            "--no_python",
            envvar="PET_NO_PYTHON",
            help="Execute SCRIPT itself, not through python.",
        ),
    ] = False,
    run_path: Annotated[
        bool,
        typer.Option(
            "--run-path",
            "--run_path",
            envvar="PET_RUN_PATH",
            help="Run SCRIPT with runpy.run_path in the worker (distml's way for any script); "
            "wins over --no-python.",
        ),
    ] = False,
    monitor_interval: Annotated[
        float | None,
        typer.Option(
            "--monitor-interval",
            "--monitor_interval",
            envvar="PET_MONITOR_INTERVAL",
            help="Seconds between the agent's checks on its workers (default: 0.1).",
        ),
    ] = None,
    signals_to_handle: Annotated[
        str | None,
        typer.Option(
            "--signals-to-handle",
            "--signals_to_handle",
            envvar="PET_SIGNALS_TO_HANDLE",
            help="Signals passed on to the workers (default: SIGTERM,SIGINT,SIGHUP,SIGQUIT).",
        ),
    ] = None,
    run_name: RunName = None,
    runs_dir: RunsDir = None,
    strategy: Annotated[
        str | None,
        typer.Option(
            help="ddp[:compression=fp16|bf16|powersgd,grad_accum=K,...], local-sgd:H, ps, or "
            "auto (the planner picks the mesh, and how replicas synchronise; see --cluster)."
        ),
    ] = None,
    mesh: Annotated[
        str | None, typer.Option(help="Device mesh: dp=N, or e.g. dp=2,fsdp=1,tp=2,pp=2.")
    ] = None,
    schedule: Annotated[
        str | None, typer.Option(help="Pipeline schedule: gpipe, 1f1b or interleaved.")
    ] = None,
    microbatches: Annotated[
        int | None, typer.Option(help="Pipeline micro-batches per step.")
    ] = None,
    parallel: Annotated[
        str | None,
        typer.Option(
            help="Layout options: activation_checkpointing=full|selective, "
            "sequence_parallel=true, reshard_after_forward=false, stages_per_rank=V."
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="GPT size: layers=4,hidden=128,heads=4,seq_len=64,...")
    ] = None,
    timeout: Annotated[
        float | None, typer.Option(help="Seconds before a hung peer counts as failed.")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Base random seed.")] = None,
    simulate_straggler: Annotated[
        str | None, typer.Option(help="RANK:FACTOR slows one rank's compute.")
    ] = None,
    consistency: Annotated[
        str | None, typer.Option(help="--strategy ps: bsp, asp or ssp:S.")
    ] = None,
    servers: Annotated[int | None, typer.Option(help="--strategy ps: server shards.")] = None,
    backup_workers: Annotated[
        int | None, typer.Option(help="--strategy ps, bsp: gradients a step does not wait for.")
    ] = None,
    ps_servers: Annotated[
        str | None, typer.Option(help="--strategy ps: URLs of running shards, comma-separated.")
    ] = None,
    cluster: Annotated[
        Path, typer.Option(help="--strategy auto: the cluster file `distml bench` wrote.")
    ] = Path("cluster.toml"),
    plan_batch: Annotated[
        int, typer.Option(min=1, help="--strategy auto: the global batch the script trains with.")
    ] = 16,
    config: Annotated[Path | None, typer.Option("--config", help="A TOML run config.")] = None,
    set_: Annotated[
        list[str],
        typer.Option("--set", metavar="KEY=VALUE", help="Any setting (listed below); repeatable."),
    ] = [],  # noqa: B006  (typer reads the default; it is never mutated)
    module: Annotated[bool, typer.Option("-m", "--module", help="SCRIPT is a module.")] = False,
) -> None:
    """Run SCRIPT [ARGS...] in worker processes, as torchrun would, with restarts and telemetry.

    Every setting has a --set KEY=VALUE (listed below); the flags above are short names for
    the common ones."""
    if standalone and (rdzv_endpoint or master_addr or nnodes not in (None, "1", "1:1")):
        fail_usage("--standalone is one node: give it without --rdzv-endpoint and --nnodes")
    auto = strategy == "auto"
    if auto:
        if mesh is not None:
            fail_usage("--strategy auto chooses the mesh: give --mesh or --strategy auto, not both")
        strategy = None
    if rdzv_endpoint is None and master_addr is not None:  # as torchrun reads them
        rdzv_endpoint = f"{master_addr}:{master_port or 29500}"
    flags = {name: value for name, value in locals().items() if name in ALIASES}
    try:
        # Under srun, Slurm's environment places this node; the flags have the last word.
        assignments = slurm_settings(os.environ) + assignments_of(flags, set_)
        cfg = resolve_run_config(config, assignments)
        if auto:
            cfg = _planned_config(cfg, config, assignments, cluster, plan_batch)
    except ConfigError as exc:
        fail_usage(str(exc))
    if cfg.strategy.name != "ps" and any(key.startswith("ps.") for key, _ in assignments):
        fail_usage("--consistency, --servers, --backup-workers and --ps-servers need --strategy ps")
    exec_script = cfg.no_python and not cfg.run_path  # torchrun's: --run-path wins
    if module and (exec_script or cfg.run_path):
        fail_usage("-m runs a module with python: give it without --no-python and --run-path")
    if exec_script:  # found as exec finds it: on PATH, or at the path given
        executable = shutil.which(script)
        if executable is None:
            fail_usage(f"--no-python: {script} is not an executable file (or on PATH)")
        script = executable
    elif not module and not Path(script).is_file():
        fail_usage(f"no such script: {script}")
    target = ["-m", script] if module else [script]
    from distml.jobs.strategy_jobs import strategy_job

    job = strategy_job(cfg.strategy.name)  # what the strategy starts besides its workers
    if job is None and not exec_script:  # an executable is started as itself, not forked
        from distml.launch.forkserver import start_fork_server

        start_fork_server()  # its torch import runs alongside this process's, just below
    from torch.distributed.elastic.rendezvous import RendezvousError

    from distml.launch.elastic import LaunchError, run_program, run_workers

    python = [] if exec_script else [sys.executable, "-u"]
    try:
        if job is not None:
            job(cfg, [*python, *target, *ctx.args])
        elif exec_script:
            run_workers(cfg, script, tuple(ctx.args))
        else:
            run_workers(cfg, run_program, ([*target, *ctx.args], os.getcwd()))
    except ConfigError as exc:
        fail_usage(str(exc))
    except (LaunchError, RendezvousError) as exc:
        report_failure("distml run failed", exc)
    err.print(f"run folder: {cfg.run_dir}", highlight=False)


# The settings that say how replicas synchronise: where the config or --set gives one (even
# strategy.compression = "none", plain DDP), --strategy auto plans the layout under that.
SYNC_FIELDS = {
    "name", "compression", "powersgd_rank", "powersgd_start_iter", "sync_every", "outer_lr",
    "outer_momentum",
}  # fmt: skip


def _planned_config(
    cfg: RunConfig,
    config_file: Path | None,
    assignments: list[tuple[str, Any]],
    cluster_file: Path,
    global_batch: int,
) -> RunConfig:
    """``--strategy auto``: the run's config under the mesh (and layout options) the cost model
    predicts fastest for this world on the cluster ``distml bench`` measured, and, for a mesh
    of replicas, the synchronisation predicted fastest to a loss (unless the config or --set
    chose one). The config has the last word: a layout it refuses (too few micro-batches for
    that many stages, say) gives way to the next best."""
    from distml.config import GPTConfig
    from distml.launch.elastic import worker_threads
    from distml.plan.auto import choose_layout, gpt_params, gpt_shapes, hook_costs, plan_record
    from distml.plan.bench import read_cluster_file
    from distml.plan.cost_model import Cluster
    from distml.plan.sync import AUTO_SYNCS, DDP, sync_of
    from distml.telemetry.units import format_bytes

    if not cluster_file.is_file():
        raise ConfigError(
            f"--strategy auto needs a cluster file and {cluster_file} does not exist: write one "
            f"with `distml bench --nproc {cfg.nproc} --out {cluster_file}`"
        )
    try:
        measured = read_cluster_file(cluster_file)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.min_nodes != cfg.max_nodes:
        raise ConfigError("--strategy auto plans a fixed world: give --nnodes N, not a range")
    model = cfg.model or GPTConfig()
    par = cfg.parallel
    user_sync = bool(SYNC_FIELDS & cfg.strategy.model_fields_set)  # from the file or --set
    syncs = (sync_of(cfg.strategy),) if user_sync else AUTO_SYNCS
    try:
        hook_s = hook_costs(gpt_shapes(model), syncs, measured.device, worker_threads(cfg.nproc))
    except RuntimeError as exc:  # the plan goes on, charging PowerSGD its bytes alone
        err.print(f"--strategy auto: {exc}", highlight=False, markup=False)
        hook_s = {}
    choice = choose_layout(
        model,
        Cluster(measured.device, cfg.world_size, cfg.nproc, measured.calibration),
        global_batch=global_batch,
        microbatches=par.microbatches,
        precision=cfg.strategy.mixed_precision,
        n_params=gpt_params(model),
        schedule=par.schedule,
        chunks=par.virtual_stages,
        recompute=par.activation_checkpointing,
        syncs=syncs,
        hook_s=hook_s,
    )
    refused = []
    for rank, option in enumerate(choice.ranked, 1):
        pred = option.prediction
        mesh_sizes, options = pred.layout.mesh_sizes(), pred.layout.parallel_settings()
        mesh = ",".join(f"{k}={v}" for k, v in mesh_sizes.items())
        extra = ",".join(f"{k}={str(v).lower()}" for k, v in options.items())
        planner = [("mesh", mesh_sizes), ("run_name", cfg.run_name)]
        planner += [(f"parallel.{k}", v) for k, v in options.items()]
        planner += option.sync.run_settings()
        try:  # the same settings with the planner's mesh, in the same run folder
            planned = resolve_run_config(config_file, assignments + planner)
        except ConfigError as exc:
            refused.append(f"--mesh {mesh} ({option.sync.label}): {exc}")
            continue
        planned = planned.model_copy(update={"plan": plan_record(option, par.microbatches, hook_s)})
        sync = "" if option.sync == DDP else f", synchronised by {option.sync.label}"
        rule = "" if option.sync == DDP else f", {option.steps_factor:g}x DDP's steps to a loss"
        err.print(
            f"--strategy auto: --mesh {mesh}{' --parallel ' + extra if extra else ''}{sync} "
            f"(predicted {pred.step_time_s * 1e3:.1f} ms a step{rule}, "
            f"{format_bytes(pred.memory_bytes['total'])} a device; number {rank} of "
            f"{len(choice.ranked)} options that fit, {len(choice.too_big)} layouts too big)",
            highlight=False,
        )
        return planned
    raise ConfigError("every layout the planner found is refused: " + "; ".join(refused))


@app.command()
def demo(
    nproc: Annotated[
        int | None, typer.Option(help="Worker processes (default: one per GPU, else 2).")
    ] = None,
    epochs: Annotated[int, typer.Option(help="Passes over the training set.")] = 8,
    finetune_epochs: Annotated[int, typer.Option(help="Passes of the fine-tune.")] = 8,
    run_name: RunName = None,
    runs_dir: RunsDir = None,
) -> None:
    """The whole lifecycle on scikit-learn's digits: preprocess, train, fine-tune, validate,
    batch inference, serve (2 replicas), report."""
    fields: dict[str, Any] = {"nproc": _default_nproc() if nproc is None else nproc}
    if run_name is not None:
        fields["run_name"] = run_name
    if runs_dir is not None:
        fields["runs_dir"] = runs_dir
    for flag, value in (("--epochs", epochs), ("--finetune-epochs", finetune_epochs)):
        if value < 1:
            fail_usage(f"{flag} must be >= 1, got {value}")
    try:
        cfg = build_config(**fields)
    except ConfigError as exc:
        fail_usage(str(exc))
    from distml.jobs.preprocess import PreprocessError
    from distml.launch.elastic import LaunchError
    from distml.lifecycle import run_lifecycle

    try:
        run_lifecycle(
            cfg,
            epochs=epochs,
            finetune_epochs=finetune_epochs,
            log=lambda line: err.print(line, highlight=False, markup=False, soft_wrap=True),
        )
    except ConfigError as exc:
        fail_usage(str(exc))
    except (LaunchError, PreprocessError) as exc:
        report_failure("demo failed", exc)


from distml.cli.finetune import finetune  # noqa: E402
from distml.cli.fl import fl_app  # noqa: E402
from distml.cli.generate import generate  # noqa: E402  (after the helpers they use)
from distml.cli.infer import infer  # noqa: E402
from distml.cli.plan import bench, plan, simulate  # noqa: E402
from distml.cli.preprocess import preprocess_app  # noqa: E402
from distml.cli.ps import ps_app  # noqa: E402
from distml.cli.serve import serve_app  # noqa: E402
from distml.cli.tune import tune_app  # noqa: E402

app.command(name="plan")(plan)
app.command(name="bench")(bench)
app.command(name="simulate")(simulate)
app.command(name="generate")(generate)
app.command(name="finetune")(finetune)
app.command(name="infer")(infer)
app.add_typer(ps_app, name="ps")
app.add_typer(fl_app, name="fl")
app.add_typer(serve_app, name="serve")
app.add_typer(preprocess_app, name="preprocess")
app.add_typer(tune_app, name="tune")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
