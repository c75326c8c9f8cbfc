"""``distml fl``: federated learning — a server, clients on other machines, or a simulation of
many clients on this one."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
from pathlib import Path
from typing import Annotated, Any

import typer

from distml.cli.data_spec import load_client_data
from distml.cli.fl_hub import hub_app
from distml.cli.messages import fail_usage
from distml.cli.options import MlflowExperiment, MlflowUri
from distml.cli.tokens import read_tokens, write_private

fl_app = typer.Typer(
    help="Federated learning: the data stays on each client; only updates travel.",
    no_args_is_help=True,
)

StrategyOpt = Annotated[
    str,
    typer.Option(
        help="fedavg, fedsgd, fedprox, fedadam, fedyogi, fedadagrad, median, trimmed-mean, "
        "krum, multi-krum; options as NAME:KEY=VALUE,... (fedprox:mu=0.01, krum:byzantine=2)."
    ),
]
Fraction = Annotated[float, typer.Option("--fraction", help="C: fraction of clients per round.")]
MinClients = Annotated[int, typer.Option(help="At least this many clients per round.")]
Epochs = Annotated[int, typer.Option(help="E: local epochs per round.")]
Batch = Annotated[int, typer.Option(help="B: local batch size (0: all local data).")]
Lr = Annotated[float, typer.Option(help="Clients' learning rate.")]
Model = Annotated[str, typer.Option(help="digits-mlp or digits-cnn.")]
Rounds = Annotated[int, typer.Option(help="Rounds to run.")]
Timeout = Annotated[
    float,
    typer.Option(help="Seconds a round waits for the other updates once the first has arrived."),
]
Quorum = Annotated[float, typer.Option(help="Fraction of the selected that completes a round.")]
MaxNorm = Annotated[float | None, typer.Option(help="Refuse updates of a larger L2 norm.")]
DpNoise = Annotated[
    float | None, typer.Option(help="Client-level DP: noise multiplier (needs --dp-clip).")
]
DpClip = Annotated[float | None, typer.Option(help="Client-level DP: clip norm of an update.")]
DpDelta = Annotated[float, typer.Option(help="Client-level DP: delta of (epsilon, delta).")]
Checkpoints = Annotated[
    Path | None, typer.Option(help="Checkpoint every round here; a restart resumes from it.")
]
Seed = Annotated[int, typer.Option(help="Seed of the model, the sampling and the partition.")]
SecureAgg = Annotated[
    bool, typer.Option("--secure-agg", help="Secure aggregation: the server sees only the sum.")
]
SecThreshold = Annotated[
    float, typer.Option(help="Secure aggregation: t as a fraction of a round's clients.")
]
SecClip = Annotated[
    float, typer.Option(help="Secure aggregation: quantisation range of one coordinate.")
]


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _build(
    strategy: str,
    *,
    fraction: float,
    min_clients: int,
    epochs: int,
    batch_size: int,
    lr: float,
    model: str,
    rounds: int,
    min_available: int,
    round_timeout: float,
    quorum: float,
    max_update_norm: float | None,
    dp_noise: float | None,
    dp_clip: float | None,
    dp_delta: float,
    seed: int,
    secure_agg: bool = False,
    secagg_threshold: float = 0.6,
    secagg_clip: float = 1.0,
):
    """The strategy (wrapped in differential privacy and secure aggregation where asked) and the
    server settings of a command line; a ValueError names what is wrong."""
    from pydantic import ValidationError

    from distml.config import format_validation_error, parse_options
    from distml.federated.privacy import ClientLevelDP
    from distml.federated.secure_aggregation import SecAggSettings, SecureAggregation
    from distml.federated.server import ServerConfig
    from distml.federated.strategy import LocalConfig, make_strategy

    name, _, options = strategy.partition(":")
    kwargs = {k: _value(str(v)) for k, v in parse_options(options, "--strategy").items()}
    if name == "fedsgd":
        epochs, batch_size = 1, 0
    try:
        local = LocalConfig(epochs=epochs, batch_size=batch_size, lr=lr)
        config = ServerConfig(
            model=model,
            rounds=rounds,
            min_available=min_available,
            round_timeout_s=round_timeout,
            quorum=quorum,
            max_update_norm=max_update_norm,
            seed=seed,
        )
        secagg = SecAggSettings(threshold=secagg_threshold, clip=secagg_clip)
    except ValidationError as exc:
        raise ValueError(format_validation_error(exc)) from None
    built = make_strategy(
        name, fraction_fit=fraction, min_fit_clients=min_clients, local=local, **kwargs
    )
    if (dp_noise is None) != (dp_clip is None):
        raise ValueError("client-level DP needs both --dp-noise and --dp-clip")
    if dp_noise is not None:  # the round asks clients to clip to dp_clip; the server checks it
        built = ClientLevelDP(built, dp_noise, dp_clip, dp_delta, seed=None)
    if secure_agg:
        built = SecureAggregation(built, **secagg.model_dump())
    return built, config


@fl_app.command()
def simulate(
    clients: Annotated[int, typer.Option(help="Virtual clients.")] = 100,
    rounds: Rounds = 10,
    strategy: StrategyOpt = "fedavg",
    partition: Annotated[
        str, typer.Option(help="iid, dirichlet:ALPHA or shards:K (K classes per client).")
    ] = "iid",
    fraction: Fraction = 0.1,
    min_clients: MinClients = 2,
    epochs: Epochs = 1,
    batch_size: Batch = 10,
    lr: Lr = 0.1,
    model: Model = "digits-mlp",
    processes: Annotated[int, typer.Option(help="Worker processes hosting the clients.")] = 2,
    round_timeout: Timeout = 60.0,
    quorum: Quorum = 0.5,
    max_update_norm: MaxNorm = None,
    dp_noise: DpNoise = None,
    dp_clip: DpClip = None,
    dp_delta: DpDelta = 1e-5,
    byzantine: Annotated[float, typer.Option(help="Fraction of clients that attack.")] = 0.0,
    attack: Annotated[str, typer.Option(help="sign-flip:S or scale:S.")] = "sign-flip:10",
    checkpoint_dir: Checkpoints = None,
    seed: Seed = 0,
    secure_agg: SecureAgg = False,
    secagg_threshold: SecThreshold = 0.6,
    secagg_clip: SecClip = 1.0,
    out: Annotated[
        Path | None, typer.Option(help="Write history.json, summary.json and report.html here.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line per round.")] = False,
    mlflow_uri: MlflowUri = None,
    mlflow_experiment: MlflowExperiment = "distml",
) -> None:
    """Many virtual clients in a pool of processes against the real server over loopback."""
    from rich.console import Console

    from distml.federated.client import parse_attack
    from distml.federated.partition import parse_partition
    from distml.jobs.fl_simulation import SimulationConfig, print_json_line
    from distml.jobs.fl_simulation import simulate as run_simulation

    try:
        parse_partition(partition)
        parse_attack(attack)
        built, config = _build(
            strategy, fraction=fraction, min_clients=min_clients, epochs=epochs,
            batch_size=batch_size, lr=lr, model=model, rounds=rounds, min_available=clients,
            round_timeout=round_timeout, quorum=quorum, max_update_norm=max_update_norm,
            dp_noise=dp_noise, dp_clip=dp_clip, dp_delta=dp_delta, seed=seed,
            secure_agg=secure_agg, secagg_threshold=secagg_threshold, secagg_clip=secagg_clip,
        )  # fmt: skip
        sim = SimulationConfig(
            clients=clients,
            partition=partition,
            processes=processes,
            byzantine=byzantine,
            attack=attack,
            seed=seed,
        )
    except ValueError as exc:
        fail_usage(str(exc))
    console = Console()
    history: list[dict[str, Any]] = []

    def show(record: dict[str, Any]) -> None:
        history.append(record)
        if as_json:
            keys = ("round", "status", "participants", "accuracy", "loss", "epsilon")
            line = {k: record[k] for k in keys if k in record}
            print_json_line(line | {"bytes": record["bytes_down"] + record["bytes_up"]})
        else:
            acc = record.get("accuracy")
            console.print(
                f"round {record['round']:>3} {record['status']:<9} "
                f"{record['participants']:>3} clients  accuracy "
                + (f"{acc:.3f}" if acc is not None else "-")
            )

    try:
        summary = run_simulation(sim, config, built, checkpoint_dir=checkpoint_dir,
                                 on_round=show)  # fmt: skip
    except (ValueError, RuntimeError) as exc:
        fail_usage(str(exc))
    if out is not None:
        from distml.telemetry.federated_report import write_federated_report

        out.mkdir(parents=True, exist_ok=True)
        (out / "history.json").write_text(json.dumps(history, indent=1))
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        summary["report"] = str(write_federated_report(out, history, summary))
    if mlflow_uri is not None:
        from distml.telemetry.metrics_stream import round_scalars
        from distml.telemetry.mlflow_log import MlflowTarget, log_run

        settings = {"strategy": strategy, **dataclasses.asdict(sim), **config.model_dump()}
        run_name = out.name if out is not None else "fl-simulate"
        target = MlflowTarget(mlflow_uri, mlflow_experiment, run_name, settings,
                              {"distml.kind": "federated"})  # fmt: skip
        summary["mlflow_run"] = log_run(target, round_scalars(history))
    if as_json:
        print_json_line(summary)
    else:
        console.print_json(json.dumps(summary))


@fl_app.command()
def server(
    tokens: Annotated[
        Path,
        typer.Option(help="JSON file {client name: token}; keep it readable by you only."),
    ],
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 7400,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    rounds: Rounds = 10,
    strategy: StrategyOpt = "fedavg",
    fraction: Fraction = 1.0,
    min_clients: MinClients = 2,
    min_available: Annotated[int, typer.Option(help="Clients registered before round 1.")] = 2,
    epochs: Epochs = 1,
    batch_size: Batch = 10,
    lr: Lr = 0.1,
    model: Model = "digits-mlp",
    round_timeout: Timeout = 60.0,
    quorum: Quorum = 0.5,
    max_update_norm: MaxNorm = None,
    dp_noise: DpNoise = None,
    dp_clip: DpClip = None,
    dp_delta: DpDelta = 1e-5,
    checkpoint_dir: Checkpoints = None,
    seed: Seed = 0,
    secure_agg: SecureAgg = False,
    secagg_threshold: SecThreshold = 0.6,
    secagg_clip: SecClip = 1.0,
    ssl_certfile: Annotated[str | None, typer.Option(help="TLS certificate (PEM).")] = None,
    ssl_keyfile: Annotated[str | None, typer.Option(help="TLS key (PEM).")] = None,
) -> None:
    """Serve federated rounds to clients on other machines; evaluates on its own held-out data
    and stops serving new rounds after the last one."""
    from distml.data import digits
    from distml.federated.app import create_fl_app
    from distml.federated.server import FederatedServer
    from distml.net import serve

    try:
        table = read_tokens(tokens, "client")
        built, config = _build(
            strategy, fraction=fraction, min_clients=min_clients, epochs=epochs,
            batch_size=batch_size, lr=lr, model=model, rounds=rounds,
            min_available=min_available, round_timeout=round_timeout, quorum=quorum,
            max_update_norm=max_update_norm, dp_noise=dp_noise, dp_clip=dp_clip,
            dp_delta=dp_delta, seed=seed, secure_agg=secure_agg,
            secagg_threshold=secagg_threshold, secagg_clip=secagg_clip,
        )  # fmt: skip
        fl_server = FederatedServer(config, built, digits("val"), checkpoint_dir=checkpoint_dir)
    except (OSError, ValueError) as exc:
        fail_usage(str(exc))
    serve(create_fl_app(fl_server, table), host, port, ssl_certfile=ssl_certfile,
          ssl_keyfile=ssl_keyfile)  # fmt: skip


@fl_app.command()
def client(
    server_url: Annotated[str, typer.Option("--server", help="The server's URL.")],
    data: Annotated[
        str,
        typer.Option(
            help="This client's data: a safetensors file with tensors x and y, or "
            "digits:K/N (part K of N of the digits training set, for trials)."
        ),
    ],
    ca_cert: Annotated[str | None, typer.Option(help="CA bundle to verify TLS with.")] = None,
    seed: Seed = 0,
) -> None:
    """Train with a federated server; the data never leaves this machine. The token comes from
    DISTML_TOKEN."""
    from distml.federated.client import FederatedClient
    from distml.net import token_from_env
    from distml.net.client import ServiceError

    try:
        token = token_from_env()
        dataset = load_client_data(data)
    except (OSError, ValueError) as exc:
        fail_usage(str(exc))
    fl_client = FederatedClient(server_url, token, dataset, seed=seed, verify=ca_cert or True)
    try:
        trained = fl_client.run()
    except KeyboardInterrupt:  # Ctrl-C: say goodbye, so that the open round need not time out
        with contextlib.suppress(ServiceError):
            fl_client.leave()
        raise typer.Exit(130) from None
    typer.echo(json.dumps({"rounds_trained": trained, "examples": len(dataset)}))


@fl_app.command()
def tokens(
    clients: Annotated[int, typer.Argument(help="How many clients.")],
    prefix: Annotated[str, typer.Option(help="Client names are PREFIX-0000, ...")] = "client",
    out: Annotated[
        Path | None,
        typer.Option(
            help="Write the file here, readable by you only (mode 0600); it must not exist yet. "
            "Without it the file is printed: a shell redirect makes it as your umask says, "
            "usually readable by everyone."
        ),
    ] = None,
) -> None:
    """A fresh tokens file (JSON) for ``distml fl server --tokens``."""
    if clients < 1:
        fail_usage(f"need at least 1 client, got {clients}")
    table = {f"{prefix}-{i:04d}": secrets.token_urlsafe(24) for i in range(clients)}
    text = json.dumps(table, indent=1) + "\n"
    if out is None:
        typer.echo(text, nl=False)
        return
    try:
        write_private(out, text)
    except OSError as exc:
        fail_usage(f"{out}: {exc.strerror or exc}")


fl_app.add_typer(hub_app, name="hub")
