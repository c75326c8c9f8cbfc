"""The web plumbing every distml service shares: bearer-token auth, payload limits, health,
Prometheus metrics, tensors as safetensors bytes, and a client that retries with back-off.

Names are imported on first use (PEP 562): a client (a preprocessing worker) needs neither the
server side (FastAPI) nor the tensor payloads (torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distml._lazy import lazy_getattr

if TYPE_CHECKING:
    from distml.net.client import ServiceClient, ServiceError
    from distml.net.service import (
        BackgroundLoops,
        BackgroundServer,
        LoopStopped,
        create_app,
        octet_stream_body,
        read_body,
        serve,
    )
    from distml.net.tensors import TensorPayloadError, decode_tensors, encode_tensors
    from distml.net.token import TOKEN_ENV, token_from_env
    from distml.net.untrusted import bounded_json, finite_float

_WHERE = {
    "ServiceClient": "distml.net.client",
    "ServiceError": "distml.net.client",
    "BackgroundLoops": "distml.net.service",
    "BackgroundServer": "distml.net.service",
    "LoopStopped": "distml.net.service",
    "octet_stream_body": "distml.net.service",
    "create_app": "distml.net.service",
    "read_body": "distml.net.service",
    "serve": "distml.net.service",
    "TensorPayloadError": "distml.net.tensors",
    "decode_tensors": "distml.net.tensors",
    "encode_tensors": "distml.net.tensors",
    "TOKEN_ENV": "distml.net.token",
    "token_from_env": "distml.net.token",
    "bounded_json": "distml.net.untrusted",
    "finite_float": "distml.net.untrusted",
}
__getattr__ = lazy_getattr("distml.net", {name: f"{m}:{name}" for name, m in _WHERE.items()})

__all__ = [
    "BackgroundLoops",
    "BackgroundServer",
    "LoopStopped",
    "ServiceClient",
    "ServiceError",
    "TOKEN_ENV",
    "TensorPayloadError",
    "bounded_json",
    "create_app",
    "decode_tensors",
    "encode_tensors",
    "finite_float",
    "octet_stream_body",
    "read_body",
    "serve",
    "token_from_env",
]
