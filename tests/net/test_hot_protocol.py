"""The hot route answered in uvicorn's protocol (distml.net.hot_protocol): the same answers and
refusals as through ASGI, never reaching the app, while every other request -- on the same
keep-alive connection, pipelined behind a hot one, or one that ``accept`` turns down -- still
goes to FastAPI. Servers run in this process, over loopback sockets."""

from __future__ import annotations

import re
import socket

import httpx
import pytest
from fastapi import FastAPI

from distml.net import BackgroundServer, create_app
from distml.net.hot_path import Reply, add_hot_path
from distml.net.hot_protocol import HotPathProtocol, http_protocol

TOKEN = "hot-protocol-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROUTE = re.compile(r"/echo/([a-z]{1,8})")
LIMIT = 1000


def echo_app() -> tuple[FastAPI, list[str]]:
    """A service whose hot route ``POST /echo/{word}`` answers the word and the body's length;
    the returned list records each request the app itself saw."""
    app = create_app("echo", TOKEN, health=lambda: {})

    def accept(match: re.Match[str], scope) -> str | None:
        return None if match[1] == "declined" else match[1]

    async def answer(word: str, chunks: list[bytes], headers) -> Reply:
        if word == "boom":
            raise RuntimeError("the handler failed")
        if word == "split":  # an answer whose header would end its line
            return Reply.json(200, {}, **{"X-Echo": "a\r\nX-Injected: 1"})
        body = b"".join(chunks)
        return Reply.json(200, {"word": word, "size": len(body)}, **{"X-Echo": "yes"})

    @app.post("/echo/{word}")
    async def slow_echo(word: str) -> dict[str, str]:
        return {"word": word, "by": "fastapi"}

    add_hot_path(app, route=ROUTE, accept=accept, answer=answer, max_body=LIMIT)
    seen: list[str] = []

    class Recording(type(app)):  # type: ignore[misc]
        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] == "http":
                seen.append(scope["path"])
            await super().__call__(scope, receive, send)

    app.__class__ = Recording
    return app, seen


@pytest.fixture
def echo():
    app, seen = echo_app()
    with BackgroundServer(app) as server:
        yield server.url, seen


def test_an_app_with_a_hot_route_is_served_by_the_protocol():
    assert http_protocol(echo_app()[0]) is HotPathProtocol
    assert http_protocol(create_app("plain", TOKEN, health=lambda: {})) == "auto"


def test_the_hot_route_is_answered_without_the_app_and_the_rest_by_it(echo):
    url, seen = echo
    with httpx.Client(base_url=url, headers=AUTH) as client:  # one keep-alive connection
        for _ in range(3):
            r = client.post("/echo/hello", content=b"x" * 10)
            assert r.status_code == 200, r.text
            assert r.json() == {"word": "hello", "size": 10}
            assert r.headers["x-echo"] == "yes"
            assert r.headers["content-type"] == "application/json"
            # Between hot requests, the same connection serves the app's routes.
            assert client.get("/healthz").status_code == 200
        declined = client.post("/echo/declined", content=b"")
        assert declined.json() == {"word": "declined", "by": "fastapi"}
        # A percent-encoded path goes the ASGI way, where the route's middleware answers it.
        encoded = client.post("/echo/%68ello", content=b"")  # "hello"
        assert encoded.json() == {"word": "hello", "size": 0}
    assert seen.count("/echo/hello") == 1  # the encoded one only
    assert seen.count("/healthz") == 3
    assert "/echo/declined" in seen


def test_refusals_come_as_through_asgi(echo):
    url, seen = echo
    with httpx.Client(base_url=url) as client:
        r = client.post("/echo/hello", content=b"x")
        assert r.status_code == 401
        assert r.json() == {"detail": "missing or wrong bearer token"}
        assert r.headers["www-authenticate"] == "Bearer"
        wrong = client.post("/echo/hello", content=b"x", headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401
        big = client.post("/echo/hello", content=b"x" * (LIMIT + 1), headers=AUTH)
        assert big.status_code == 413
        assert big.json() == {"error": f"body over the limit of {LIMIT} bytes"}

        def streamed():  # no declared length: counted as it comes
            for _ in range(LIMIT // 100 + 2):
                yield b"y" * 100

        chunked = client.post("/echo/hello", content=streamed(), headers=AUTH)
        assert chunked.status_code == 413
        failed = client.post("/echo/boom", content=b"", headers=AUTH)
        assert failed.status_code == 500
        split = client.post("/echo/split", content=b"", headers=AUTH)
        assert split.status_code == 500
        assert "x-injected" not in split.headers
        # The service goes on for everyone.
        assert client.post("/echo/hello", content=b"ok", headers=AUTH).json()["size"] == 2
    assert not [p for p in seen if p.startswith("/echo/hello")]


def request(method: str, path: str, body: bytes = b"") -> bytes:
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def test_pipelined_requests_are_answered_in_order(echo):
    url, _ = echo
    payload = (
        request("POST", "/echo/one", b"a")
        + request("GET", "/healthz")
        + request("POST", "/echo/two", b"bb")
        + request("POST", "/echo/declined", b"")
    )
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(payload)
        data = b""
        while data.count(b"HTTP/1.1 200") < 4:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    bodies = re.findall(rb"\r\n\r\n(\{[^}]*\})", data)
    assert bodies[0] == b'{"word": "one", "size": 1}'
    assert b'"status":"ok"' in bodies[1]
    assert bodies[2] == b'{"word": "two", "size": 2}'
    assert bodies[3] == b'{"word":"declined","by":"fastapi"}'


def test_expect_100_continue_is_answered_before_the_body(echo):
    url, _ = echo
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /echo/wait HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Content-Length: 3\r\nExpect: 100-continue\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        interim = sock.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100 Continue"), interim
        sock.sendall(b"abc")
        data = b""
        while not data.endswith(b"}"):
            data += sock.recv(65536)
    assert data.startswith(b"HTTP/1.1 200")
    assert data.endswith(b'{"word": "wait", "size": 3}')


def test_a_client_that_leaves_mid_body_does_not_stop_the_service(echo):
    url, _ = echo
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST /echo/gone HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        sock.sendall(head.encode() + b"Content-Length: 500\r\n\r\nab")
    with httpx.Client(base_url=url, headers=AUTH) as client:
        assert client.post("/echo/after", content=b"abc").json() == {"word": "after", "size": 3}
