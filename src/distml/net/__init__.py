"""The web plumbing every distml service shares: bearer-token auth, payload limits, health,
Prometheus metrics, tensors as safetensors bytes, and a client that retries with back-off."""

from distml.net.client import ServiceClient, ServiceError
from distml.net.service import (
    TOKEN_ENV,
    BackgroundServer,
    create_app,
    read_body,
    serve,
    token_from_env,
)
from distml.net.tensors import TensorPayloadError, decode_tensors, encode_tensors

__all__ = [
    "TOKEN_ENV",
    "BackgroundServer",
    "ServiceClient",
    "ServiceError",
    "TensorPayloadError",
    "create_app",
    "decode_tensors",
    "encode_tensors",
    "read_body",
    "serve",
    "token_from_env",
]
