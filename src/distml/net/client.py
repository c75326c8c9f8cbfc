"""The client side of a distml service: httpx with the bearer token, and retries with
exponential back-off for the failures a restart causes (refused connections, 502/503/504)."""

from __future__ import annotations

import random
import ssl
import time
from typing import Any

import httpx

RETRY_STATUS = {502, 503, 504}


class ServiceError(RuntimeError):
    """A request that failed for good: a 4xx, or a service still down after every retry."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServiceClient:
    """One service, one connection pool. ``retry_s`` bounds how long a request keeps retrying
    while the service is down (a restarting server takes a few seconds to come back).

    >>> client = ServiceClient("http://127.0.0.1:8080", token="s3cret")  # doctest: +SKIP
    >>> client.request("GET", "/healthz").json()                         # doctest: +SKIP
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 60.0,
        retry_s: float = 60.0,
        verify: bool | str | ssl.SSLContext = True,
    ):
        self.url = url.rstrip("/")
        self.retry_s = retry_s
        if isinstance(verify, str):  # a CA bundle: httpx takes it as an SSL context
            verify = ssl.create_default_context(cafile=verify)
        self._http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
            verify=verify,
        )
        self.reconnects = 0

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        deadline = time.monotonic() + self.retry_s
        delay = 0.05
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                failure: str = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code not in RETRY_STATUS:
                    if response.status_code >= 400:
                        raise ServiceError(
                            f"{method} {self.url}{path}: {response.status_code} {response.text}",
                            response.status_code,
                        )
                    return response
                failure = f"{response.status_code} {response.text}"
            if time.monotonic() + delay > deadline:
                raise ServiceError(f"{method} {self.url}{path}: still failing ({failure})")
            self.reconnects += 1
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 2.0)

    def close(self) -> None:
        self._http.close()
