"""The router's connections to its replicas: HTTP/1.1 with keep-alive, one request at a time on
each connection, answers parsed by httptools (the C parser uvicorn serves with).

A router on the machine of its replicas takes its CPU from them, so its calls must cost next to
nothing. This client writes the request in one call and reads the answer with the parser's
callbacks, nothing more: calling one replica at the router's concurrency it spent 0.09 ms of
CPU a one-row request, against 0.19 for aiohttp's client and 2.00 for httpx's, measured in one
run (``benchmarks/serving.py``, part ``replicas``; BENCHMARKS.md, "Serving").

>>> replica = Upstream("http://10.0.0.1:8100", token)  # doctest: +SKIP
>>> await replica.request("POST", "/v2/models/m/infer", body, headers)  # doctest: +SKIP
Answer(status=200, body=b'{"model_name": "m", ...', headers={'content-type': 'application/json'})
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

# A header value the router sends on must not end its line or the head: no control characters.
_UNSAFE_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class UpstreamError(Exception):
    """The replica could not be reached, or it broke off or garbled its answer."""


class UnsafeHeader(ValueError):
    """A header value that would change the request's framing (a line break in it)."""


@dataclass
class Answer:
    status: int
    body: bytes
    headers: dict[str, str]  # those asked for, by their lower-case names


class _Connection(asyncio.Protocol):
    """One connection to a replica; :meth:`exchange` sends a request and waits for its answer."""

    def __init__(self, kept: frozenset[bytes], max_body: int):
        self._parser = httptools.HttpResponseParser(self)
        self._kept, self._max_body = kept, max_body
        self.transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[Answer] | None = None
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0
        self.answered_any = False  # did the replica send a byte since the request went out
        self.reusable = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.answered_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"a malformed answer ({exc})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self._fail(UpstreamError(f"the connection closed ({exc or 'by the replica'})"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in self._kept:
            self._headers[name.decode("latin-1")] = value.strip().decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self._max_body:
            self._fail(UpstreamError(f"an answer over {self._max_body} bytes"))
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():  # an answer nobody asked for: drop the connection
            self._fail(UpstreamError("an answer to no request"))
            return
        self.reusable = self._parser.should_keep_alive()
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        waiter.set_result(Answer(self._parser.get_status_code(), body, self._headers))

    def _fail(self, error: UpstreamError) -> None:
        self.reusable = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(error)
        if self.transport is not None:
            self.transport.close()

    async def exchange(self, request: bytes, deadline: float) -> Answer:
        """Send ``request``, and return its answer; ``TimeoutError`` at the loop's time
        ``deadline`` (a timer handle of the loop's own: cheaper than ``asyncio.timeout``)."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        self._headers, self._body, self._size = {}, [], 0
        self.answered_any = self.reusable = False
        self.transport.write(request)
        timer = loop.call_at(deadline, self._expire)
        try:
            return await waiter
        finally:
            timer.cancel()

    def _expire(self) -> None:
        self.reusable = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(TimeoutError("the replica did not answer in time"))
        if self.transport is not None:
            self.transport.close()

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()


class Upstream:
    """Keep-alive connections to one replica (at most ``max_idle`` kept open between requests),
    every request carrying ``Authorization: Bearer <token>``; an answer's headers named in
    ``kept`` come back in :attr:`Answer.headers`."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        verify: bool | str = True,
        timeout_s: float = 30.0,
        kept: tuple[str, ...] = ("content-type",),
        max_body: int = 256 * 2**20,
        max_idle: int = 64,
    ):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a replica's URL is http(s)://host[:port], not {url!r}")
        self.url = url
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            cafile = verify if isinstance(verify, str) else None
            self._ssl = ssl.create_default_context(cafile=cafile)
            if verify is False:
                self._ssl.check_hostname = False
                self._ssl.verify_mode = ssl.CERT_NONE
        common = f"Host: {parts.netloc}\r\nAuthorization: Bearer {token}\r\n"
        self._common = common.encode("latin-1")
        self._timeout_s = timeout_s
        self._kept = frozenset(k.lower().encode("latin-1") for k in kept)
        self._max_body, self._max_idle = max_body, max_idle
        self._idle: list[_Connection] = []

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Answer:
        """The replica's answer (any status). Raises :class:`UpstreamError` (or ``OSError``)
        when the replica cannot be reached or breaks off, ``TimeoutError`` after ``timeout_s``,
        :class:`UnsafeHeader` for a header value with a line break (nothing is sent)."""
        request = self._encode(method, path, body, headers or {})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self._timeout_s if timeout_s is None else timeout_s)
        connection, reused = await self._connection(deadline)
        try:
            try:
                answer = await connection.exchange(request, deadline)
            except UpstreamError:
                if not reused or connection.answered_any:
                    raise
                # The replica closed a kept connection as it was reused (its keep-alive ran
                # out) and sent nothing: the request goes once more, on a new connection.
                connection = await self._connect(deadline)
                answer = await connection.exchange(request, deadline)
        except BaseException:
            connection.close()  # failed, cancelled or timed out mid-answer: spent
            raise
        if connection.reusable and len(self._idle) < self._max_idle:
            self._idle.append(connection)
        else:
            connection.close()
        return answer

    def _encode(self, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
        lines = [f"{method} {path} HTTP/1.1\r\n".encode("latin-1"), self._common]
        for name, value in headers.items():
            if _UNSAFE_VALUE.search(value) or _UNSAFE_VALUE.search(name):
                raise UnsafeHeader(f"header {name!r}: a control character in its value")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        if body or method == "POST":
            lines.append(b"Content-Length: %d\r\n" % len(body))
        lines.append(b"\r\n")
        lines.append(body)
        return b"".join(lines)

    async def _connection(self, deadline: float) -> tuple[_Connection, bool]:
        while self._idle:
            connection = self._idle.pop()  # the newest: least likely to have timed out
            if connection.open:
                return connection, True
        return await self._connect(deadline), False

    async def _connect(self, deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        connecting = loop.create_connection(
            lambda: _Connection(self._kept, self._max_body), self._host, self._port, ssl=self._ssl
        )
        try:
            _, connection = await asyncio.wait_for(connecting, max(0.0, deadline - loop.time()))
        except OSError as exc:
            raise UpstreamError(f"cannot connect ({exc})") from exc
        return connection

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
