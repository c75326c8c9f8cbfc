"""A preprocessing worker: claims shards from the coordinator, reads each from the input, runs the
transform, writes the result as Parquet, and reports. Its heartbeats keep its lease alive while a
long shard runs; if it dies, the lease runs out and the shard goes to another worker.

    DISTML_TOKEN=... python -m distml.data.preprocess.worker --coordinator URL --transform mod:fn

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
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from distml.data.preprocess.sources import read_shard
from distml.net.client import ServiceClient, ServiceError
from distml.net.token import token_from_env
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


def run_worker(
    url: str,
    token: str,
    transform: str,
    *,
    worker_id: str | None = None,
    verify: bool | str = True,
) -> int:
    """Work until the coordinator says stop; returns the number of shards this worker kept, or
    raises :class:`JobFailed` with the job's error if it stopped because the job failed. The
    coordinator knows the worker as ``worker_id`` (default: the host name) and its process ID."""
    fn = load_transform(transform)
    worker_id = worker_name(worker_id, os.getpid())
    client = ServiceClient(url, token, verify=verify)
    job = client.request("GET", "/v1/job").json()
    if job["transform"] != transform:
        raise ValueError(f"the job runs {job['transform']!r}, this worker was given {transform!r}")
    stop = threading.Event()
    beat = threading.Thread(
        target=_heartbeats,
        args=(url, token, worker_id, job["lease_s"] / 3, stop, verify),
        daemon=True,
    )
    beat.start()
    kept = 0
    try:
        while True:
            answer = client.request("POST", "/v1/claim", json={"worker": worker_id}).json()
            if answer["action"] == "stop":
                if answer.get("error"):
                    raise JobFailed(answer["error"])
                return kept
            if answer["action"] == "wait":
                stop.wait(answer["seconds"])
                continue
            ids = {"worker": worker_id, "attempt": answer["attempt"]}
            try:
                table = as_table(fn(read_shard(answer["shard"])))
                pq.write_table(table, answer["output"])
            except Exception as exc:  # the shard's failure, reported; the worker goes on
                error = "".join(traceback.format_exception_only(exc)).strip()
                client.request("POST", "/v1/fail", json={**ids, "error": error[-4000:]})
                continue
            kept += client.request("POST", "/v1/complete", json=ids).json()["kept"]
    finally:
        stop.set()
        client.close()


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
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--ca-cert", default=None, help="CA bundle for an https coordinator")
    args = parser.parse_args(argv)
    try:
        kept = run_worker(
            args.coordinator,
            token_from_env(),
            args.transform,
            worker_id=args.worker_id,
            verify=args.ca_cert or True,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except JobFailed as exc:
        print(f"error: the job failed: {exc}", file=sys.stderr)
        return 1
    print(f"worker kept {kept} shard(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
