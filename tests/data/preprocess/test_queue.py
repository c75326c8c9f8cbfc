"""The coordinator's queue on a fake clock: leases, retries, speculation, exactly-once commits."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distml.data.preprocess.coordinator import Coordinator
from distml.data.preprocess.output import OutputDir
from distml.data.preprocess.queue import ShardQueue


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def queue(n: int = 4, **kwargs) -> tuple[ShardQueue, Clock]:
    clock = Clock()
    shards = [{"id": i, "kind": "files", "paths": []} for i in range(n)]
    return ShardQueue(shards, lease_s=10, clock=clock, **kwargs), clock


def test_shards_go_out_in_order_and_finish_once_each():
    q, _ = queue(3)
    attempts = [q.claim(w) for w in ("a", "b", "a")]
    assert [a.shard for a in attempts] == [0, 1, 2]
    assert q.claim("b") is None and not q.finished
    assert all(q.complete(a.id) for a in attempts)
    assert q.finished and q.claim("a") is None
    assert not q.complete(attempts[0].id)  # a repeated report changes nothing
    assert q.stats.discarded == 0  # and is no copy thrown away


def test_a_lost_lease_goes_back_first_and_heartbeats_keep_a_lease():
    q, clock = queue(3)
    a, b = q.claim("a"), q.claim("b")
    clock.now = 8
    q.heartbeat("b")
    clock.now = 12  # a's lease ran out at 10; b's runs to 18
    c = q.claim("c")
    assert c.shard == a.shard and q.stats.lost_leases == 1 and q.stats.retried == 1
    assert b.id in q.running
    assert not q.complete(a.id)  # the dead worker's late report is discarded
    assert q.complete(c.id) and q.stats.discarded == 1


def test_failures_retry_until_max_attempts_then_fail_the_job():
    q, _ = queue(2, max_attempts=3)
    for _ in range(2):
        q.fail(q.claim("w").id, "boom")
        assert q.error is None
    q.fail(q.claim("w").id, "boom")
    assert q.error == "shard 0 failed on w: boom (attempt 3 of 3)"
    assert q.claim("w") is None


def test_a_straggler_gets_a_backup_copy_and_the_first_to_finish_wins():
    q, clock = queue(4, speculate_after=2.0, speculate_min_s=1.0)
    slow = q.claim("slow")
    for _ in range(3):
        clock.now += 1
        q.complete(q.claim("fast").id)  # three shards of 1 s each
    for t in (4.0, 4.5):
        clock.now = t  # the slow shard has run 4 s and 4.5 s: over 2 x 1 s
        q.heartbeat("slow")
    assert q.claim("slow") is None  # never a backup on the worker that holds it
    backup = q.claim("fast")
    assert backup.shard == slow.shard and backup.backup
    assert q.claim("other") is None  # one backup per shard
    assert q.complete(backup.id) and q.finished
    assert slow.id not in q.running and q.attempt(slow.id) == slow  # retired, still known
    assert not q.complete(slow.id) and not q.complete(slow.id)
    assert (q.stats.speculative, q.stats.discarded) == (1, 1)  # the late copy, counted once


def test_no_speculation_before_two_shards_finished_or_when_off():
    q, clock = queue(2)
    q.claim("a")
    q.claim("b")
    clock.now = 9
    assert q.claim("c") is None
    q2, clock2 = queue(3, speculate_after=0)
    q2.complete(q2.claim("a").id)
    q2.complete(q2.claim("a").id)
    q2.claim("b")
    clock2.now = 9
    q2.heartbeat("b")
    assert q2.claim("a") is None


def test_a_restarted_queue_skips_what_is_done():
    q, _ = queue(3)
    q2 = ShardQueue(q.shards, done={0: 1.0, 2: 1.0})
    assert q2.pending == [1] and not q2.finished


@pytest.mark.parametrize("n", [1, 5])
def test_the_backup_of_a_dead_worker_is_not_lost(n):
    q, clock = queue(n + 2)
    for _ in range(n + 1):
        q.complete(q.claim("a").id)
    slow = q.claim("slow")
    clock.now = 5
    backup = q.claim("a")
    assert backup.shard == slow.shard
    clock.now = 12  # both leases ran out, "a" kept beating
    q.heartbeat("a")
    q.expire()
    assert backup.id in q.running and slow.id not in q.running
    assert q.stats.retried == 0  # the shard still has a live copy


def test_the_coordinator_counts_and_deletes_a_late_copy(tmp_path):
    """Through the queue's owner, as the workers' reports arrive: the backup wins, the first
    copy's late report is discarded (its file deleted, counted) and an intruder's is ignored."""
    q, clock = queue(3, speculate_after=2.0, speculate_min_s=1.0)
    output = OutputDir(tmp_path / "out", {"fingerprint": "f"})
    output.open()
    coordinator = Coordinator(q, output, "t:f")

    def run(worker: str, value: int) -> str:
        work = coordinator.claim(worker)
        pq.write_table(pa.table({"x": [value]}), output.tmp_path(work["attempt"]))
        return work["attempt"]

    slow = coordinator.claim("slow")
    for _ in range(2):
        clock.now += 1
        assert coordinator.complete("fast", run("fast", 0))
    clock.now = 5
    q.heartbeat("slow")
    backup = run("fast", 1)
    assert q.running[backup].shard == slow["shard"]["id"]
    slow_file = output.tmp_path(slow["attempt"])
    pq.write_table(pa.table({"x": [2]}), slow_file)
    assert coordinator.complete("fast", backup) and q.finished
    assert not coordinator.complete("intruder", slow["attempt"])
    assert slow_file.exists() and q.stats.discarded == 0
    assert not coordinator.complete("slow", slow["attempt"])
    assert not slow_file.exists() and q.stats.discarded == 1
    part = pq.read_table(tmp_path / "out" / f"part-{slow['shard']['id']:05d}.parquet")
    assert part["x"].to_pylist() == [1]  # the winner's output, not the late copy's


def test_a_worker_waiting_for_work_hears_stop_when_the_last_shard_is_in(tmp_path):
    """The claim's long poll: an idle worker's answer waits for the job's end, and comes the
    moment the last shard is committed, not after a sleep of its own."""
    import threading
    import time

    q = ShardQueue([{"id": 0, "kind": "files", "paths": []}], lease_s=30, speculate_after=0)
    output = OutputDir(tmp_path / "out", {"fingerprint": "f"})
    output.open()
    coordinator = Coordinator(q, output, "t:f")
    work = coordinator.claim("busy")
    assert coordinator.claim("idle")["action"] == "wait"  # no long poll asked for
    answers: list[tuple[dict, float]] = []

    def idle() -> None:
        answers.append((coordinator.claim("idle", wait_s=20), time.monotonic()))

    waiter = threading.Thread(target=idle)
    waiter.start()
    time.sleep(0.3)
    assert not answers  # still waiting: nothing to hand out, the job not over
    pq.write_table(pa.table({"x": [0]}), output.tmp_path(work["attempt"]))
    assert coordinator.complete("busy", work["attempt"])
    committed = time.monotonic()
    waiter.join(5)
    ((answer, at),) = answers
    assert answer == {"action": "stop", "error": None}
    assert at - committed < 0.5
    assert coordinator.stopped == {"idle"}
