"""A preprocessing worker: claims shards from the coordinator, reads each from the input, runs the
transform, writes the result as Parquet, and reports. Its heartbeats keep its lease alive while a
long shard runs; if it dies, the lease runs out and the shard goes to another worker.

    DISTML_TOKEN=... python -m distml.data.preprocess.worker --coordinator URL \\
        --transform mod:fn --out OUT

It writes only in its own ``--out`` (the job's output folder, shared with the coordinator) and
reads only the input named by the job's record there; an answer of the coordinator naming any
other file stops it.

The transform is named by the worker's own command line and must match the job's: code never
travels over the network. It takes a :class:`pyarrow.Table` and returns one, or a mapping of
column name to a 1-D sequence or a 2-D array (stored as a fixed-size list column).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
from pydantic import TypeAdapter

from distml.data.preprocess.protocol import ClaimAnswer, CompleteAnswer, JobAnswer, Stop, Wait, Work
from distml.data.preprocess.scope import JobScope, RefusedAnswer
from distml.data.preprocess.sources import read_shard
from distml.net.client import ServiceClient, ServiceError
from distml.net.token import token_from_env
from distml.net.untrusted import bounded_json
from distml.user_code import import_function

Transform = Callable[[pa.Table], Any]


def load_transform(spec: str) -> Transform:
    """``package.module:function`` or ``path/to/file.py:function``. Whatever is wrong with it is a
    ValueError naming it (:func:`distml.user_code.import_function`): the user's mistake, which a
    restarted worker would only repeat."""
    return import_function(spec, "transform")


def worker_name(worker_id: str | None, pid: int) -> str:
    """How the coordinator knows a worker: one name per process, so that a worker restarted under
    the same ID does not renew, with its heartbeats, the leases of the process that died (their
    shards would never return)."""
    return f"{worker_id or socket.gethostname()}-{pid}"


def as_table(result: Any) -> pa.Table:
    """The transform's result as a table: a Table as is, a mapping column by column."""
    if isinstance(result, pa.Table):
        return result
    if not isinstance(result, Mapping):
        raise TypeError(
            f"a transform returns a pyarrow.Table or a mapping, got {type(result).__name__}"
        )
    columns = {}
    for name, values in result.items():
        array = np.asarray(values)
        if array.ndim == 2:
            flat = pa.array(array.reshape(-1))
            columns[name] = pa.FixedSizeListArray.from_arrays(flat, array.shape[1])
        elif array.ndim == 1:
            columns[name] = pa.array(array)
        else:
            raise TypeError(f"column {name!r} has {array.ndim} dimensions; 1 or 2 are stored")
    return pa.table(columns)


class JobFailed(RuntimeError):
    """The coordinator stopped this worker because the job failed (a shard out of attempts)."""


MAX_ANSWER_BYTES = 16 * 2**20


def run_worker(
    url: str,
    token: str,
    transform: str,
    out: Path | str,
    *,
    worker_id: str | None = None,
    verify: bool | str = True,
) -> int:
    """Work until the coordinator says stop; returns the number of shards this worker kept, or
    raises :class:`JobFailed` with the job's error if it stopped because the job failed. The
    coordinator knows the worker as ``worker_id`` (default: the host name) and its process ID.

    ``out`` is the job's output folder, as this worker sees it: the worker writes only in it
    and reads only the input its job record names (:class:`JobScope`); an answer naming
    anything else stops it with :class:`RefusedAnswer`."""
    fn = load_transform(transform)
    worker_id = worker_name(worker_id, os.getpid())
    client = ServiceClient(url, token, verify=verify)
    try:
        job = _answer(client.request("GET", "/v1/job"), JobAnswer)
        if job.transform != transform:
            raise ValueError(f"the job runs {job.transform!r}, this worker was given {transform!r}")
        scope = JobScope.open(out, job.fingerprint)
    except BaseException:
        client.close()
        raise
    stop = threading.Event()
    beat = threading.Thread(
        target=_heartbeats, args=(url, token, worker_id, job.lease_s / 3, stop, verify), daemon=True
    )
    beat.start()
    kept = 0
    try:
        while True:
            answer = _answer(
                client.request("POST", "/v1/claim", json={"worker": worker_id}), ClaimAnswer
            )
            if isinstance(answer, Stop):
                if answer.error:
                    raise JobFailed(answer.error)
                return kept
            if isinstance(answer, Wait):
                stop.wait(answer.seconds)
                continue
            kept += _attempt(client, scope, fn, worker_id, answer)
    finally:
        stop.set()
        client.close()


def _attempt(
    client: ServiceClient, scope: JobScope, fn: Transform, worker: str, work: Work
) -> bool:
    """Run one attempt and report it: True when the coordinator kept its output. A shard's
    failure is reported and the worker goes on; so is a file the coordinator refused (409)."""
    shard = scope.shard(work.shard.model_dump())
    scope.output_path(work.attempt)
    ids = {"worker": worker, "attempt": work.attempt}
    try:
        scope.write(as_table(fn(read_shard(shard))), work.attempt)
    except RefusedAnswer:
        raise
    except Exception as exc:  # the shard's failure, reported; the worker goes on
        _report_failure(client, ids, "".join(traceback.format_exception_only(exc)).strip())
        return False
    try:
        response = client.request("POST", "/v1/complete", json=ids)
    except ServiceError as exc:
        if exc.status != 409:
            raise
        _report_failure(client, ids, str(exc))
        return False
    return _answer(response, CompleteAnswer).kept


def _report_failure(client: ServiceClient, ids: dict[str, str], error: str) -> None:
    client.request("POST", "/v1/fail", json={**ids, "error": error[-4000:]})


def _answer(response: httpx.Response, model: Any) -> Any:
    """The coordinator's answer as ``model`` (a pydantic model or an annotated union of them);
    :class:`RefusedAnswer` when it is not one."""
    try:
        return TypeAdapter(model).validate_python(
            bounded_json(response.content, max_bytes=MAX_ANSWER_BYTES)
        )
    except ValueError as exc:  # pydantic's ValidationError included
        raise RefusedAnswer(f"a malformed answer to {response.request.url.path}: {exc}") from None


def _heartbeats(
    url: str, token: str, worker: str, every_s: float, stop: threading.Event, verify: bool | str
) -> None:
    client = ServiceClient(url, token, retry_s=every_s, verify=verify)
    while not stop.wait(every_s):
        try:
            client.request("POST", "/v1/heartbeat", json={"worker": worker})
        except ServiceError:  # a missed beat: the next one follows, and the lease has slack
            continue
    client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A distml preprocessing worker.")
    parser.add_argument("--coordinator", required=True, help="the coordinator's URL")
    parser.add_argument("--transform", required=True, help="module:function or file.py:function")
    parser.add_argument("--out", required=True, help="the job's output folder")
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--ca-cert", default=None, help="CA bundle for an https coordinator")
    args = parser.parse_args(argv)
    try:
        kept = run_worker(
            args.coordinator,
            token_from_env(),
            args.transform,
            args.out,
            worker_id=args.worker_id,
            verify=args.ca_cert or True,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except JobFailed as exc:
        print(f"error: the job failed: {exc}", file=sys.stderr)
        return 1
    except RefusedAnswer as exc:
        print(f"error: the coordinator's answer is refused: {exc}", file=sys.stderr)
        return 1
    print(f"worker kept {kept} shard(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
