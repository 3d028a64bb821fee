"""Benchmark G: confirmed publishing, 64-byte bodies, one connection.

Confirmed msg/s = messages acked / seconds from the first publish to the last ack. Rows,
interleaved round by round: the ceiling (a raw socket in confirm mode: pre-encoded
publishes written in batches, acks read as a stream by a second thread, at most 20,000
unconfirmed), stock py-amqp ``basic_publish_confirm`` (one thread), the drainer's
synchronous ``basic_publish_confirm`` (one thread), and ``basic_publish_deferred`` (one
thread and ten, drainer mode; one thread, legacy mode). Hard checks only: every deferred
future is acked and the queue holds every message.

Run: ``pytest tests/benchmarks/bench_confirms.py -m benchmark -s``.
"""

from __future__ import annotations

import statistics
import struct
import threading
import time
from collections.abc import Callable
from functools import partial

import amqp
import pytest
from amqp import Message, spec
from amqp.serialization import dumps
from support.broker import BROKER_HOST, unique_name

from benchmarks import QUICK, connect
from benchmarks.report import Collector, Section, fmt_ratio

pytestmark = pytest.mark.benchmark

ROUNDS = 1 if QUICK else 2
WINDOW = 0.5 if QUICK else 4.0  # seconds of publishing per run
BODY = b"x" * 64
CEILING_UNCONFIRMED = 20_000


def _frames(channel: int, routing_key: str) -> bytes:
    """One Basic.Publish, its header and its body, encoded once."""
    method = struct.pack(">HH", *spec.Basic.Publish) + dumps("Bssbb", (0, "", routing_key, 0, 0))
    header = struct.pack(">HHQH", 60, 0, len(BODY), 0)

    def frame(kind: int, payload: bytes) -> bytes:
        return struct.pack(">BHI", kind, channel, len(payload)) + payload + b"\xce"

    return frame(1, method) + frame(2, header) + frame(3, BODY)


def run_ceiling(queue: str) -> float:
    conn = amqp.Connection(host=BROKER_HOST)
    conn.connect()
    try:
        channel = conn.channel()
        channel.confirm_select()
        sock = conn.transport.sock
        one = _frames(channel.channel_id, queue)
        acked = [0]
        stop = threading.Event()

        def read_acks() -> None:
            buffer = b""
            while not stop.is_set() or acked[0] < sent:
                data = sock.recv(1 << 16)
                if not data:
                    return
                buffer += data
                while len(buffer) >= 7:
                    size = struct.unpack_from(">I", buffer, 3)[0]
                    if len(buffer) < size + 8:
                        break
                    if buffer[0] == 1 and struct.unpack_from(">HH", buffer, 7) == spec.Basic.Ack:
                        acked[0] = struct.unpack_from(">Q", buffer, 11)[0]
                    buffer = buffer[size + 8 :]

        sent = 0
        reader = threading.Thread(target=read_acks, name="ceiling-acks", daemon=True)
        reader.start()
        batch = one * 100
        start = time.perf_counter()
        deadline = start + WINDOW
        while time.perf_counter() < deadline:
            while sent - acked[0] > CEILING_UNCONFIRMED:
                time.sleep(0.0001)
            sock.sendall(batch)
            sent += 100
        stop.set()
        while acked[0] < sent:
            time.sleep(0.0001)
        took = time.perf_counter() - start
        reader.join(5)
        return sent / took
    finally:
        conn.collect()


def run_sync(kind: str, queue: str) -> float:
    """One thread, a round trip per message: stock py-amqp or the drainer's."""
    if kind == "stock":
        conn = amqp.Connection(host=BROKER_HOST, confirm_publish=True)
        conn.connect()
    else:
        conn = connect("drainer")
    try:
        channel = conn.channel()
        n = 0
        start = time.perf_counter()
        deadline = start + WINDOW
        while time.perf_counter() < deadline:
            channel.basic_publish_confirm(Message(BODY), routing_key=queue)
            n += 1
        return n / (time.perf_counter() - start)
    finally:
        conn.close()


def run_deferred(mode: str, threads: int, queue: str) -> float:
    conn = connect(mode)
    try:
        channels = [conn.channel() for _ in range(threads)]
        futures: list[list[object]] = [[] for _ in range(threads)]
        start = time.perf_counter()
        deadline = start + WINDOW

        def publish(t: int) -> None:
            channel, mine = channels[t], futures[t]
            while time.perf_counter() < deadline:
                mine.append(channel.basic_publish_deferred(Message(BODY), routing_key=queue))

        workers = [threading.Thread(target=partial(publish, t)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        for channel in channels:
            assert channel.wait_for_confirms(timeout=60), "a deferred publish was not acked"
        took = time.perf_counter() - start
        return sum(len(f) for f in futures) / took
    finally:
        conn.close()


def test_confirmed_publishing(bench_report: Collector) -> None:
    began = time.perf_counter()
    queue = unique_name("drainer-bench-confirms")
    admin = connect("drainer")
    admin.channel().queue_declare(queue, auto_delete=False, arguments={"x-max-length": 1000})
    runs: dict[str, list[float]] = {}
    cases: dict[str, Callable[[], float]] = {
        "raw socket, confirm mode (ceiling)": partial(run_ceiling, queue),
        "stock py-amqp basic_publish_confirm, 1 thread": partial(run_sync, "stock", queue),
        "drainer basic_publish_confirm, 1 thread": partial(run_sync, "drainer", queue),
        "drainer basic_publish_deferred, 1 thread": partial(run_deferred, "drainer", 1, queue),
        "drainer basic_publish_deferred, 10 threads": partial(run_deferred, "drainer", 10, queue),
        "legacy basic_publish_deferred, 1 thread": partial(run_deferred, "legacy", 1, queue),
    }
    try:
        for i in range(ROUNDS):
            order = list(cases) if i % 2 == 0 else list(cases)[::-1]
            for name in order:
                runs.setdefault(name, []).append(cases[name]())
    finally:
        admin.channel().queue_delete(queue)
        admin.close()
    rate = {name: statistics.median(values) for name, values in runs.items()}
    ceiling = rate["raw socket, confirm mode (ceiling)"]
    stock = rate["stock py-amqp basic_publish_confirm, 1 thread"]
    rows = [
        [name, f"{value:,.0f}", f"{100 * value / ceiling:.0f}%", fmt_ratio(value / stock)]
        for name, value in rate.items()
    ]
    bench_report.add(
        Section(
            key="confirms",
            title="G. Confirmed publishing (64-byte bodies, one connection)",
            headers=["client", "confirmed msg/s", "of the ceiling", "over stock py-amqp"],
            rows=rows,
            notes=[
                f"{ROUNDS} interleaved round(s) of {WINDOW:g} s each; the median per row.",
                "Confirmed msg/s: messages acked over the time from the first publish to "
                "the last ack. The queue keeps its last 1,000 messages (x-max-length).",
            ],
            raw={"msg_s": rate, "rounds": runs},
            seconds=time.perf_counter() - began,
            order=15,
        )
    )
