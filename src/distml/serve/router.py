"""The router's work: forward a request to the replica the policy picks, and when that replica
fails it (connection refused or reset, 5xx) send it to another -- inference is idempotent, so a
replica that dies mid-request costs a retry, not the request. A 4xx is the client's fault: it is
answered as it is, never sent to another replica, and takes no replica out of rotation.
:meth:`Router.check_health` probes each replica through its real inference path and takes
failing ones out of rotation until they answer again (the supervisor restarts dead ones); the
router's app runs it as a background loop. ``drain()`` refuses new requests and waits for the
ones in flight. Bodies and the headers of the binary tensor data extension pass through as they
are, both ways: the router reads no tensor.

The replicas are called through :class:`distml.serve.upstream.Upstream`, keep-alive connections
that cost a fraction of a general client's CPU a request: on a machine the router shares with
its replicas, that CPU is taken from them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from distml.serve.policy import PowerOfTwoChoices, ReplicaState, RoutingPolicy
from distml.serve.upstream import Upstream, UpstreamError

# Statuses a replica gives while it is down, starting or draining: worth waiting out.
TRANSIENT = {502, 503, 504}
# Headers of the binary tensor data extension, sent on to the replica and back to the client.
PASSED_HEADERS = ("Inference-Header-Content-Length",)
_PASSED = [(h, h.lower()) for h in PASSED_HEADERS]


class NoReplica(Exception):
    """Every replica failed the request until the deadline."""


class Draining(Exception):
    """The router is shutting down and takes no new requests."""


@dataclass
class Forwarded:
    status: int
    content: bytes
    content_type: str
    replica: str
    attempts: int
    headers: dict[str, str] = field(default_factory=dict)  # those of PASSED_HEADERS it gave


class Router:
    def __init__(
        self,
        urls: Sequence[str],
        token: str,
        policy: RoutingPolicy | None = None,
        *,
        retry_s: float = 30.0,
        timeout_s: float = 30.0,
        health_interval_s: float = 0.5,
        verify: bool | str = True,
    ):
        if not urls:
            raise ValueError("a router needs at least one replica")
        self.replicas = [ReplicaState(u.rstrip("/")) for u in urls]
        self.policy = policy or PowerOfTwoChoices()
        self.retry_s = retry_s
        self.health_interval_s = health_interval_s
        self.draining = False
        self.in_flight = 0
        kept = ("content-type", *(k for _, k in _PASSED))
        self._upstreams = {
            r: Upstream(r.url, token, verify=verify, timeout_s=timeout_s, kept=kept)
            for r in self.replicas
        }
        self._idle = asyncio.Event()
        self._idle.set()

    def _pick(self, tried: set[ReplicaState]) -> ReplicaState | None:
        untried = [r for r in self.replicas if r not in tried]
        healthy = [r for r in untried if r.healthy]
        candidates = healthy or untried
        return self.policy.choose(candidates) if candidates else None

    async def forward(
        self,
        method: str,
        path: str,
        content: bytes = b"",
        content_type: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> Forwarded:
        """The answer of a replica to the request; ``headers`` are sent with it (each one of
        :data:`PASSED_HEADERS` the client gave)."""
        if self.draining:
            raise Draining("the router is draining")
        self.in_flight += 1
        self._idle.clear()
        try:
            sent = dict(headers or {})
            if content_type:
                sent["Content-Type"] = content_type
            return await self._forward(method, path, content, sent)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def _forward(
        self,
        method: str,
        path: str,
        content: bytes,
        headers: dict[str, str],
    ) -> Forwarded:
        deadline = time.monotonic() + self.retry_s
        tried: set[ReplicaState] = set()
        attempts, delay, failure = 0, 0.02, ""
        last_error: Forwarded | None = None
        while True:
            replica = self._pick(tried)
            if replica is None:  # every replica failed once: wait for a restart, go round
                if last_error is not None and last_error.status not in TRANSIENT:
                    return last_error  # the model fails the request everywhere: say so
                if time.monotonic() + delay > deadline:
                    raise NoReplica(f"no replica answered {method} {path} ({failure})")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
                tried.clear()
                continue
            attempts += 1
            replica.in_flight += 1
            try:
                answer = await self._upstreams[replica].request(method, path, content, headers)
            except (UpstreamError, OSError, TimeoutError) as exc:
                replica.healthy = False
                replica.failures += 1
                failure = f"{replica.url}: {type(exc).__name__}"
            else:
                forwarded = Forwarded(
                    answer.status,
                    answer.body,
                    answer.headers.get("content-type", "application/json"),
                    replica.url,
                    attempts,
                    {h: answer.headers[k] for h, k in _PASSED if k in answer.headers},
                )
                if answer.status < 500:
                    return forwarded
                last_error = forwarded
                failure = f"{replica.url}: {answer.status}"
            finally:
                replica.in_flight -= 1
            tried.add(replica)

    async def _probe(self, replica: ReplicaState) -> None:
        try:
            answer = await self._upstreams[replica].request(
                "GET", "/v2/health/ready", timeout_s=5.0
            )
            ok = answer.status == 200
        except (UpstreamError, OSError, TimeoutError):
            ok = False
        replica.healthy = ok
        replica.failures = 0 if ok else replica.failures + 1

    async def check_health(self) -> None:
        """Probe every replica once. A probe that fails in a way no replica outage explains
        marks its replica unhealthy and is raised once all are done, for the loop to log."""
        if self.draining:
            return
        results = await asyncio.gather(
            *(self._probe(r) for r in self.replicas), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        for replica, result in zip(self.replicas, results, strict=True):
            if isinstance(result, BaseException):
                replica.healthy = False
                replica.failures += 1
        if errors:
            raise errors[0]

    async def ready(self) -> bool:
        return any(r.healthy for r in self.replicas)

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests from now on; return when those in flight are done."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            pass  # the ones still running are cut off by the shutdown
        await self.close()

    async def close(self) -> None:
        """Close the connections to the replicas (after :meth:`drain`, or on shutdown)."""
        self.draining = True
        for upstream in self._upstreams.values():
            upstream.close()
