"""A service's hot route answered in uvicorn's HTTP protocol, ahead of ASGI.

:class:`distml.net.hot_path.HotPath` answers the route ahead of FastAPI, but still behind the
ASGI machinery: uvicorn's request cycle, its scope and its ``receive``/``send`` messages,
FastAPI's own outer middleware. A router, whose whole work is to pass a request on, spent three
fifths of its CPU in the Python interpreter (``perf``). With the route taken out of ASGI here,
and its calls to the replicas made lean (``distml.serve.upstream``), the router's CPU a request
went from 0.41 to 0.17 ms (BENCHMARKS.md, "Serving").

:class:`HotPathProtocol` is uvicorn's ``httptools`` protocol with the hot route taken out of
it: the request is parsed by uvicorn as always, then, if the route matches and ``accept`` takes
it, checked (token, body limit) and answered by the route's handler, its answer written in one
call. Everything else -- other routes, a refused ``accept``, a percent-encoded path, an
upgrade -- goes the usual way, and keep-alive, pipelining, flow control and graceful shutdown
stay uvicorn's: the hot request takes the place of uvicorn's request cycle, with the attributes
uvicorn reads of one.

:func:`http_protocol` picks it for an app that has a hot route, where uvicorn's ``httptools``
protocol is there to build on; otherwise uvicorn's own choice.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httptools
from starlette.datastructures import Headers

from distml.net.hot_path import HotRoute, Reply
from distml.net.untrusted import declared_over

try:
    from uvicorn.protocols.http.httptools_impl import (
        HEADER_VALUE_RE,
        STATUS_LINE,
        HttpToolsProtocol,
    )
except ImportError:  # an uvicorn without its httptools protocol: ASGI's path only
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

log = logging.getLogger("distml.net")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
INTERNAL_ERROR = Reply(500, b"Internal Server Error", "text/plain; charset=utf-8")


def http_protocol(app: Any) -> Any:
    """uvicorn's ``http`` setting for ``app``: :class:`HotPathProtocol` when ``app`` has a hot
    route (:func:`distml.net.hot_path.add_hot_path`), ``"auto"`` otherwise."""
    has_route = getattr(getattr(app, "state", None), "hot_route", None) is not None
    return HotPathProtocol if has_route and HttpToolsProtocol is not None else "auto"


class HotRequest:
    """One request of the hot route, in the place of uvicorn's request cycle on its
    connection: the protocol feeds it the body and the disconnect, as it feeds its own."""

    def __init__(self, protocol: HotPathProtocol, taken: Any, keep_alive: bool):
        self.protocol, self.taken = protocol, taken
        self.headers = Headers(raw=protocol.headers)
        # What uvicorn's protocol reads and writes of a request cycle.
        self.message_event = asyncio.Event()
        self.body = bytearray()
        self.more_body = True
        self.disconnected = False
        self.response_complete = False
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = protocol.expect_100_continue

    async def run_asgi(self, app: Any = None) -> None:
        """Answer the request (``app`` is unused: uvicorn passes it to a pipelined request)."""
        try:
            reply = await self._answer()
            if reply is not None and not self.disconnected:
                await self._send(reply)
        except Exception as exc:  # as uvicorn does for an app's exception: logged, a 500
            log.error("the hot route failed a request", exc_info=exc)
            if not self.response_complete and not self.disconnected:
                self.keep_alive = False
                await self._send(INTERNAL_ERROR)

    async def _answer(self) -> Reply | None:
        hot: HotRoute = self.protocol.hot
        refusal = hot.unauthorized(self.headers.get("authorization"))
        if refusal is not None:
            return refusal
        if declared_over(self.headers.get("content-length"), hot.max_body):
            self.keep_alive = False  # the body is left unread: the connection cannot go on
            return hot.too_large()
        while self.more_body and not self.disconnected:
            if len(self.body) > hot.max_body:
                break
            if self.waiting_for_100_continue:
                self.protocol.transport.write(CONTINUE)
                self.waiting_for_100_continue = False
            self.protocol.flow.resume_reading()  # paused while the body passed a high-water mark
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected:
            return None
        if len(self.body) > hot.max_body:
            self.keep_alive = False
            return hot.too_large()
        return await hot.answer(self.taken, [self.body], self.headers)  # type: ignore[list-item]

    async def _send(self, reply: Reply) -> None:
        protocol = self.protocol
        if protocol.flow.write_paused:
            await protocol.flow.drain()
        head = [STATUS_LINE[reply.status]]
        for name, value in protocol.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        extra = [("content-type", reply.content_type), *reply.headers.items()]
        for name, value in extra:
            raw = value.encode("latin-1")
            if HEADER_VALUE_RE.search(raw):
                raise ValueError(f"header {name!r}: a control character in its value")
            head += [name.encode("latin-1"), b": ", raw, b"\r\n"]
        head.append(b"content-length: %d\r\n" % len(reply.body))
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        head += [b"\r\n", reply.body]
        protocol.transport.write(b"".join(head))
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            protocol.transport.close()
        protocol.on_response_complete()


if HttpToolsProtocol is not None:

    class HotPathProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        """uvicorn's ``httptools`` protocol, answering its app's hot route itself."""

        def __init__(self, config: Any, *args: Any, **kwargs: Any):
            super().__init__(config, *args, **kwargs)
            self.hot: HotRoute | None = getattr(config.app.state, "hot_route", None)

        def on_headers_complete(self) -> None:
            taken = self._taken()
            if taken is None:
                return super().on_headers_complete()
            http_version = self.parser.get_http_version()
            keep_alive = http_version != "1.0" and self.parser.should_keep_alive()
            request, previous = HotRequest(self, taken, keep_alive), self.cycle
            self.cycle = request
            if previous is None or previous.response_complete:
                task = self.loop.create_task(request.run_asgi())
                task.add_done_callback(self.tasks.discard)
                self.tasks.add(task)
            else:  # pipelined behind a request still being answered: uvicorn starts it after
                self.flow.pause_reading()
                self.pipeline.appendleft((request, self.app))

        def _taken(self) -> Any:
            """What the hot route's ``accept`` gave for this request; None: not the route's."""
            hot = self.hot
            if (
                hot is None
                or self.parser.get_method() != b"POST"
                or self.parser.should_upgrade()
                or self.limit_concurrency is not None
                or self.root_path
            ):
                return None
            url = httptools.parse_url(self.url)
            if b"%" in url.path:  # decoded by uvicorn's path, as FastAPI routes it
                return None
            path = url.path.decode("ascii")
            match = hot.route.fullmatch(path)
            if match is None:
                return None
            scope = self.scope
            scope["method"], scope["path"], scope["raw_path"] = "POST", path, url.path
            scope["query_string"] = url.query or b""
            return hot.accept(match, scope)

else:  # pragma: no cover
    HotPathProtocol = None  # type: ignore[assignment,misc]
