"""The contribution hub: a model that grows by contributions from a community, each one checked
before it is merged (the routes are in :mod:`distml.federated.hub_app`).

A contributor fine-tunes the hub's latest model on their own data and submits the *delta* of
its parameters: in full, or as LoRA adapters of the model's Linear layers (Hu et al. 2021),
merged as ``W += (alpha / r) B A``. The hub refuses a delta that does not fit the model (names,
shapes, dtypes, finite values, an optional L2 bound), merges the rest into its latest version and
evaluates the result on its own held-out data. The rule: accepted when

    accuracy after >= accuracy before - threshold,

and then it is version v + 1. Either way both accuracies are logged; a refusal, with its reason,
changes nothing else.

A contribution names the version it was trained from, its *base*. When others have been merged
since, the base is stale: the delta is still applied to, and judged on, the latest version (the
one it would change), and the log says so. The same payload is never merged twice, so a client
that retries a request it thinks was lost cannot apply its delta again.

Provenance: every version records who (from the token, never from the payload), when, its base
and parent, the metrics before and after, the SHA-256 of the submitted payload and its
description. On disk, one safetensors file per version (its provenance in the metadata) and
``hub.json``, the log of versions and refusals. Each is written to a temporary name and renamed,
the log last: a version exists once the log names it. No pickle.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field, field_validator
from torch import nn
from torch.utils.data import TensorDataset

from distml.federated.task import (
    MODELS,
    Params,
    build_model,
    evaluate,
    get_params,
    norm,
    set_params,
)
from distml.net import TensorPayloadError, decode_tensors, encode_tensors

LOG = "hub.json"
KINDS = ("full", "lora")
MAX_DESCRIPTION = 4000


class HubConfig(BaseModel):
    model: str = "digits-mlp"
    seed: int = 0
    threshold: float = Field(0.01, ge=0, le=1, description="accuracy a contribution may cost")
    max_norm: float | None = Field(None, gt=0, description="L2 bound of a merged delta")

    @field_validator("model")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in MODELS:
            raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
        return name


class ContributionRefused(ValueError):
    """A contribution the hub will not merge (answered 4xx); ``details`` go to the log."""

    def __init__(self, reason: str, status: int = 422, **details: Any):
        super().__init__(reason)
        self.status = status
        self.details = details


def check_delta(delta: Params, params: Params) -> None:
    """Refuse a delta that does not fit ``params``. A delta may leave parameters out: they stay."""
    if not delta:
        raise ContributionRefused("an empty delta")
    unknown = sorted(set(delta) - set(params))
    if unknown:
        raise ContributionRefused(f"unknown parameters {unknown}; the model has {sorted(params)}")
    for name in sorted(delta):
        t, p = delta[name], params[name]
        if t.shape != p.shape or t.dtype != p.dtype:
            raise ContributionRefused(
                f"{name}: got {t.dtype} {tuple(t.shape)}, expected {p.dtype} {tuple(p.shape)}"
            )
        if not torch.isfinite(t).all():
            raise ContributionRefused(f"{name}: non-finite values")


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def _rank_and_alpha(meta: dict[str, str]) -> tuple[int, float]:
    try:
        r, alpha = int(meta["r"]), float(meta["alpha"])
    except (KeyError, ValueError) as exc:
        raise ContributionRefused(
            f"a LoRA contribution needs integer r and alpha: {exc!r}"
        ) from None
    if r < 1 or not 0 < alpha < float("inf"):
        raise ContributionRefused(f"LoRA needs r >= 1 and a finite alpha > 0, got r={r}, {alpha=}")
    return r, alpha


def lora_delta(adapters: Params, meta: dict[str, str], model: nn.Module) -> Params:
    """The weight delta of LoRA adapters: for each adapted Linear layer ``M`` (out x in), tensors
    ``M.lora_A`` (r x in) and ``M.lora_B`` (out x r); metadata ``r`` and ``alpha``. The delta
    of ``M.weight`` is (alpha / r) B A, as peft merges it."""
    r, alpha = _rank_and_alpha(meta)
    linears = linear_layers(model)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in adapters.items():
        module, _, part = name.rpartition(".")
        if part not in ("lora_A", "lora_B"):
            raise ContributionRefused(f"{name}: LoRA tensors are named MODULE.lora_A/lora_B")
        if module not in linears:
            raise ContributionRefused(
                f"{module!r} is not a Linear layer of the model; those are {sorted(linears)}"
            )
        pairs.setdefault(module, {})[part] = t
    delta = {}
    for module, pair in sorted(pairs.items()):
        if len(pair) != 2:
            raise ContributionRefused(f"{module}: lora_A and lora_B come in pairs")
        layer = linears[module]
        want = {"lora_A": (r, layer.in_features), "lora_B": (layer.out_features, r)}
        for part, t in sorted(pair.items()):
            if tuple(t.shape) != want[part] or t.dtype != layer.weight.dtype:
                raise ContributionRefused(
                    f"{module}.{part}: got {t.dtype} {tuple(t.shape)}, expected "
                    f"{layer.weight.dtype} {want[part]} for rank r={r}"
                )
            if not torch.isfinite(t).all():
                raise ContributionRefused(f"{module}.{part}: non-finite values")
        delta[f"{module}.weight"] = (pair["lora_B"] @ pair["lora_A"]) * (alpha / r)
    if not delta:
        raise ContributionRefused("no LoRA adapters in the payload")
    return delta


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Hub:
    """The versions of one model and the rules that admit new ones; ``directory`` is created,
    or resumed when it already holds a hub. ``initial`` (safetensors) is version 0 of a new hub;
    without it, ``build_model(config.model, config.seed)`` is. Thread-safe: one contribution is
    judged at a time.

    >>> hub = Hub(Path("hub"), digits("val"))                      # doctest: +SKIP
    >>> hub.contribute("alice", body, base=0, kind="full")["version"]  # doctest: +SKIP
    1
    """

    def __init__(
        self,
        directory: Path,
        held_out: TensorDataset,
        config: HubConfig | None = None,
        *,
        initial: Path | None = None,
    ):
        self.directory = Path(directory)
        self.held_out = held_out
        self.config = config or HubConfig()
        self.model = build_model(self.config.model, self.config.seed)
        # Judging a contribution takes an evaluation: readers must not wait for it, so they
        # take only the short lock that guards the lists.
        self._judging = threading.Lock()
        self._state = threading.Lock()
        self.versions: list[dict[str, Any]] = []
        self.refusals: list[dict[str, Any]] = []
        self.directory.mkdir(parents=True, exist_ok=True)
        if (self.directory / LOG).exists():
            self.params = self._resume(initial)
        else:
            self.params = self._start(initial)

    @property
    def latest(self) -> int:
        return len(self.versions) - 1

    # -- reading ----------------------------------------------------------------------------
    def model_body(self, version: int | None = None) -> tuple[int, bytes]:
        """(version, its safetensors file) — the latest version by default."""
        with self._state:
            version = self.latest if version is None else version
            if not 0 <= version <= self.latest:
                raise LookupError(f"no version {version}: this hub holds 0..{self.latest}")
            name = self.versions[version]["file"]
        return version, (self.directory / name).read_bytes()  # a named file never changes

    def log(self) -> dict[str, Any]:
        with self._state:
            return copy.deepcopy(
                {
                    "model": self.config.model,
                    "latest": self.latest,
                    "threshold": self.config.threshold,
                    "max_norm": self.config.max_norm,
                    "versions": self.versions,
                    "refusals": self.refusals,
                }
            )

    def health(self) -> dict[str, Any]:
        """Reads the log and the latest version's file back from disk: a hub that cannot read
        its directory is not healthy."""
        on_disk = json.loads((self.directory / LOG).read_bytes())  # replaced whole, never torn
        (self.directory / on_disk["versions"][-1]["file"]).stat()
        return {"model": self.config.model, "latest": len(on_disk["versions"]) - 1}

    # -- contributing -----------------------------------------------------------------------
    def contribute(
        self, contributor: str, body: bytes, *, base: int | None, kind: str
    ) -> dict[str, Any]:
        """Judge one contribution; the new version's record, or :class:`ContributionRefused`
        (logged with its reason)."""
        entry = {"contributor": contributor, "time": _now(), "base": base, "kind": kind}
        entry |= {"sha256": _sha256(body), "bytes": len(body)}
        with self._judging:
            try:
                return self._merge(entry, body)
            except ContributionRefused as exc:
                self._refuse(entry | exc.details, str(exc), exc.status)
                raise

    def refuse(self, contributor: str, reason: str, status: int, **entry: Any) -> None:
        """Log a contribution refused before it reached the hub (a body over the limit)."""
        with self._judging:
            self._refuse({"contributor": contributor, "time": _now(), **entry}, reason, status)

    def _merge(self, entry: dict[str, Any], body: bytes) -> dict[str, Any]:
        kind, base = entry["kind"], entry["base"]
        if kind not in KINDS:
            raise ContributionRefused(f"kind must be one of {list(KINDS)}, got {kind!r}")
        if base is None:
            raise ContributionRefused("name the version the delta was trained from: ?base=V")
        if not 0 <= base <= self.latest:
            raise ContributionRefused(
                f"unknown base version {base}: this hub holds versions 0..{self.latest}", 409
            )
        try:
            tensors, meta = decode_tensors(body)
        except TensorPayloadError as exc:
            raise ContributionRefused(str(exc), 400) from None
        description = meta.get("description", "").strip()
        if not description or len(description) > MAX_DESCRIPTION:
            raise ContributionRefused(
                f"a contribution needs a description of 1 to {MAX_DESCRIPTION} characters "
                "(safetensors metadata 'description')"
            )
        entry["description"] = description
        for record in self.versions:
            if record.get("sha256") == entry["sha256"]:
                raise ContributionRefused(
                    f"this payload was already merged as version {record['version']}", 409
                )
        delta = lora_delta(tensors, meta, self.model) if kind == "lora" else tensors
        if kind == "lora":
            entry |= {"r": int(meta["r"]), "alpha": float(meta["alpha"])}
        check_delta(delta, self.params)
        entry["delta_norm"] = size = norm(delta)
        bound = self.config.max_norm
        if bound is not None and size > bound * (1 + 1e-6):
            raise ContributionRefused(f"delta norm {size:.4g} is above the bound {bound:g}")

        merged = {n: p + delta[n] if n in delta else p for n, p in self.params.items()}
        parent = self.versions[-1]
        after = self._evaluate(merged)
        threshold = self.config.threshold
        entry |= {
            "parent": self.latest,
            "stale": base != self.latest,
            "threshold": threshold,
            "accuracy_before": parent["accuracy_after"],
            "accuracy_after": after["accuracy"],
            "loss_before": parent["loss_after"],
            "loss_after": after["loss"],
        }
        # Accuracies are multiples of 1/n: the slack only absorbs the rounding of the subtraction.
        if after["accuracy"] < parent["accuracy_after"] - threshold - 1e-9:
            raise ContributionRefused(
                f"held-out accuracy would fall from {parent['accuracy_after']:.4f} to "
                f"{after['accuracy']:.4f}, more than the threshold {threshold:g}"
            )
        record = self._write_version({"version": self.latest + 1, **entry}, merged)
        self._write_log(self.versions + [record], self.refusals)
        with self._state:
            self.versions.append(record)
            self.params = merged
        return copy.deepcopy(record)

    def _refuse(self, entry: dict[str, Any], reason: str, status: int) -> None:
        record = {**entry, "status": status, "reason": reason}
        self._write_log(self.versions, self.refusals + [record])
        with self._state:
            self.refusals.append(record)

    def _evaluate(self, params: Params) -> dict[str, float]:
        set_params(self.model, params)
        return evaluate(self.model, self.held_out)

    # -- the directory ----------------------------------------------------------------------
    def _write_version(self, record: dict[str, Any], params: Params) -> dict[str, Any]:
        name = f"v{record['version']:06d}.safetensors"
        meta = {"model": self.config.model, "version": str(record["version"])}
        body = encode_tensors(params, meta | {"provenance": json.dumps(record)})
        _write_atomically(self.directory / name, body)
        return record | {"file": name, "file_sha256": _sha256(body)}

    def _write_log(self, versions: list[dict[str, Any]], refusals: list[dict[str, Any]]) -> None:
        log = {"format": 1, "model": self.config.model, "versions": versions}
        data = json.dumps(log | {"refusals": refusals}, indent=1).encode()
        _write_atomically(self.directory / LOG, data)

    def _read_params(self, data: bytes, where: str) -> Params:
        try:
            params, _ = decode_tensors(data)
            check_delta(params, get_params(self.model))
        except (TensorPayloadError, ContributionRefused) as exc:
            raise ValueError(f"{where}: not parameters of {self.config.model}: {exc}") from None
        missing = sorted(set(get_params(self.model)) - set(params))
        if missing:
            raise ValueError(f"{where}: parameters {missing} are missing")
        return params

    def _start(self, initial: Path | None) -> Params:
        record: dict[str, Any] = {"version": 0, "contributor": None, "time": _now()}
        record |= {"base": None, "parent": None, "kind": "initial"}
        if initial is None:
            params = get_params(self.model)
            source = f"build_model({self.config.model!r}, seed={self.config.seed})"
            record |= {"description": source, "sha256": None}
        else:
            data = Path(initial).read_bytes()
            params = self._read_params(data, str(initial))
            record |= {"description": f"loaded from {Path(initial).name}", "sha256": _sha256(data)}
        metrics = self._evaluate(params)
        record |= {"accuracy_before": None, "accuracy_after": metrics["accuracy"]}
        record |= {"loss_before": None, "loss_after": metrics["loss"]}
        record = self._write_version(record, params)
        self._write_log([record], [])
        self.versions = [record]
        return params

    def _resume(self, initial: Path | None) -> Params:
        log = json.loads((self.directory / LOG).read_bytes())
        if log.get("format") != 1 or log.get("model") != self.config.model:
            raise ValueError(
                f"{self.directory} holds a hub of {log.get('model')!r}, not {self.config.model!r}"
            )
        # A damaged file is found at start, not served quietly later.
        for record in log["versions"]:
            path = self.directory / record["file"]
            if _sha256(path.read_bytes()) != record["file_sha256"]:
                raise ValueError(f"{path}: its SHA-256 is not the one in {LOG}")
        latest = self.directory / log["versions"][-1]["file"]
        params = self._read_params(latest.read_bytes(), str(latest))
        if initial is not None:
            if _sha256(Path(initial).read_bytes()) != log["versions"][0]["sha256"]:
                raise ValueError(f"{self.directory} holds a hub whose version 0 is not {initial}")
        self.versions, self.refusals = log["versions"], log["refusals"]
        return params
