"""The client side of a distml service: httpx with the bearer token, and retries with
exponential back-off for the failures a restart causes (refused connections, 502/503/504).

:class:`KeepAliveClient` is the same contract on a hot path (a parameter-server worker's
pushes and pulls): the standard library's ``http.client`` on kept-alive HTTP/1.1 connections,
a fraction of httpx's CPU per request (``benchmarks/ps_transport.py`` measures both, with
urllib3 and aiohttp), bodies sent as the caller's buffers and read into one ``bytearray``,
and requests to several services sent before any answer is read, so that the services work
at once without a thread per call.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx

RETRY_STATUS = {502, 503, 504}


# What a request that never got its answer raises: a refused or reset connection, a kept-alive
# one the server closed meanwhile (uvicorn closes idle ones after 5 s), a timeout.
TRANSPORT_ERRORS = (OSError, http.client.HTTPException)


class ServiceError(RuntimeError):
    """A request that failed for good: a 4xx, or a service still down after every retry."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class Backoff:
    """The clients' retry policy: waits from 50 ms doubling to 2 s, jittered, for ``retry_s``."""

    def __init__(self, retry_s: float):
        self.deadline = time.monotonic() + retry_s
        self.delay = 0.05

    def expired(self) -> bool:
        """Whether the next wait would end past the deadline."""
        return time.monotonic() + self.delay > self.deadline

    def sleep(self) -> None:
        time.sleep(self.delay * (0.5 + random.random()))
        self.delay = min(self.delay * 2, 2.0)


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
        backoff = Backoff(self.retry_s)
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
            if backoff.expired():
                raise ServiceError(f"{method} {self.url}{path}: still failing ({failure})")
            self.reconnects += 1
            backoff.sleep()

    def close(self) -> None:
        self._http.close()


@dataclass
class Answer:
    """A service's answer: its status, headers (looked up case-insensitively) and body."""

    status: int
    headers: Mapping[str, str]
    content: bytearray | memoryview  # a view of the caller's buffer, when it gave one

    def json(self) -> Any:
        return json.loads(bytes(self.content))

    @property
    def text(self) -> str:
        return bytes(self.content).decode("utf-8", "replace")


Body = bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview] | None


class KeepAliveClient:
    """One service over kept-alive HTTP/1.1 connections, with :class:`ServiceClient`'s token,
    retries and errors. Thread-safe: each request takes a connection of its own from a pool.

    A body is a buffer, or a list of buffers sent one after the other (a safetensors header
    and its tensors' memory, never joined into one copy). Every distml request a worker
    retries is idempotent (pushes carry their step, claims their position), so a request
    whose connection failed is sent again.

    >>> client = KeepAliveClient("http://127.0.0.1:8080", token="s3cret")  # doctest: +SKIP
    >>> client.request("GET", "/healthz").json()                           # doctest: +SKIP
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
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self._host, self._port, self._prefix = parts.hostname, parts.port, parts.path
        self._context = _ssl_context(verify) if parts.scheme == "https" else None
        self._headers = {"Authorization": f"Bearer {token}"}
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self.reconnects = 0

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        content: Body = None,
        ok: Iterable[int] = (),
        into: bytearray | None = None,
    ) -> Answer:
        """The answer to ``method path?params``, retried while the service is down (refused
        connections, 502/503/504) for up to ``retry_s``; :class:`ServiceError` for a 4xx not
        in ``ok``, or a service still failing after that. With ``into``, the body is read
        into that buffer (grown to fit) and the answer's content is a view of it, valid until
        the next answer is read into it: for a caller that reads answers of one size again and
        again, whose pages the kernel then need not fault in afresh each time."""
        pending = self.send(method, path, params=params, content=content)
        return self.receive(pending, ok=ok, into=into)

    def send(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        content: Body = None,
    ) -> Pending:
        """Send a request and return at once, its answer unread (:meth:`receive` reads it):
        requests to several services, sent one after the other, are worked on together."""
        target = self._prefix + path + ("?" + urlencode(params) if params else "")
        if content is not None and not isinstance(content, bytes | bytearray | memoryview):
            content = list(content)  # sent again as it was, should the request be retried
        pending = Pending(method, path, target, content)
        try:
            pending.connection = self._connection()
            self._put(pending)
        except TRANSPORT_ERRORS as exc:
            pending.failure = f"{type(exc).__name__}: {exc}"
        return pending

    def receive(
        self, pending: Pending, ok: Iterable[int] = (), into: bytearray | None = None
    ) -> Answer:
        """The answer to a request :meth:`send` sent (see :meth:`request`)."""
        backoff, attempt = Backoff(self.retry_s), 0
        while True:
            if pending.connection is not None:
                try:
                    answer = self._get(pending.connection, into)
                except TRANSPORT_ERRORS as exc:
                    pending.connection.close()
                    pending.failure = f"{type(exc).__name__}: {exc}"
                else:
                    self._release(pending.connection)
                    if answer.status not in RETRY_STATUS:
                        if answer.status >= 400 and answer.status not in ok:
                            raise ServiceError(
                                f"{pending.method} {self.url}{pending.path}: {answer.status} "
                                f"{answer.text[:2000]}",
                                answer.status,
                            )
                        return answer
                    pending.failure = f"{answer.status} {answer.text[:2000]}"
                pending.connection = None
            if backoff.expired():
                raise ServiceError(
                    f"{pending.method} {self.url}{pending.path}: still failing ({pending.failure})"
                )
            if attempt:  # the first retry goes at once: a kept-alive connection found closed
                backoff.sleep()
            attempt += 1
            self.reconnects += 1
            try:
                pending.connection = self._connection()
                self._put(pending)
            except TRANSPORT_ERRORS as exc:
                pending.connection = None
                pending.failure = f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    # -- connections ------------------------------------------------------------------------
    def _connection(self) -> http.client.HTTPConnection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        if self._context is not None:
            return _NoDelayHTTPS(
                self._host, self._port, timeout=self.timeout_s, context=self._context
            )
        return _NoDelayHTTP(self._host, self._port, timeout=self.timeout_s)

    def _release(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.append(connection)

    def _put(self, pending: Pending) -> None:
        connection, content = pending.connection, pending.content
        headers = dict(self._headers)
        if isinstance(content, bytes | bytearray | memoryview):
            headers["Content-Length"] = str(memoryview(content).nbytes)
        elif content is not None:  # buffers sent one after the other
            headers["Content-Length"] = str(sum(memoryview(c).nbytes for c in content))
        if content is not None:
            headers["Content-Type"] = "application/octet-stream"
        try:
            connection.request(pending.method, pending.target, body=content, headers=headers)
        except BaseException:
            connection.close()
            raise

    @staticmethod
    def _get(connection: http.client.HTTPConnection, into: bytearray | None) -> Answer:
        response = connection.getresponse()
        length = response.length
        body: bytearray | memoryview
        if length is None:  # no Content-Length: read to the end (a chunked answer)
            body = bytearray(response.read())
        else:
            body = _buffer(into, length)
            view, got = memoryview(body), 0
            while got < length:
                n = response.readinto(view[got:])
                if not n:
                    raise http.client.IncompleteRead(bytes(body[:got]), length - got)
                got += n
        if response.will_close:
            connection.close()  # reopened on its next request
        return Answer(response.status, response.headers, body)


@dataclass
class Pending:
    """A request sent and not yet answered (see :meth:`KeepAliveClient.send`)."""

    method: str
    path: str
    target: str
    content: Body
    connection: http.client.HTTPConnection | None = None
    failure: str = ""


class _NoDelayHTTP(http.client.HTTPConnection):
    """Headers and body go out as separate writes (the body is never copied onto the
    headers): without Nagle's algorithm the second never waits for the first's ACK."""

    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _NoDelayHTTPS(http.client.HTTPSConnection):
    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _buffer(into: bytearray | None, length: int) -> bytearray | memoryview:
    """``length`` bytes to read an answer into: the first of ``into``, grown to fit where it
    is short, or a new buffer (also when ``into`` cannot grow: a view of it is still held)."""
    if into is None:
        return bytearray(length)
    if len(into) < length:
        try:
            into.extend(bytes(length - len(into)))
        except BufferError:
            return bytearray(length)
    return memoryview(into)[:length]


def _ssl_context(verify: bool | str | ssl.SSLContext) -> ssl.SSLContext:
    if isinstance(verify, ssl.SSLContext):
        return verify
    if isinstance(verify, str):  # a CA bundle
        return ssl.create_default_context(cafile=verify)
    context = ssl.create_default_context()
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
