"""The contribution hub on the network (the rules are in :mod:`distml.federated.hub`): its routes,
and the contributor's side — fetch the latest version, fine-tune it on local data, submit the delta.

Routes, each behind a contributor's own bearer token (the token says who contributes):

- ``GET /v1/model?version=V``: a version's safetensors file (the latest by default); its
  metadata holds the version and its provenance.
- ``GET /v1/versions``: the provenance log: every version, the latest refusals and counts of all.
- ``POST /v1/contributions?base=V&kind=full|lora``: a safetensors body, the description in its
  metadata; 201 with the new version's record, or 4xx with the reason it was refused. At most
  ``max_pending`` contributions are read or judged at once; the others wait for a turn before
  their body is read, so a flood holds neither the memory of its bodies nor every thread.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from torch import nn
from torch.utils.data import TensorDataset

from distml.federated.hub import ContributionRefused, Hub, linear_layers
from distml.federated.task import FEDERATED_MODELS, Params, build_model, set_params, train_local
from distml.net import (
    ServiceClient,
    ServiceError,
    bounded_json,
    create_app,
    decode_tensors,
    encode_tensors,
    octet_stream_body,
    read_body,
)

# peft is imported only where a contribution is a LoRA adapter: it costs seconds to import.

if TYPE_CHECKING:
    import httpx

SAFETENSORS = "application/octet-stream"
MAX_VERSION = 2**31 - 1
MAX_LOG_BYTES = 256 * 2**20


def create_hub_app(
    hub: Hub, tokens: dict[str, str], *, max_body_bytes: int = 64 * 2**20, max_pending: int = 4
) -> FastAPI:
    """The ASGI app of ``hub``; ``tokens`` maps each contributor's name to their token."""
    registry = CollectorRegistry()
    outcomes = Counter(
        "distml_hub_contributions", "Contributions by outcome", ["status"], registry=registry
    )
    latest = Gauge("distml_hub_latest_version", "The latest model version", registry=registry)
    waiting = Gauge(
        "distml_hub_contributions_waiting", "Contributions waiting for a turn", registry=registry
    )
    if max_pending < 1:
        raise ValueError(f"max_pending must be >= 1, got {max_pending}")
    turns = asyncio.Semaphore(max_pending)

    def health() -> dict[str, Any]:
        status = hub.health()
        latest.set(status["latest"])
        return status

    app = create_app("distml contribution hub", tokens, health, registry)

    @app.get("/v1/model")
    async def model(version: int | None = Query(None, ge=0, le=MAX_VERSION)) -> Response:
        try:
            number, body = await run_in_threadpool(hub.model_body, version)
        except LookupError as exc:
            raise HTTPException(404, str(exc)) from None
        return Response(body, media_type=SAFETENSORS, headers={"X-Distml-Version": str(number)})

    @app.get("/v1/versions")
    async def versions() -> dict[str, Any]:
        return hub.log()

    async def judge(
        request: Request, contributor: str, base: int | None, kind: str
    ) -> dict[str, Any]:
        try:
            body = await read_body(request, max_body_bytes)
        except ClientDisconnect:
            raise HTTPException(400, "the body was cut short") from None
        except HTTPException as exc:
            await run_in_threadpool(
                hub.refuse, contributor, exc.detail, exc.status_code, base=base, kind=kind
            )
            outcomes.labels("refused").inc()
            raise
        try:
            # Judging evaluates the model: off the event loop, so reads are served meanwhile.
            record = await run_in_threadpool(
                hub.contribute, contributor, body, base=base, kind=kind
            )
        except ContributionRefused as exc:
            outcomes.labels("refused").inc()
            raise HTTPException(exc.status, str(exc)) from None
        outcomes.labels("accepted").inc()
        latest.set(record["version"])
        return record

    @app.post(
        "/v1/contributions",
        status_code=201,
        openapi_extra=octet_stream_body(
            max_body_bytes, "the delta as safetensors, its description in the metadata"
        ),
    )
    async def contribute(
        request: Request,
        base: int | None = Query(None, ge=0, le=MAX_VERSION),
        kind: Literal["full", "lora"] = "full",
    ) -> dict[str, Any]:
        contributor = request.state.identity
        if contributor is None:
            raise HTTPException(403, "contributions need a contributor's own token")
        waiting.inc()
        try:
            await turns.acquire()
        finally:
            waiting.dec()
        try:
            return await judge(request, contributor, base, kind)
        finally:
            turns.release()

    return app


class HubClient:
    """A contributor's connection to a hub.

    >>> hub = HubClient("http://127.0.0.1:7500", token)           # doctest: +SKIP
    >>> version, params, meta = hub.model()                        # doctest: +SKIP
    >>> hub.contribute(body, base=version, kind="full")["version"]  # doctest: +SKIP
    """

    def __init__(self, url: str, token: str, *, verify: bool | str = True, retry_s: float = 10):
        self._http = ServiceClient(url, token, verify=verify, retry_s=retry_s)

    def model(self, version: int | None = None) -> tuple[int, Params, dict[str, str]]:
        """(version, parameters, metadata); ServiceError when the answer is not a model this
        hub could serve."""
        params = {} if version is None else {"version": version}
        body = self._http.request("GET", "/v1/model", params=params).content
        try:
            tensors, meta = decode_tensors(body)
            number = meta.get("version", "")
            if meta.get("model") not in FEDERATED_MODELS or not (
                number.isdigit() and len(number) < 11
            ):
                raise ValueError(f"metadata model={meta.get('model')!r}, version={number!r}")
        except ValueError as exc:
            raise ServiceError(f"GET /v1/model: not a model of a hub: {str(exc)[:200]}") from None
        return int(number), tensors, meta

    def versions(self) -> dict[str, Any]:
        return self._json(self._http.request("GET", "/v1/versions"))

    def contribute(self, body: bytes, *, base: int, kind: str) -> dict[str, Any]:
        """The new version's record; a refusal raises ServiceError with its status and reason.
        A retried request cannot merge twice: the hub refuses a payload it has merged."""
        query = {"base": base, "kind": kind}
        response = self._http.request("POST", "/v1/contributions", params=query, content=body)
        return self._json(response)

    @staticmethod
    def _json(response: httpx.Response) -> dict[str, Any]:
        """A JSON object of the hub's, bounded: a hub is a peer too."""
        try:
            value = bounded_json(response.content, max_bytes=MAX_LOG_BYTES)
        except ValueError as exc:
            raise ServiceError(f"{response.url}: {exc}") from None
        if not isinstance(value, dict):
            raise ServiceError(f"{response.url}: a JSON {type(value).__name__}, not an object")
        return value

    def close(self) -> None:
        self._http.close()


def adapters_of(peft_model: nn.Module, adapter: str = "default") -> tuple[Params, dict[str, str]]:
    """The LoRA adapters of a peft model as the hub takes them: tensors ``M.lora_A`` and
    ``M.lora_B`` per adapted Linear layer ``M``, and metadata ``r`` and ``alpha``."""
    from peft.tuners.lora import LoraLayer

    config = peft_model.peft_config[adapter]
    if config.use_rslora or config.use_dora or config.fan_in_fan_out:
        raise ValueError("the hub merges plain LoRA: no rsLoRA, DoRA or fan_in_fan_out")
    tensors = {}
    for name, module in peft_model.base_model.model.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A:
            if module.scaling[adapter] != config.lora_alpha / config.r:
                raise ValueError(f"{name}: a rank or alpha of its own; the hub takes one of each")
            tensors[f"{name}.lora_A"] = module.lora_A[adapter].weight.detach().clone()
            tensors[f"{name}.lora_B"] = module.lora_B[adapter].weight.detach().clone()
    return tensors, {"r": str(config.r), "alpha": repr(float(config.lora_alpha))}


def fine_tune(
    model_name: str,
    params: Params,
    data: TensorDataset,
    *,
    description: str,
    lora_r: int | None = None,
    lora_alpha: float | None = None,
    epochs: int = 1,
    batch_size: int = 10,
    lr: float = 0.1,
    seed: int = 0,
) -> tuple[bytes, str]:
    """A contribution's payload and kind: SGD on ``data`` from ``params``, of every parameter,
    or (with ``lora_r``) of LoRA adapters on every Linear layer, alpha = r unless given."""
    model: nn.Module = build_model(model_name, seed)
    set_params(model, params)
    if lora_r is None:
        fit = train_local(model, data, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed)
        return encode_tensors(fit.delta, {"description": description}), "full"
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora_r,
        lora_alpha=lora_r if lora_alpha is None else lora_alpha,
        target_modules=sorted(linear_layers(model)),
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, config)  # A from the seeded generator, B = 0
    # Only the adapters have gradients, so plain SGD over all parameters trains only them.
    train_local(peft_model, data, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed)
    tensors, meta = adapters_of(peft_model)
    return encode_tensors(tensors, meta | {"description": description}), "lora"
