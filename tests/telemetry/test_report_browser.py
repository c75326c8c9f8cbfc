"""A real run's report.html, opened in headless Chromium: every plot is there, decoded and laid
out with a size, and the page logs no error.

Chromium is driven through its DevTools protocol (a websocket, with aiohttp, a dev
dependency), so the page is read as the browser rendered it, unchanged. Install the browser with
``apt-get install -y chromium``; without one on PATH the test is skipped.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tiny_run import shared_tiny_run

from conftest import wait_for


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny_run(tmp_path_factory)


CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# Waits for every image to be decoded, then measures every plot as the browser laid it out.
PROBE = """
(async () => {
  await Promise.all([...document.images].map(img => img.decode().catch(() => null)));
  return [...document.querySelectorAll("img, svg, canvas")].map(el => {
    const box = el.getBoundingClientRect();
    return {tag: el.tagName.toLowerCase(), alt: el.getAttribute("alt"),
            width: box.width, height: box.height,
            decoded: el.tagName !== "IMG" || (el.complete && el.naturalWidth > 0)};
  });
})()
"""


def find_chromium() -> str:
    for name in CHROMIUM_NAMES:
        if path := shutil.which(name):
            return path
    pytest.skip("no Chromium on PATH to render report.html (apt-get install -y chromium)")


class DevTools:
    """One page of a browser, spoken to in the DevTools protocol; errors the page reports
    (exceptions, console.error, failed loads) are collected as they arrive."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.errors: list[str] = []
        self._ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        while True:
            message = await self._next()
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    async def until(self, event: str) -> None:
        while (await self._next()).get("method") != event:
            pass

    async def _next(self) -> dict[str, Any]:
        frame = await self.ws.receive(timeout=60)
        if frame.type != aiohttp.WSMsgType.TEXT:
            raise RuntimeError(f"the DevTools connection ended: {frame.type.name}")
        message = json.loads(frame.data)
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.exceptionThrown":
            self.errors.append(json.dumps(params["exceptionDetails"]))
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.errors.append(json.dumps(params["args"]))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append(params["entry"]["text"])
        return message


async def render(devtools_port: int, page: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The plots of ``page`` as rendered, and the errors the page reported."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{devtools_port}/json/list") as response:
            target = next(t for t in await response.json() if t["type"] == "page")
        async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            tools = DevTools(ws)
            for domain in ("Page", "Runtime", "Log"):
                await tools.call(f"{domain}.enable")
            await tools.call("Page.navigate", url=page.as_uri())
            await tools.until("Page.loadEventFired")
            result = await tools.call(
                "Runtime.evaluate", expression=PROBE, awaitPromise=True, returnByValue=True
            )
            return result["result"]["value"], tools.errors


@pytest.fixture
def chromium(tmp_path: Path):
    """A headless Chromium with its DevTools port open; yields the port."""
    profile = tmp_path / "profile"
    argv = [find_chromium(), "--headless", "--disable-gpu", "--remote-debugging-port=0",
            f"--user-data-dir={profile}", "--window-size=1200,900", "about:blank"]  # fmt: skip
    if os.geteuid() == 0:
        argv.insert(1, "--no-sandbox")  # Chromium's sandbox refuses to run as root
    log = tmp_path / "chromium.log"
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe would stall the browser
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        port_file = profile / "DevToolsActivePort"  # written once the port listens
        wait_for(
            lambda: proc.poll() is not None or port_file.exists() and port_file.read_text(),
            timeout=60,
            what="Chromium to open its DevTools port",
        )
        if proc.poll() is not None:
            pytest.fail(f"Chromium exited with {proc.returncode}: {log.read_text()[-2000:]}")
        yield int(port_file.read_text().split()[0])
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.distributed
def test_the_report_of_a_real_run_renders_every_plot(tiny_run: Path, chromium: int) -> None:
    page = tiny_run / "report.html"
    plots, errors = asyncio.run(render(chromium, page))
    in_source = len(re.findall(r"<(img|svg|canvas)\b", page.read_text(encoding="utf-8")))
    assert in_source >= 5  # loss, throughput, step time, time split, energy
    assert len(plots) == in_source
    assert {p["alt"] for p in plots} >= {"loss", "throughput", "step_time", "time_split", "energy"}
    for plot in plots:
        assert plot["decoded"] and plot["width"] > 100 and plot["height"] > 100, plot
    assert errors == []
