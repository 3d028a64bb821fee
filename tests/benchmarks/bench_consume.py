"""Benchmark K: consuming, one consumer thread.

One consumer thread reads a queue of its own, prefilled with ``N`` 64-byte messages
(Basic.Publish frames encoded once, written in batches on a separate stock py-amqp
connection, then a wait until the broker reports ``N`` ready), in two cases:
``no_ack=True``, and an ack per message (``no_ack=False``, prefetch 1,000, one
``basic_ack`` per delivery). Deliveries/s = ``N - 1`` over the time from the first
delivery to the last (each delivery counted after its callback, ack included); CPU
µs/delivery = the process's CPU time (``time.process_time()``, every thread: the
drainer's, amqpstorm's IO thread) over the same span, per delivery. The broker's CPU is
not counted. Rows, interleaved round by round, the order reversed each round:

* pika ``BlockingConnection``: ``basic_consume`` with a callback,
  ``process_data_events(time_limit=...)`` until all are received;
* amqpstorm: ``basic.consume`` with a callback, ``process_data_events`` in a loop;
* stock py-amqp: ``basic_consume`` with a callback, ``drain_events(timeout=...)``;
* kombu ``Consumer`` with a callback, ``Connection.drain_events(timeout=...)``: stock
  kombu (pyamqp), the drainer's transport in drainer mode and in legacy mode.

A client that is not installed shows "not installed". Hard checks only: exactly ``N``
deliveries in each run, no error. Every wait is bounded (``TIMEOUT``); every queue is
deleted and every connection closed.

Run: ``pytest tests/benchmarks/bench_consume.py -m benchmark -s -o python_files='bench_*.py'``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import struct
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import amqp
import kombu
import pytest
from amqp import Message, spec
from amqp.serialization import dumps
from support.broker import BROKER_HOST, unique_name

from benchmarks import QUICK
from benchmarks.bench_confirms import _pika_parameters
from benchmarks.report import Collector, Section, fmt_ratio

pytestmark = pytest.mark.benchmark

N = 4_000 if QUICK else 25_000  # messages per run
ROUNDS = 1 if QUICK else 2
BODY = b"x" * 64
PREFILL_BATCH = 1_000  # publishes per socket write while prefilling (N is a multiple)
PREFETCH = 1_000  # the ack case's basic_qos prefetch_count
TIMEOUT = 30.0  # seconds any one connect, prefill or consume may take
POLL = 1.0  # seconds one drain_events / process_data_events call may wait
HOST, _, _PORT = BROKER_HOST.partition(":")
PORT = int(_PORT or 5672)
URL = f"amqp://guest:guest@{BROKER_HOST}//"
STOCK_KOMBU = "stock kombu Consumer"
CASES = {"no_ack": True, "ack": False}  # case -> no_ack
#: The module each optional client's rows need.
OPTIONAL = {"pika": "pika", "amqpstorm": "amqpstorm"}


class Span:
    """Counts deliveries; times the span from the first to the last, wall and CPU."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.count = 0
        self.start = self.end = self.cpu_start = self.cpu_end = 0.0
        self.deadline = time.monotonic() + TIMEOUT

    def tick(self) -> None:
        """One delivery handled (its ack, if any, sent)."""
        self.count += 1
        if self.count == 1:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()
        if self.count == N:
            self.end, self.cpu_end = time.perf_counter(), time.process_time()

    def waiting(self) -> bool:
        """Whether deliveries are still due; fails once ``TIMEOUT`` has passed."""
        if self.count >= N:
            return False
        if time.monotonic() > self.deadline:
            raise AssertionError(
                f"{self.who}: {self.count:,} of {N:,} deliveries after {TIMEOUT:g} s"
            )
        return True

    def result(self) -> dict[str, float]:
        assert self.count == N, f"{self.who}: {self.count:,} deliveries, expected {N:,}"
        took = self.end - self.start
        return {
            "deliveries_s": (N - 1) / took,
            "cpu_us": 1e6 * (self.cpu_end - self.cpu_start) / (N - 1),
        }


def _drain(drain_events: Callable[..., Any], span: Span) -> None:
    """Call ``drain_events(timeout=POLL)`` until every delivery is in."""
    while span.waiting():
        try:
            drain_events(timeout=POLL)
        except TimeoutError:  # socket.timeout too
            pass


def _publish_frames(channel: int, routing_key: str) -> bytes:
    """One Basic.Publish to the default exchange, its header and its body: the frames
    py-amqp's ``basic_publish`` writes, encoded once."""
    method = struct.pack(">HH", *spec.Basic.Publish) + dumps("Bssbb", (0, "", routing_key, 0, 0))
    header = struct.pack(">HHQH", 60, 0, len(BODY), 0)

    def frame(kind: int, payload: bytes) -> bytes:
        return struct.pack(">BHI", kind, channel, len(payload)) + payload + b"\xce"

    return frame(1, method) + frame(2, header) + frame(3, BODY)


@contextlib.contextmanager
def filled_queue() -> Iterator[str]:
    """A new queue holding ``N`` messages, deleted on exit. The publishes are written
    pre-encoded, in batches, on a stock py-amqp connection (4x faster than a
    ``basic_publish`` loop: the prefill is not what this benchmark measures)."""
    name = unique_name("drainer-bench-consume")
    conn = amqp.Connection(host=BROKER_HOST, connect_timeout=TIMEOUT, write_timeout=TIMEOUT)
    conn.connect()
    try:
        channel = conn.channel()
        channel.queue_declare(name, auto_delete=False)
        try:
            batch = _publish_frames(channel.channel_id, name) * PREFILL_BATCH
            for _ in range(N // PREFILL_BATCH):
                conn.transport.write(batch)
            deadline = time.monotonic() + TIMEOUT
            while (ready := channel.queue_declare(name, passive=True).message_count) != N:
                assert ready < N, f"prefill: {ready:,} messages ready, expected {N:,}"
                if time.monotonic() > deadline:
                    raise AssertionError(f"prefill: {ready:,} of {N:,} ready after {TIMEOUT:g} s")
                time.sleep(0.02)
            yield name
        finally:
            channel.queue_delete(name)
    finally:
        conn.close()


def run_pika(queue: str, no_ack: bool) -> dict[str, float]:
    """pika's BlockingConnection: a consumer callback, ``process_data_events``."""
    import pika

    span = Span("pika")
    conn = pika.BlockingConnection(_pika_parameters(BROKER_HOST))
    try:
        channel = conn.channel()
        if not no_ack:
            channel.basic_qos(prefetch_count=PREFETCH)

        def on_message(ch: Any, method: Any, _properties: Any, _body: bytes) -> None:
            if not no_ack:
                ch.basic_ack(method.delivery_tag)
            span.tick()

        channel.basic_consume(queue, on_message, auto_ack=no_ack)
        while span.waiting():
            conn.process_data_events(time_limit=POLL)
        return span.result()
    finally:
        if conn.is_open:
            conn.close()


def run_amqpstorm(queue: str, no_ack: bool) -> dict[str, float]:
    """amqpstorm: a consumer callback, ``process_data_events`` (its IO thread reads)."""
    import amqpstorm

    span = Span("amqpstorm")
    conn = amqpstorm.Connection(HOST, "guest", "guest", port=PORT, timeout=TIMEOUT)
    try:
        channel = conn.channel()
        if not no_ack:
            channel.basic.qos(prefetch_count=PREFETCH)

        def on_message(message: Any) -> None:
            if not no_ack:
                message.ack()
            span.tick()

        channel.basic.consume(on_message, queue, no_ack=no_ack)
        while span.waiting():
            channel.process_data_events(auto_decode=False)  # returns once the inbox is empty
        return span.result()
    finally:
        conn.close()


def run_pyamqp(queue: str, no_ack: bool) -> dict[str, float]:
    """Stock py-amqp: a consumer callback, ``Connection.drain_events``."""
    span = Span("stock py-amqp")
    conn = amqp.Connection(host=BROKER_HOST, connect_timeout=TIMEOUT, write_timeout=TIMEOUT)
    conn.connect()
    try:
        channel = conn.channel()
        if not no_ack:
            channel.basic_qos(0, PREFETCH, False)

        def on_message(message: Message) -> None:
            if not no_ack:
                channel.basic_ack(message.delivery_tag)
            span.tick()

        channel.basic_consume(queue, callback=on_message, no_ack=no_ack)
        _drain(conn.drain_events, span)
        return span.result()
    finally:
        conn.close()


def run_kombu(kind: str, queue: str, no_ack: bool) -> dict[str, float]:
    """kombu ``Consumer``: "stock" (kombu's pyamqp), or the drainer's transport in
    "drainer" or "legacy" mode; ``message.ack()`` in the callback in the ack case."""
    if kind == "stock":
        conn = kombu.Connection(URL, connect_timeout=TIMEOUT)
    else:
        conn = kombu.Connection(
            URL,
            transport="drainer_amqp:Transport",
            connect_timeout=TIMEOUT,
            transport_options={"dedicated_drainer": kind == "drainer"},
        )
    span = Span(f"{kind} kombu")
    try:

        def on_message(_body: Any, message: Any) -> None:
            if not no_ack:
                message.ack()
            span.tick()

        consumer = kombu.Consumer(
            conn.channel(),
            queues=[kombu.Queue(queue, no_declare=True)],
            callbacks=[on_message],
            no_ack=no_ack,
            prefetch_count=None if no_ack else PREFETCH,
        )
        with consumer:
            _drain(conn.drain_events, span)
        return span.result()
    finally:
        conn.release()


def _installed(row: str) -> bool:
    """Whether the client a row measures can be imported."""
    client = row.split()[0]
    return client not in OPTIONAL or importlib.util.find_spec(OPTIONAL[client]) is not None


def test_consume(bench_report: Collector) -> None:
    began = time.perf_counter()
    clients: dict[str, Callable[[str, bool], dict[str, float]]] = {
        "pika BlockingConnection": run_pika,
        "amqpstorm": run_amqpstorm,
        "stock py-amqp": run_pyamqp,
        STOCK_KOMBU: partial(run_kombu, "stock"),
        "drainer kombu Consumer, drainer mode": partial(run_kombu, "drainer"),
        "drainer kombu Consumer, legacy mode": partial(run_kombu, "legacy"),
    }
    runs = [(name, case) for name in clients if _installed(name) for case in CASES]
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for i in range(ROUNDS):
        for name, case in runs if i % 2 == 0 else runs[::-1]:
            with filled_queue() as queue:
                result = clients[name](queue, CASES[case])
            results.setdefault(name, {}).setdefault(case, []).append(result)
    rate = {
        name: {case: max(r["deliveries_s"] for r in by[case]) for case in CASES}
        for name, by in results.items()
    }
    cpu = {
        name: {case: statistics.median(r["cpu_us"] for r in by[case]) for case in CASES}
        for name, by in results.items()
    }
    rows = [
        [
            name,
            *(f"{rate[name][case]:,.0f}" for case in CASES),
            *(fmt_ratio(rate[name][case] / rate[STOCK_KOMBU][case]) for case in CASES),
            *(f"{cpu[name][case]:.1f}" for case in CASES),
        ]
        if name in rate
        else [name, "not installed", *["-"] * 5]
        for name in clients
    ]
    bench_report.add(
        Section(
            key="consume",
            title="K. Consuming, one consumer thread (64-byte bodies, a prefilled queue)",
            headers=[
                "client",
                "no_ack deliveries/s",
                "ack-each deliveries/s",
                "over stock kombu, no_ack",
                "over stock kombu, ack-each",
                "CPU µs/delivery, no_ack",
                "CPU µs/delivery, ack-each",
            ],
            rows=rows,
            notes=[
                f"Each run: one consumer thread, a queue of its own prefilled with {N:,} "
                "messages before the timed span. Deliveries/s: deliveries over the time from "
                "the first delivery to the last; the best of "
                f"{ROUNDS} interleaved round(s) (the order reversed each round).",
                "no_ack: basic_consume with no_ack=True, no prefetch limit. ack-each: "
                f"no_ack=False, basic_qos prefetch_count={PREFETCH:,}, one basic_ack per "
                "delivery, in the callback.",
                "CPU µs/delivery: this process's CPU time (every thread: the drainer's, "
                "amqpstorm's IO thread) over the same span, per delivery; the median of "
                "rounds. The broker's CPU is not counted.",
                "Over stock kombu: this row's rate over the stock kombu Consumer row's. "
                "pika, amqpstorm: a client not installed shows 'not installed'.",
            ],
            raw={
                "messages": N,
                "body_bytes": len(BODY),
                "prefetch_ack_case": PREFETCH,
                "deliveries_s": rate,
                "cpu_us_per_delivery": cpu,
                "rounds": results,
                "not_installed": [n for n in clients if n not in rate],
            },
            seconds=time.perf_counter() - began,
            order=19,
        )
    )
