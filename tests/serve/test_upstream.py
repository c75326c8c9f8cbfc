"""The router's connections to its replicas (distml.serve.upstream): against a real replica
service, and against scripted peers that misbehave -- garbage, an answer too large, silence, a
kept connection closed as it is reused. Each peer is a server on the loopback, in this
process."""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Awaitable, Callable

import pytest
from fastapi import Request
from starlette.responses import Response

from conftest import self_signed
from distml.net import BackgroundServer, create_app
from distml.serve.upstream import UnsafeHeader, Upstream, UpstreamError

TOKEN = "upstream-token-0123456789"
OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"


def test_requests_reuse_one_connection_and_carry_the_token_and_headers():
    app = create_app("echo", TOKEN, health=lambda: {})

    @app.post("/echo")
    async def echo(request: Request) -> Response:
        body = await request.body()
        port = request.client.port if request.client else 0
        headers = {"Inference-Header-Content-Length": request.headers.get("x-length", "-")}
        return Response(f"{len(body)} {port}".encode(), headers=headers, media_type="text/csv")

    async def main(url: str) -> list[tuple[int, bytes, dict[str, str]]]:
        kept = ("content-type", "inference-header-content-length")
        upstream = Upstream(url, TOKEN, kept=kept)
        answers = []
        for size in (0, 10, 100_000):
            answer = await upstream.request("POST", "/echo", b"x" * size, {"X-Length": str(size)})
            answers.append((answer.status, answer.body, answer.headers))
        upstream.close()
        return answers

    with BackgroundServer(app) as server:
        answers = asyncio.run(main(server.url))
    ports = {body.split()[1] for _, body, _ in answers}
    assert len(ports) == 1  # one keep-alive connection for all three
    for (status, body, headers), size in zip(answers, (0, 10, 100_000), strict=True):
        assert status == 200
        assert body.split()[0] == str(size).encode()
        assert headers == {
            "content-type": "text/csv; charset=utf-8",
            "inference-header-content-length": str(size),
        }


Handler = Callable[[int, bytes, asyncio.StreamWriter], Awaitable[None]]


async def scripted(
    handle: Handler, tls: ssl.SSLContext | None = None
) -> tuple[asyncio.Server, str, list[int]]:
    """A peer that calls ``handle(connection number, request head, writer)`` for each request
    head it reads, over TLS with ``tls``; the list counts the requests of each connection."""
    requests: list[int] = []

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = len(requests)
        requests.append(0)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"Content-Length: (\d+)", head)
                await reader.readexactly(int(length[1]) if length else 0)
                requests[number] += 1
                await handle(number, head, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client closed, or the test ended
        finally:
            writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    return server, f"{'https' if tls else 'http'}://127.0.0.1:{port}", requests


def test_a_kept_connection_closed_as_it_is_reused_is_retried_on_a_new_one():
    async def handle(number: int, head: bytes, writer: asyncio.StreamWriter) -> None:
        if (number, requests[number]) == (0, 2):  # its keep-alive ran out as the request came
            writer.transport.abort()
            return
        writer.write(OK)

    async def main() -> list[int]:
        nonlocal requests
        server, url, requests = await scripted(handle)
        upstream = Upstream(url, TOKEN)
        for _ in range(3):
            answer = await upstream.request("GET", "/v2/health/ready")
            assert (answer.status, answer.body) == (200, b"ok")
        server.close()
        return requests

    requests: list[int] = []
    # Connection 0 answered one and was dropped on its second; connection 1 took that one
    # again and the third.
    assert asyncio.run(main()) == [2, 2]


@pytest.mark.parametrize(
    "answer, error",
    [
        (b"garbage\r\n\r\n", "malformed"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5000\r\n\r\n" + b"x" * 5000, "over 1000 bytes"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", "closed"),
    ],
    ids=["garbage", "too-large", "cut-off"],
)
def test_a_peer_that_garbles_its_answer_fails_the_request(answer: bytes, error: str):
    async def handle(number: int, head: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def main() -> None:
        server, url, _ = await scripted(handle)
        upstream = Upstream(url, TOKEN, max_body=1000)
        with pytest.raises(UpstreamError, match=error):
            await upstream.request("POST", "/infer", b"{}")
        server.close()

    asyncio.run(main())


def test_a_silent_peer_times_out_and_its_connection_is_not_reused():
    async def handle(number: int, head: bytes, writer: asyncio.StreamWriter) -> None:
        if number == 1:
            writer.write(OK)

    async def main() -> list[int]:
        server, url, requests = await scripted(handle)
        upstream = Upstream(url, TOKEN)
        with pytest.raises(TimeoutError):
            await upstream.request("GET", "/", timeout_s=0.2)
        answer = await upstream.request("GET", "/")
        assert answer.body == b"ok"
        server.close()
        return requests

    assert asyncio.run(main()) == [1, 1]  # the answer came on a new connection


def test_a_header_that_would_split_the_request_is_refused_before_anything_is_sent():
    async def handle(number: int, head: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(OK)

    async def main() -> list[int]:
        server, url, requests = await scripted(handle)
        upstream = Upstream(url, TOKEN)
        for value in ("a\r\nX-Injected: 1", "a\nb", "a\x00"):
            with pytest.raises(UnsafeHeader):
                await upstream.request("POST", "/", b"", {"Content-Type": value})
        server.close()
        return requests

    assert asyncio.run(main()) == []  # not even a connection


def test_a_peer_that_is_not_there_fails_the_request():
    async def main() -> None:
        server, url, _ = await scripted(lambda *_: asyncio.sleep(0))
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await Upstream(url, TOKEN).request("GET", "/")

    asyncio.run(main())


def test_a_replica_over_tls_is_reached_with_its_ca_and_refused_without(tmp_path):
    cert, key = self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)

    async def handle(number: int, head: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(OK)

    async def main() -> None:
        server, url, _ = await scripted(handle, tls)
        answer = await Upstream(url, TOKEN, verify=str(cert)).request("GET", "/")
        assert (answer.status, answer.body) == (200, b"ok")
        with pytest.raises(UpstreamError, match="CERTIFICATE_VERIFY_FAILED"):
            await Upstream(url, TOKEN).request("GET", "/")  # the system's CAs: unknown issuer
        unverified = await Upstream(url, TOKEN, verify=False).request("GET", "/")
        assert unverified.body == b"ok"
        server.close()

    asyncio.run(main())
