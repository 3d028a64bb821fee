"""Benchmark 5: a near-frame_max message trickling in, in small slices.

A 130,000-byte body (one body frame: frame_max is 131,072) is delivered to a consumer
through the test proxy with two toxics on the downstream: ``bandwidth`` (16 KB/s; 64 in
quick mode) then ``slicer`` (512-byte pieces, 1 ms apart), added after the consumer is
registered so the handshake is fast. About 8 s per delivery (2 s in quick mode).

Checked: the message arrives whole (byte-for-byte) every time.
Measured (psutil, per-thread user + system CPU time over the delivery window, from
publish to the consumer callback; and, finer, the thread's own POSIX CPU clock): in
drainer mode the drainer thread (found by ``Thread.native_id``), in legacy mode the
consumer thread, which reads the socket itself. A reader that spins on partial frames
would show a ratio near 1.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import amqp
import psutil
import pytest
from support.broker import BROKER_HOST, unique_name, wait_until
from support.threads import Drain
from support.toxiproxy.fixtures import ProxiedBroker

from benchmarks import QUICK, blocked_in, connect, interleaved
from benchmarks.report import Collector, Section, Target

pytestmark = pytest.mark.benchmark

BODY_SIZE = 130_000
DELIVERIES = 1  # per mode (each takes about BODY_SIZE / RATE)
RATE = 64 if QUICK else 16  # KB/s, the bandwidth toxic's rate
DELIVERY_TIMEOUT = 60.0
#: The drainer's CPU busy ratio at 16 KB/s; the reads are the same at any rate (one per
#: slice), so the target grows with the rate.
DRAINER_CPU_TARGET = 0.005 * RATE / 16


@dataclass
class Delivery:
    mode: str
    seconds: float = 0.0
    whole: bool = False
    reader_cpu_ratio: float = 0.0  # drainer thread (drainer mode) / consumer (legacy)
    consumer_cpu_ratio: float = 0.0
    reader_cpu_clock_ratio: float = 0.0  # the same, from the thread's own CPU clock
    drainer_reads: int | None = None


def _cpu_times(native_ids: list[int]) -> dict[int, float]:
    times = {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}
    return {i: times.get(i, 0.0) for i in native_ids}


def _cpu_clock(thread: threading.Thread) -> float:
    """The thread's CPU time from its own POSIX CPU clock (ns resolution, unlike the
    10-ms ticks psutil reads from /proc)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident or 0))


def deliver_once(mode: str, proxied: ProxiedBroker, body: bytes) -> Delivery:
    result = Delivery(mode)
    queue = unique_name("bench-frag")
    admin = amqp.Connection(host=BROKER_HOST)
    admin.connect()
    conn = None
    drain: Drain | None = None
    delivered = threading.Event()
    received: list[bytes] = []
    try:
        admin_channel = admin.channel()
        admin_channel.queue_declare(queue, auto_delete=False)
        conn = connect(mode, host=proxied.hostport)
        channel = conn.channel()

        def on_message(message: amqp.Message) -> None:
            received.append(bytes(message.body))
            delivered.set()

        channel.basic_consume(queue, callback=on_message, no_ack=True)

        # Runs until stopped, not until delivery: its CPU clock is read after delivery.
        drain = Drain(conn, timeout=1, name=f"bench-frag-consumer-{mode}").start()
        consumer = drain.thread
        assert wait_until(lambda: blocked_in(consumer, {"drain_events"}), 5)
        proxied.proxy.add_toxic(
            name="bandwidth", type="bandwidth", stream="downstream", attributes={"rate": RATE}
        )
        proxied.proxy.add_toxic(
            name="slicer",
            type="slicer",
            stream="downstream",
            attributes={"average_size": 512, "size_variation": 0, "delay": 1000},
        )
        drainer = getattr(conn.reader, "thread", None)
        watched = [consumer.native_id or 0] + ([drainer.native_id or 0] if drainer else [])
        reader = drainer or consumer
        before = _cpu_times(watched)
        clock_before = _cpu_clock(reader)
        start = time.perf_counter()
        admin_channel.basic_publish(amqp.Message(body), exchange="", routing_key=queue)
        assert delivered.wait(DELIVERY_TIMEOUT), f"{mode}: not delivered within the timeout"
        result.seconds = time.perf_counter() - start
        result.reader_cpu_clock_ratio = (_cpu_clock(reader) - clock_before) / result.seconds
        after = _cpu_times(watched)
        busy = {i: (after[i] - before[i]) / result.seconds for i in watched}
        result.consumer_cpu_ratio = busy[watched[0]]
        result.reader_cpu_ratio = busy[watched[-1]]
        if drainer is not None:
            result.drainer_reads = int(conn.drainer_stats().get("reads", 0))
        result.whole = received == [body]
    finally:
        try:
            if drain is not None:
                drain.stop()  # fails if it did not stop
        finally:
            for name in list(proxied.proxy.toxics()):
                proxied.proxy.destroy_toxic(name)
            if conn is not None:
                conn.close()
            try:
                admin.channel().queue_delete(queue)
            finally:
                admin.close()
    assert drain is None or drain.error is None, f"{mode}: drain_events raised {drain.error!r}"
    return result


def test_fragmented_large_message(proxied_broker: ProxiedBroker, bench_report: Collector) -> None:
    began = time.perf_counter()
    body = os.urandom(BODY_SIZE)
    results = [deliver_once(mode, proxied_broker, body) for _, mode in interleaved(DELIVERIES)]

    rows = []
    for mode in ("legacy", "drainer"):
        rs = [r for r in results if r.mode == mode]
        rows.append(
            [
                mode,
                f"{sum(r.whole for r in rs)}/{len(rs)}",
                ", ".join(f"{r.seconds:.1f} s" for r in rs),
                ", ".join(f"{r.reader_cpu_ratio:.4f}" for r in rs),
                ", ".join(f"{r.reader_cpu_clock_ratio:.5f}" for r in rs),
                ", ".join(f"{r.consumer_cpu_ratio:.4f}" for r in rs),
                ", ".join(str(r.drainer_reads) for r in rs) if mode == "drainer" else "-",
            ]
        )
    drainer_worst = max(
        max(r.reader_cpu_ratio, r.reader_cpu_clock_ratio) for r in results if r.mode == "drainer"
    )
    whole = all(r.whole for r in results)
    targets = [
        Target(
            "delivered whole (both modes)",
            f"{sum(r.whole for r in results)}/{len(results)}",
            "every time",
            whole,
            asserted=True,
        ),
        Target(
            "drainer thread CPU busy ratio (worst delivery)",
            f"{drainer_worst:.4f}",
            f"< {DRAINER_CPU_TARGET:g}",
            drainer_worst < DRAINER_CPU_TARGET,
        ),
    ]
    section = Section(
        key="fragmentation",
        title=f"5. 130,000-byte message through bandwidth {RATE} KB/s + slicer 512 B / 1 ms",
        headers=[
            "mode",
            "whole",
            "delivery time",
            "reader CPU ratio (psutil)",
            "reader CPU ratio (thread CPU clock)",
            "consumer thread CPU ratio (psutil)",
            "drainer reads (whole connection)",
        ],
        rows=rows,
        targets=targets,
        notes=[
            f"{DELIVERIES} deliveries per mode, interleaved; a fresh connection and queue "
            f"each. Toxics on the downstream, added after basic_consume: bandwidth rate {RATE} "
            "(KB/s), then slicer average_size 512, size_variation 0, delay 1000 us.",
            "CPU ratio = (user + system CPU time of the thread over the delivery window) / "
            "window, from psutil.Process().threads() (clock-tick resolution: 10 ms, i.e. "
            f"{0.01 * RATE * 1000 / BODY_SIZE:.4f} over {BODY_SIZE / 1000 / RATE:.0f} s), and "
            "from the thread's POSIX CPU clock "
            "(time.pthread_getcpuclockid, ns resolution). Reader thread = the drainer "
            "thread in drainer mode, the consumer thread (which reads the socket itself) "
            "in legacy mode. The target is checked against the larger of the two.",
            "Reference (from the issue): drainer 0.003-0.005; a spinning reader ~0.97.",
            "The CPU target is reported, not asserted.",
        ],
        raw={"body_bytes": BODY_SIZE, "deliveries": [r.__dict__ for r in results]},
        seconds=time.perf_counter() - began,
    )
    bench_report.add(section)
    assert whole, "a message was not delivered whole"
