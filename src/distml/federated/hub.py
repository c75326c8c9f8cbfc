"""The contribution hub: a model that grows by contributions from a community, each one checked
before it is merged (the routes are in :mod:`distml.federated.hub_app`).

A contributor fine-tunes the hub's latest model on their own data and submits the *delta* of
its parameters: in full, or as LoRA adapters of the model's Linear layers (Hu et al. 2021),
merged as ``W += (alpha / r) B A``. The hub refuses a delta that does not fit the model (names,
shapes, dtypes, finite values, an L2 bound: ``max_norm``, 100 by default), merges the rest into its
latest version and evaluates the result on its own held-out data. The rule: accepted when every
held-out output is finite and

    accuracy after >= accuracy before - threshold,
    loss after     <= loss before + max_loss_rise    (mean cross-entropy, nats; 0.1 by default),

and then it is version v + 1. The loss rule catches what accuracy cannot see: a last layer scaled
by 1e30 keeps every argmax, and so the accuracy, while its loss explodes and every later honest
gradient with it. Either way the metrics are logged; a refusal, with its reason, changes nothing
else.

A contribution names the version it was trained from, its *base*. When others have been merged
since, the base is stale: the delta is still applied to, and judged on, the latest version (the
one it would change), and the log says so. The same payload is never merged twice, so a client
that retries a request it thinks was lost cannot apply its delta again.

Provenance: every version records who (from the token, never from the payload), when, its base
and parent, the metrics before and after, the SHA-256 of the submitted payload and its
description. On disk, one safetensors file per version (its provenance in the metadata) and
``hub.json``, the log of versions. Each is written to a temporary name, synced and renamed, the
log last: a version exists once the log names it. Refusals go to ``refusals.json``: the last
``refusals_kept`` of them and counts of all, renamed into place but not synced, since a refusal
changes no model (a crash may lose the latest few, never a version). No pickle.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field, field_validator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from distml.federated.task import (
    FEDERATED_MODELS,
    Params,
    build_model,
    evaluate,
    get_params,
    norm,
    set_params,
)
from distml.net import TensorPayloadError, decode_tensors, encode_tensors, finite_float

LOG = "hub.json"
REFUSALS = "refusals.json"
KINDS = ("full", "lora")
MAX_DESCRIPTION = 4000
# A refusal is logged with at most this much of what its sender wrote: a flood of refusals
# costs the log a bounded amount each.
MAX_LOGGED_DESCRIPTION = 256
MAX_LOGGED_REASON = 1000
MAX_NAMES_IN_REASON = 8

logger = logging.getLogger("distml.federated.hub")


class HubConfig(BaseModel):
    """The hub's rules. The defaults refuse what breaks a model for good (an exploding norm or
    loss) while leaving room for honest fine-tuning: one epoch of SGD on the digits moves a
    model by an L2 norm of 2 to 5 and lowers its held-out loss."""

    model: str = "digits-mlp"
    seed: int = 0
    threshold: float = Field(0.01, ge=0, le=1, description="accuracy a contribution may cost")
    max_norm: float = Field(
        100.0, gt=0, allow_inf_nan=False, description="L2 bound of a merged delta"
    )
    max_loss_rise: float = Field(
        0.1,
        ge=0,
        allow_inf_nan=False,
        description="held-out mean cross-entropy (nats) a contribution may add",
    )
    refusals_kept: int = Field(
        100, ge=1, le=10_000, description="refusals kept in the log (all are counted)"
    )

    @field_validator("model")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in FEDERATED_MODELS:
            raise ValueError(f"unknown model {name!r}; expected one of {sorted(FEDERATED_MODELS)}")
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
        raise ContributionRefused(
            f"unknown parameters {_some(unknown)}; the model has {sorted(params)}"
        )
    for name in sorted(delta):
        t, p = delta[name], params[name]
        if t.shape != p.shape or t.dtype != p.dtype:
            raise ContributionRefused(
                f"{name}: got {t.dtype} {tuple(t.shape)}, expected {p.dtype} {tuple(p.shape)}"
            )
        if not torch.isfinite(t).all():
            raise ContributionRefused(f"{name}: non-finite values")


def _some(names: list[str]) -> str:
    """At most a few of ``names``, for a message: a payload may carry thousands."""
    if len(names) <= MAX_NAMES_IN_REASON:
        return str(names)
    return f"{names[:MAX_NAMES_IN_REASON]} and {len(names) - MAX_NAMES_IN_REASON} more"


def outputs_finite(model: nn.Module, data: TensorDataset, batch_size: int = 512) -> bool:
    """Whether every output of ``model`` on ``data`` is finite. A loss can stay finite over a
    -inf logit (of a class no example has), so the outputs themselves are checked."""
    model.eval()
    with torch.no_grad():
        return all(bool(torch.isfinite(model(x)).all()) for x, _ in DataLoader(data, batch_size))


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def _rank_and_alpha(meta: dict[str, str]) -> tuple[int, float]:
    """``r`` and ``alpha`` of the metadata; a rank past any layer's width is refused by the
    shapes it implies."""
    try:
        r, alpha = int(meta["r"]), finite_float(float(meta["alpha"]), "alpha")
    except (KeyError, ValueError) as exc:
        raise ContributionRefused(
            f"a LoRA contribution needs integer r and alpha: {str(exc)[:200]!r}"
        ) from None
    if r < 1 or not alpha > 0:
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


def _write_atomically(path: Path, data: bytes, *, sync: bool = True) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _finite_or_none(value: float) -> float | None:
    """JSON has no NaN: a metric that is not finite is logged as null."""
    return value if math.isfinite(value) else None


def _counted(counts: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """``counts`` with one more refusal; contributors come from the token table, so
    ``by_contributor`` stays as small as that table."""
    by_status, by_contributor = dict(counts["by_status"]), dict(counts["by_contributor"])
    status, who = str(record["status"]), str(record["contributor"])
    by_status[status] = by_status.get(status, 0) + 1
    by_contributor[who] = by_contributor.get(who, 0) + 1
    return {"total": counts["total"] + 1, "by_status": by_status, "by_contributor": by_contributor}


def _logged(entry: dict[str, Any], reason: str, status: int) -> dict[str, Any]:
    """A refusal as the log keeps it: what the sender wrote, cut to a bounded size."""
    record = {**entry, "status": status, "reason": reason[:MAX_LOGGED_REASON]}
    if isinstance(record.get("description"), str):
        record["description"] = record["description"][:MAX_LOGGED_DESCRIPTION]
    return record


NO_REFUSALS: dict[str, Any] = {"total": 0, "by_status": {}, "by_contributor": {}}


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
        self.refused: dict[str, Any] = copy.deepcopy(NO_REFUSALS)
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
        """The versions, the latest refusals and the counts of all refusals."""
        with self._state:
            return copy.deepcopy(
                {
                    "model": self.config.model,
                    "latest": self.latest,
                    "threshold": self.config.threshold,
                    "max_norm": self.config.max_norm,
                    "max_loss_rise": self.config.max_loss_rise,
                    "versions": self.versions,
                    "refusals": self.refusals,
                    "refused": self.refused,
                }
            )

    def health(self) -> dict[str, Any]:
        """Reads the latest version's header back from disk and finds the log: a hub that cannot
        read its directory is not healthy. Its cost does not grow with the log."""
        with self._state:
            latest, name, refused = self.latest, self.versions[-1]["file"], self.refused["total"]
        (self.directory / LOG).stat()
        with open(self.directory / name, "rb") as f:
            if len(f.read(8)) != 8:
                raise RuntimeError(f"{name}: cut short")
        return {"model": self.config.model, "latest": latest, "refused": refused}

    # -- contributing -----------------------------------------------------------------------
    def contribute(
        self, contributor: str, body: bytes, *, base: int | None, kind: str
    ) -> dict[str, Any]:
        """Judge one contribution; the new version's record, or :class:`ContributionRefused`
        (logged with its reason). A failure of the hub's own while judging refuses the
        contribution with status 500 and changes nothing: the hub goes on with the next."""
        entry = {"contributor": contributor, "time": _now(), "base": base}
        entry |= {"kind": kind if kind in KINDS else None}
        entry |= {"sha256": _sha256(body), "bytes": len(body)}
        with self._judging:
            try:
                if kind not in KINDS:
                    raise ContributionRefused(
                        f"kind must be one of {list(KINDS)}, got {kind[:40]!r}"
                    )
                return self._merge(entry, body)
            except ContributionRefused as exc:
                self._refuse(entry | exc.details, str(exc), exc.status)
                raise
            except Exception as exc:
                logger.exception("judging a contribution of %s failed; it is dropped", contributor)
                reason = f"the hub failed while judging it ({type(exc).__name__}); nothing changed"
                self._refuse(entry, reason, 500)
                raise ContributionRefused(reason, 500) from exc

    def refuse(self, contributor: str, reason: str, status: int, **entry: Any) -> None:
        """Log a contribution refused before it reached the hub (a body over the limit)."""
        with self._judging:
            self._refuse({"contributor": contributor, "time": _now(), **entry}, reason, status)

    def _merge(self, entry: dict[str, Any], body: bytes) -> dict[str, Any]:
        kind, base = entry["kind"], entry["base"]
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
        if size > bound * (1 + 1e-6):
            raise ContributionRefused(f"delta norm {size:.4g} is above the bound {bound:g}")
        merged = {n: p + delta[n] if n in delta else p for n, p in self.params.items()}
        self._judge(entry, merged)
        record = self._write_version({"version": self.latest + 1, **entry}, merged)
        self._write_log(self.versions + [record])
        with self._state:
            self.versions.append(record)
            self.params = merged
        return copy.deepcopy(record)

    def _judge(self, entry: dict[str, Any], merged: Params) -> None:
        """Refuse ``merged`` unless the rules of the module's docstring admit it; ``entry``
        gets the metrics before and after either way."""
        parent, config = self.versions[-1], self.config
        entry |= {"parent": self.latest, "stale": entry["base"] != self.latest}
        entry |= {"threshold": config.threshold, "max_loss_rise": config.max_loss_rise}
        entry |= {"accuracy_before": parent["accuracy_after"], "loss_before": parent["loss_after"]}
        if not all(torch.isfinite(p).all() for p in merged.values()):
            raise ContributionRefused("the merged parameters would not be finite")
        after = self._evaluate(merged)
        entry |= {"accuracy_after": after["accuracy"], "loss_after": after["loss"]}
        if after["loss"] is None:
            raise ContributionRefused("the merged model's held-out outputs would not be finite")
        # Accuracies are multiples of 1/n: the slack only absorbs the rounding of the subtraction.
        if after["accuracy"] < parent["accuracy_after"] - config.threshold - 1e-9:
            raise ContributionRefused(
                f"held-out accuracy would fall from {parent['accuracy_after']:.4f} to "
                f"{after['accuracy']:.4f}, more than the threshold {config.threshold:g}"
            )
        before = parent["loss_after"]
        if before is not None and after["loss"] > before + config.max_loss_rise + 1e-9:
            raise ContributionRefused(
                f"held-out loss would rise from {before:.4f} to {after['loss']:.4g}, more than "
                f"the bound {config.max_loss_rise:g}"
            )

    def _refuse(self, entry: dict[str, Any], reason: str, status: int) -> None:
        record = _logged(entry, reason, status)
        with self._state:
            self.refusals = (self.refusals + [record])[-self.config.refusals_kept :]
            self.refused = _counted(self.refused, record)
        try:
            self._write_refusals()
        except OSError:
            logger.exception("could not write %s; the refusal is answered all the same", REFUSALS)

    def _evaluate(self, params: Params) -> dict[str, Any]:
        """Held-out loss and accuracy of ``params``; the loss is None when an output is not
        finite."""
        set_params(self.model, params)
        metrics = evaluate(self.model, self.held_out)
        finite = outputs_finite(self.model, self.held_out)
        return metrics | {"loss": _finite_or_none(metrics["loss"]) if finite else None}

    # -- the directory ----------------------------------------------------------------------
    def _write_version(self, record: dict[str, Any], params: Params) -> dict[str, Any]:
        name = f"v{record['version']:06d}.safetensors"
        meta = {"model": self.config.model, "version": str(record["version"])}
        body = encode_tensors(params, meta | {"provenance": json.dumps(record)})
        _write_atomically(self.directory / name, body)
        return record | {"file": name, "file_sha256": _sha256(body)}

    def _write_log(self, versions: list[dict[str, Any]]) -> None:
        log = {"format": 2, "model": self.config.model, "versions": versions}
        _write_atomically(self.directory / LOG, json.dumps(log, indent=1).encode())

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
        if metrics["loss"] is None:
            raise ValueError(f"{initial}: its held-out outputs are not finite")
        record |= {"accuracy_before": None, "accuracy_after": metrics["accuracy"]}
        record |= {"loss_before": None, "loss_after": metrics["loss"]}
        record = self._write_version(record, params)
        self._write_log([record])
        self._write_refusals()
        self.versions = [record]
        return params

    def _write_refusals(self) -> None:
        """Only the thread that judges writes the refusal log, so it reads it without a lock."""
        snapshot = {"format": 1, "model": self.config.model, "refused": self.refused}
        snapshot["recent"] = self.refusals
        _write_atomically(self.directory / REFUSALS, json.dumps(snapshot).encode(), sync=False)

    def _resume(self, initial: Path | None) -> Params:
        log = json.loads((self.directory / LOG).read_bytes())
        if log.get("format") not in (1, 2) or log.get("model") != self.config.model:
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
        self.versions = log["versions"]
        self._resume_refusals(log.get("refusals", []))
        return params

    def _resume_refusals(self, older: list[dict[str, Any]]) -> None:
        """The refusal log as it was; one only in ``hub.json`` (format 1) is counted and cut to
        the last ``refusals_kept``. A lost or damaged refusal log costs its entries, not the hub."""
        try:
            saved = json.loads((self.directory / REFUSALS).read_bytes())
            self.refusals, self.refused = saved["recent"], saved["refused"]
        except FileNotFoundError:
            for record in older:
                self.refused = _counted(self.refused, record)
            self.refusals = older
        except (OSError, ValueError, KeyError, TypeError):
            logger.warning("%s is damaged; the refusal log starts again", REFUSALS)
        self.refusals = self.refusals[-self.config.refusals_kept :]
