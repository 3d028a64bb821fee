"""Benchmark J: confirmed publishing on a quorum queue of a three-node cluster.

Where publisher confirms cost most in production: a quorum queue acks a publish only
once a majority of its members (Raft) wrote it, so every confirm waits for the other
nodes. A three-node cluster of our own (``rabbit_cluster``, as benchmark F), every
connection to its first node, one quorum queue declared there (its leader starts on that
node; members on all three), ``x-max-length`` ``MAX_LENGTH`` to keep it small, deleted
at the end. 64-byte bodies, the default exchange. Rows, interleaved round by round (the
order reversed every other round), each publishing for ``WINDOW`` seconds:

* the drainer's ``basic_publish_confirm`` (a round trip per message), 1 thread and
  ``THREADS`` threads, a channel each on one drainer-mode connection;
* the drainer's ``basic_publish_deferred``, then ``wait_for_confirms`` on the same
  channel, 1 thread and ``THREADS`` threads, a channel each on one connection;
* stock py-amqp ``basic_publish_confirm``, 1 thread (``confirm_publish=True``): the
  reference.

Confirmed msg/s = messages acked / seconds from the first publish (the threads start
together) to the last ack (the last thread's last confirm or ``wait_for_confirms``).
Hard checks only: every publish returned, every deferred future acked, no thread stalled.
Every wait is bounded (``TIMEOUT``), every connection closed, the queue deleted; the
fixture stops the cluster's nodes at the end of the module.

Starting the cluster takes a while (three nodes, then two joins): set
``DRAINER_BENCH_CLUSTER=1`` to run this benchmark from ``scripts/bench.sh``, which
otherwise leaves this file out (``--ignore``).

Run: ``pytest tests/benchmarks/bench_quorum.py -m benchmark -s -o python_files='bench_*.py'``.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import amqp
import pytest
from support.broker import unique_name
from support.rabbit_nodes import RabbitCluster, RabbitNodeError

from benchmarks import QUICK, all_stacks, connect
from benchmarks.report import Collector, Section, fmt_ratio, ratio

pytestmark = [pytest.mark.benchmark]

ROUNDS = 1 if QUICK else 2
WINDOW = 0.5 if QUICK else 3.0  # seconds of publishing per run
THREADS = 10  # the many-thread rows
BODY = b"x" * 64
MAX_LENGTH = 1000  # the queue keeps its last messages only (drop-head)
TIMEOUT = 30.0  # seconds any one connect, publish or wait may take (Raft: be generous)
STOCK = "stock py-amqp basic_publish_confirm"


@dataclass(frozen=True)
class Case:
    """One table row: ``run()`` measures it once and returns (msg/s, messages acked)."""

    name: str
    threads: int
    run: Callable[[], tuple[float, int]]


def run_confirms(kind: str, threads: int, queue: str, hostport: str) -> tuple[float, int]:
    """``threads`` threads, a channel each on one connection, publish for ``WINDOW`` s.

    ``kind``: "stock" (stock py-amqp, ``basic_publish_confirm``; one thread only),
    "sync" (the drainer's ``basic_publish_confirm``) or "deferred" (the drainer's
    ``basic_publish_deferred``, then ``wait_for_confirms`` in the same thread)."""
    if kind == "stock":
        assert threads == 1, "a stock py-amqp connection is not shared between threads"
        conn: Any = amqp.Connection(host=hostport, confirm_publish=True, connect_timeout=TIMEOUT)
        conn.connect()
    else:
        conn = connect("drainer", host=hostport, connect_timeout=TIMEOUT)
    clock: dict[str, float] = {}

    def begin() -> None:  # run by one thread as the barrier releases them all
        clock["start"] = time.perf_counter()

    ready = threading.Barrier(threads, action=begin, timeout=TIMEOUT)
    counts = [0] * threads
    done = [0.0] * threads
    futures: list[list[Any]] = [[] for _ in range(threads)]
    nacked: list[int] = []
    errors: list[BaseException] = []

    def worker(i: int, channel: Any) -> None:
        try:
            ready.wait()
            deadline = clock["start"] + WINDOW
            if kind == "deferred":
                mine = futures[i]
                while time.perf_counter() < deadline:
                    mine.append(
                        channel.basic_publish_deferred(
                            amqp.Message(BODY), routing_key=queue, timeout=TIMEOUT
                        )
                    )
                if not channel.wait_for_confirms(timeout=TIMEOUT):
                    nacked.append(i)
                counts[i] = len(mine)
            else:
                while time.perf_counter() < deadline:
                    channel.basic_publish_confirm(
                        amqp.Message(BODY), routing_key=queue, confirm_timeout=TIMEOUT
                    )
                    counts[i] += 1
            done[i] = time.perf_counter()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            ready.abort()

    stalled = 0
    workers: list[threading.Thread] = []
    try:
        channels = [conn.channel() for _ in range(threads)]
        workers = [
            threading.Thread(target=worker, args=(i, ch), name=f"bench-quorum-{kind}-{i}")
            for i, ch in enumerate(channels)
        ]
        for w in workers:
            w.start()
        end = time.monotonic() + WINDOW + 3 * TIMEOUT
        for w in workers:
            w.join(max(end - time.monotonic(), 0.0))
        stalled = sum(w.is_alive() for w in workers)
        if stalled:
            print(all_stacks(), flush=True)
    finally:
        conn.close()
        for w in workers:
            w.join(TIMEOUT)
    assert not stalled, f"{kind}, {threads} threads: {stalled} threads stalled"
    assert not errors, f"{kind}, {threads} threads: {errors[0]!r}"
    label = f"{kind}, {threads} threads"
    assert not nacked, f"{label}: wait_for_confirms saw a deferred publish not acked"
    if kind == "deferred":
        every = [f for mine in futures for f in mine]
        unacked = sum(not (f.done() and f.result(timeout=0) is True) for f in every)
        assert not unacked, f"{label}: {unacked} of {len(every)} deferred futures not acked"
    total = sum(counts)
    return total / (max(done) - clock["start"]), total


def queue_placement(cluster: RabbitCluster, queue: str) -> str:
    """``rabbitmqctl list_queues`` of the queue: type, leader and members (for the notes;
    empty if the command fails)."""
    try:
        out = cluster.nodes[0].ctl(
            "list_queues", "name", "type", "leader", "members", timeout=TIMEOUT, check=False
        )
    except RabbitNodeError:
        return ""
    return next((line.strip() for line in out.splitlines() if line.startswith(queue)), "")


def test_quorum_confirms(rabbit_cluster: RabbitCluster, bench_report: Collector) -> None:
    began = time.perf_counter()
    rabbit_cluster.ensure_running()
    node = rabbit_cluster.nodes[0]
    hostport = f"127.0.0.1:{node.port}"
    queue = unique_name("drainer-bench-quorum")
    cases = [
        Case(STOCK, 1, partial(run_confirms, "stock", 1, queue, hostport)),
        Case("drainer basic_publish_confirm", 1, partial(run_confirms, "sync", 1, queue, hostport)),
        Case(
            "drainer basic_publish_confirm",
            THREADS,
            partial(run_confirms, "sync", THREADS, queue, hostport),
        ),
        Case(
            "drainer basic_publish_deferred + wait_for_confirms",
            1,
            partial(run_confirms, "deferred", 1, queue, hostport),
        ),
        Case(
            "drainer basic_publish_deferred + wait_for_confirms",
            THREADS,
            partial(run_confirms, "deferred", THREADS, queue, hostport),
        ),
    ]
    rates: dict[int, list[float]] = {}
    acked: dict[int, list[int]] = {}
    admin = amqp.Connection(host=hostport, connect_timeout=TIMEOUT)
    admin.connect()
    try:
        admin.channel().queue_declare(
            queue,
            durable=True,  # quorum queues are always durable
            auto_delete=False,
            arguments={"x-queue-type": "quorum", "x-max-length": MAX_LENGTH},
        )
        placement = queue_placement(rabbit_cluster, queue)
        for i in range(ROUNDS):
            for k in range(len(cases)) if i % 2 == 0 else reversed(range(len(cases))):
                rate, n = cases[k].run()
                print(f"  round {i}: {cases[k].name}, {cases[k].threads}: {rate:,.0f}", flush=True)
                rates.setdefault(k, []).append(rate)
                acked.setdefault(k, []).append(n)
    finally:
        try:
            admin.channel().queue_delete(queue)
        finally:
            admin.close()
    median = {k: statistics.median(v) for k, v in rates.items()}
    stock = median[0]
    rows = [
        [case.name, str(case.threads), f"{median[k]:,.0f}", fmt_ratio(ratio(median[k], stock))]
        for k, case in enumerate(cases)
    ]
    bench_report.add(
        Section(
            key="quorum",
            title="J. Confirms on a quorum queue, three-node cluster",
            headers=[
                "client/mode",
                "threads",
                "confirmed msg/s",
                "over stock sync (1 thread)",
            ],
            rows=rows,
            notes=[
                f"{ROUNDS} interleaved round(s) of {WINDOW:g} s each (the order reversed "
                "every other round); the median per row.",
                "Three local nodes (benchmark F's cluster), every connection to the first; "
                f"one quorum queue declared there, x-max-length {MAX_LENGTH:,} (drop-head). "
                f"list_queues name type leader members: {placement or '?'}.",
                "Confirmed msg/s: messages acked over the time from the first publish to "
                "the last ack. drainer rows: one drainer-mode connection, a channel per "
                "thread; deferred: each thread calls wait_for_confirms after its window.",
                "Over stock sync: this row's rate over stock py-amqp basic_publish_confirm "
                "(1 thread, its own connection).",
            ],
            raw={
                "window_s": WINDOW,
                "rounds": ROUNDS,
                "queue": placement,
                "results": [
                    {
                        "client": case.name,
                        "threads": case.threads,
                        "msg_s": median[k],
                        "rounds_msg_s": rates[k],
                        "rounds_acked": acked[k],
                    }
                    for k, case in enumerate(cases)
                ],
            },
            seconds=time.perf_counter() - began,
            order=18,
        )
    )
