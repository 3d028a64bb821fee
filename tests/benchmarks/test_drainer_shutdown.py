"""Benchmark 4: ``close()`` while a consumer thread and a publisher thread are busy.

Per connection: a consumer thread loops ``drain_events(timeout=1)`` (consumer on an
exclusive queue), a publisher thread publishes in a loop on its own channel (one
message per millisecond, to a routing key bound to no queue); once both are running,
the main thread calls ``close()`` in a helper thread and times it.

Checked in both modes: no deadlock (a ``close()`` not done within 10 s is one: every
thread's stack is dumped and the test fails), both worker threads end, and after every
``close()`` no drainer thread and no socket of that connection (by local port) is left.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import amqp
import psutil
import pytest
from support.broker import BROKER_HOST, drainer_threads, unique_name, wait_until

from benchmarks import QUICK, all_stacks, blocked_in, connect, interleaved
from benchmarks.report import Collector, Section, Target, fmt_ms, fmt_ratio, ratio, summarize

pytestmark = pytest.mark.benchmark

CONNECTIONS = 4 if QUICK else 10  # per mode
DEADLOCK_AFTER = 10.0
DRAINER_P95_TARGET = 0.010
WORKER_DEADLINE = 30.0  # bound on each worker loop, whatever happens


@dataclass
class CloseResult:
    mode: str
    seconds: float | None = None  # None: deadlock
    leaks: list[str] = field(default_factory=list)
    consumer_error: str = ""
    publisher_error: str = ""
    published: int = 0
    stacks: str = ""  #: every thread's stack, when close() deadlocked


def _sockets_on(port: int) -> list[str]:
    process = psutil.Process()
    conns = process.net_connections(kind="inet")
    return [f"{c.laddr} -> {c.raddr} {c.status}" for c in conns if c.laddr and c.laddr.port == port]


def close_one(mode: str) -> CloseResult:
    result = CloseResult(mode)
    drainers_before = set(drainer_threads())
    conn = connect(mode, host=BROKER_HOST)
    local_port = conn.transport.sock.getsockname()[1]
    deadline = time.monotonic() + WORKER_DEADLINE
    stop = threading.Event()
    published = threading.Semaphore(0)

    channel = conn.channel()
    queue = channel.queue_declare("", exclusive=True, auto_delete=True)[0]
    channel.basic_consume(queue, callback=lambda message: None, no_ack=True)
    publish_channel = conn.channel()
    routing_key = unique_name("bench-nowhere")

    def consume() -> None:
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=1)
            except TimeoutError:
                continue
            except BaseException as exc:  # noqa: BLE001 - the end we wait for
                result.consumer_error = type(exc).__name__
                return

    def publish() -> None:
        message = amqp.Message(b"x" * 64)
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                publish_channel.basic_publish(message, exchange="", routing_key=routing_key)
            except BaseException as exc:  # noqa: BLE001 - the end we wait for
                result.publisher_error = type(exc).__name__
                return
            result.published += 1
            published.release()
            stop.wait(0.001)  # the publishing pace

    workers = [
        threading.Thread(target=consume, name=f"bench-close-consumer-{mode}"),
        threading.Thread(target=publish, name=f"bench-close-publisher-{mode}"),
    ]
    for worker in workers:
        worker.start()
    closer: threading.Thread | None = None
    try:
        assert wait_until(lambda: blocked_in(workers[0], {"drain_events"}), 5), (
            f"{mode}: consumer never blocked in drain_events"
        )
        assert published.acquire(timeout=5), f"{mode}: publisher is not publishing"

        done = threading.Event()
        elapsed: list[float] = []

        def do_close() -> None:
            start = time.perf_counter()
            conn.close()
            elapsed.append(time.perf_counter() - start)
            done.set()

        closer = threading.Thread(target=do_close, name=f"bench-closer-{mode}")
        closer.start()
        if not done.wait(DEADLOCK_AFTER):
            result.stacks = all_stacks()  # reported (and failed) by the test
            return result
        result.seconds = elapsed[0]

        # Right after close() returns: nothing of this connection may be left.
        leftover = set(drainer_threads()) - drainers_before
        if leftover:
            result.leaks.append(f"drainer threads: {sorted(t.name for t in leftover)}")
        sockets = _sockets_on(local_port)
        if sockets:
            result.leaks.append(f"sockets on local port {local_port}: {sockets}")
    finally:
        stop.set()
        for worker in workers:
            worker.join(5)
        if closer is not None:
            closer.join(DEADLOCK_AFTER)
        if closer is None or closer.is_alive():
            conn.collect()
    alive = [w.name for w in workers if w.is_alive()]
    assert not alive, f"{mode}: workers still running after close(): {alive}"
    return result


def test_close_with_busy_threads(bench_report: Collector) -> None:
    began = time.perf_counter()
    results: dict[str, list[CloseResult]] = {"legacy": [], "drainer": []}
    for _, mode in interleaved(CONNECTIONS):
        results[mode].append(close_one(mode))

    stats = {
        m: summarize([r.seconds for r in rs if r.seconds is not None]) for m, rs in results.items()
    }
    rows = []
    for mode, rs in results.items():
        s = stats[mode]
        rows.append(
            [
                mode,
                f"{sum(r.seconds is not None for r in rs)}/{len(rs)}",
                str(sum(r.seconds is None for r in rs)),
                fmt_ms(s["p50"]),
                fmt_ms(s["p95"]),
                fmt_ms(s["max"]),
                str(sum(bool(r.leaks) for r in rs)),
                ", ".join(sorted({r.consumer_error for r in rs})),
                ", ".join(sorted({r.publisher_error for r in rs})),
            ]
        )
    rows.append(
        [
            "legacy/drainer",
            "",
            "",
            fmt_ratio(ratio(stats["legacy"]["p50"], stats["drainer"]["p50"])),
            fmt_ratio(ratio(stats["legacy"]["p95"], stats["drainer"]["p95"])),
            fmt_ratio(ratio(stats["legacy"]["max"], stats["drainer"]["max"])),
            "",
            "",
            "",
        ]
    )
    dr_p95 = stats["drainer"]["p95"]
    leaks = [f"{r.mode}: {leak}" for rs in results.values() for r in rs for leak in r.leaks]
    deadlocks = [r for rs in results.values() for r in rs if r.seconds is None]
    targets = [
        Target("deadlocks (both modes)", str(len(deadlocks)), "0", not deadlocks, asserted=True),
        Target(
            "connections with a drainer thread or socket left after close()",
            str(len(leaks)),
            "0",
            not leaks,
            asserted=True,
        ),
        Target(
            "drainer close() P95",
            fmt_ms(dr_p95),
            f"< {fmt_ms(DRAINER_P95_TARGET)}",
            dr_p95 < DRAINER_P95_TARGET,
        ),
    ]
    section = Section(
        key="shutdown",
        title="4. close() with a busy consumer thread and a busy publisher thread",
        headers=[
            "mode",
            "completed",
            "deadlocks",
            "P50",
            "P95",
            "max",
            "leaks",
            "consumer got",
            "publisher got",
        ],
        rows=rows,
        targets=targets,
        notes=[
            f"{CONNECTIONS} fresh connections per mode, interleaved. Consumer thread: "
            "drain_events(timeout=1) in a loop; publisher thread: one basic_publish per "
            "ms on its own channel. close() is timed from another thread once both run.",
            f"A close() not done within {DEADLOCK_AFTER:.0f} s counts as a deadlock (stacks "
            "dumped, test fails). Leaks are checked right after close() returns: "
            "threading.enumerate() for drainer threads, psutil net_connections() for the "
            "connection's local port.",
            "'consumer got' / 'publisher got': the exception each worker ended with.",
        ],
        raw={
            "connections_per_mode": CONNECTIONS,
            "stats_s": stats,
            "close_s": {m: [r.seconds for r in rs] for m, rs in results.items()},
            "leaks": leaks,
        },
        seconds=time.perf_counter() - began,
    )
    bench_report.add(section)
    failed = [t.line() for t in targets if t.asserted and not t.met]
    stacks = [f"{r.mode} close() deadlocked:\n{r.stacks}" for r in deadlocks]
    assert not failed, "targets not met:\n" + "\n".join(failed + leaks + stacks)
