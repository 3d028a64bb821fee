"""Benchmark I: one millisecond away. The headline rows on loopback and through the test
proxy with 1 ms of round trip added, measured in the same run, side by side.

Every row runs the same code twice per round, once per network: "loopback" connects to
the broker directly, "1 ms RTT" connects to a proxy of the project's own Toxiproxy-
compatible server (in a child process, see ``conftest.py``) in front of the same broker.
Only the ``host:port`` differs. The two runs of a row are adjacent in time, their order
reversed from one round to the next (loopback first on even rounds).

The added latency: one ``latency`` toxic of ``LATENCY_MS`` = 1 ms (jitter 0) on the
downstream stream (broker -> client) only, so each round trip costs 1 ms more and the
upstream is not delayed (the proxy takes whole milliseconds only: 0.5 ms each way is not
possible). It is added once, when the proxy is made, before any connection is opened:
every proxied connection is 1 ms away from its first byte, as a remote broker would be.
The proxied column also pays for the proxy itself (a Python process relaying every
byte); the notes give the round trip measured on each network (stock py-amqp
``basic_qos``, P50), which includes both.

Rows, 64-byte bodies, the default exchange:

1. publish, no confirms, ``THREADS`` threads: every client of
   :func:`benchmarks.clients.open_client` (drainer, legacy, stock+lock, stock per thread,
   amqpstorm; its connection host pointed at the network for the duration of the call),
   routing key bound to no queue. Each thread publishes once (warm-up), then for
   ``WINDOW`` s, then makes one round trip on its channel; msg/s = publishes in the
   window / (start -> the last thread's round trip returned).
2. sync confirms, 1 thread: benchmark G's runs (``bench_confirms``) for ``WINDOW`` s: the
   drainer's and stock py-amqp's ``basic_publish_confirm``, the drainer's and stock
   kombu's ``Producer.publish`` with ``confirm_publish``, pika's BlockingConnection and
   amqpstorm, to a queue with x-max-length 1,000.
3. streaming confirms, 1 thread, as in benchmark G: the raw-socket ceiling, the drainer's
   ``basic_publish_deferred`` and kombu ``confirm_publish="deferred"`` (every future
   waited for), pika's SelectConnection (window 5,000) and aio-pika (gathers of 1,000);
   msg/s = publishes / (start -> all acked).
4. publish beside a stuck consumer, P99 ms: drainer and legacy. A consumer thread loops
   ``drain_events(timeout=1)`` on an exclusive queue that receives nothing while the
   benchmark's thread publishes (no confirms, routing key bound to no queue) and sleeps
   ``PACE`` after each publish for ``STUCK_WINDOW`` s; the P99 of the publish call times
   of every round (n: how many calls).

Rates (rows 1-3) are the median over rounds; row 4 pools the calls of all rounds. The
ratio is 1 ms RTT / loopback: below 1 for a rate means slower, above 1 for a P99 means
slower. Hard checks only: every publish returned (no error, no stalled thread), every
deferred publish acked, the consumer raised nothing. Every wait is bounded
(``TIMEOUT``), every connection closed, the queue and the proxy deleted.

Run: ``pytest tests/benchmarks/bench_rtt.py -m benchmark -s -o python_files='bench_*.py'``.
"""

from __future__ import annotations

import importlib.util
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from unittest import mock

import amqp
import pytest
from support.broker import BROKER_HOST, unique_name, wait_until
from support.threads import Drain
from support.toxiproxy.fixtures import ProxiedBroker

from benchmarks import QUICK, bench_confirms, blocked_in, clients, connect
from benchmarks.clients import open_client
from benchmarks.report import Collector, Section, fmt_ms, fmt_ratio, percentile, ratio

pytestmark = pytest.mark.benchmark

ROUNDS = 1 if QUICK else 2
WINDOW = 0.5 if QUICK else 0.75  # seconds of publishing per run, rows 1-3
STUCK_WINDOW = 1.0 if QUICK else 1.5  # seconds of publishing per run, row 4
THREADS = 10  # row 1
PACE = 0.010  # row 4: seconds of sleep after each publish
LATENCY_MS = 1  # added to every round trip through the proxy (downstream only)
RTT_SAMPLES = 50 if QUICK else 200  # basic_qos round trips per network, for the notes
TIMEOUT = 10.0  # seconds any one connect, publish or wait may take
BODY = b"x" * 64
NETWORKS = ("loopback", "1 ms RTT")


@dataclass(frozen=True)
class Case:
    """One table row: ``run(hostport)`` measures it once on that network."""

    row: str
    client: str
    run: Callable[[str], list[float]]  #: [msg/s], or each publish call's seconds (p99)
    p99: bool = False


def round_trip_p50(hostport: str) -> float:
    """P50 seconds of one round trip (``basic_qos``) on a stock py-amqp connection."""
    conn = amqp.Connection(host=hostport, connect_timeout=TIMEOUT)
    conn.connect()
    try:
        channel = conn.channel()
        times = []
        for _ in range(RTT_SAMPLES):
            start = time.perf_counter()
            channel.basic_qos(0, 0, False)
            times.append(time.perf_counter() - start)
        return percentile(times, 50)
    finally:
        conn.close()


def run_publish(name: str, routing_key: str, hostport: str) -> list[float]:
    """Row 1: ``THREADS`` threads share ``name``'s client, no confirms; [msg/s]."""
    with mock.patch.object(clients, "BROKER_HOST", hostport):  # open_client's host
        client = open_client(name, THREADS, confirms=False, routing_key=routing_key)
    clock: dict[str, float] = {}

    def begin() -> None:  # run by one thread as the barrier releases them all
        clock["start"] = time.perf_counter()

    ready = threading.Barrier(THREADS, action=begin, timeout=TIMEOUT)
    counts = [0] * THREADS
    done = [0.0] * THREADS
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        publish = client.publish[i]
        try:
            publish(BODY)  # warm-up, not counted
            ready.wait()
            deadline = clock["start"] + WINDOW
            while time.perf_counter() < deadline:
                publish(BODY)
                counts[i] += 1
            client.sync[i]()
            done[i] = time.perf_counter()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            ready.abort()

    workers = [
        threading.Thread(target=worker, args=(i,), name=f"bench-rtt-{name}-{i}")
        for i in range(THREADS)
    ]
    try:
        for w in workers:
            w.start()
        end = time.monotonic() + WINDOW + 2 * TIMEOUT
        for w in workers:
            w.join(max(end - time.monotonic(), 0.0))
        stalled = sum(w.is_alive() for w in workers)
    finally:
        client.close()
        for w in workers:
            w.join(TIMEOUT)
    assert not stalled, f"{name} at {hostport}: {stalled} threads stalled"
    assert not errors, f"{name} at {hostport}: {errors[0]!r}"
    return [sum(counts) / (max(done) - clock["start"])]


def confirms(run: Callable[..., float], *args: object) -> Callable[[str], list[float]]:
    """Rows 2-3: one of benchmark G's runs (``bench_confirms``) on a network, for
    ``WINDOW`` s, in a thread of its own as G runs it; [msg/s]."""

    def measure(hostport: str) -> list[float]:
        return [bench_confirms.in_a_thread(partial(run, *args, host=hostport, window=WINDOW))]

    return measure


def run_stuck(mode: str, routing_key: str, hostport: str) -> list[float]:
    """Row 4: each publish call's seconds beside a consumer in ``drain_events(timeout=1)``."""
    conn = connect(mode, host=hostport, connect_timeout=TIMEOUT)
    drain = Drain(conn, timeout=1, name=f"bench-rtt-consumer-{mode}")
    latencies: list[float] = []
    try:
        consumer = conn.channel()
        queue = consumer.queue_declare("", exclusive=True, auto_delete=True)[0]
        consumer.basic_consume(queue, callback=lambda message: None, no_ack=True)
        channel = conn.channel()
        drain.start()
        assert wait_until(lambda: blocked_in(drain.thread, {"drain_events"}), 5), (
            f"{mode}: the consumer thread never blocked in drain_events"
        )
        message = amqp.Message(BODY)
        start = time.perf_counter()
        while time.perf_counter() - start < STUCK_WINDOW:
            t = time.perf_counter()
            channel.basic_publish(message, routing_key=routing_key, timeout=TIMEOUT)
            latencies.append(time.perf_counter() - t)
            time.sleep(PACE)  # the pace, not a synchronisation
    finally:
        try:
            if drain.thread.ident is not None:  # started
                drain.stop()  # fails if it did not stop
        finally:
            conn.close()
    assert drain.error is None, f"{mode}: the consumer raised {drain.error!r}"
    return latencies


def installed(client: str) -> bool:
    """Whether ``client``'s library can be imported (pika and aio-pika are optional)."""
    module = {"pika": "pika", "aio-pika": "aio_pika"}.get(client.split()[0])
    return module is None or importlib.util.find_spec(module) is not None


def _cell(case: Case, values: list[float]) -> tuple[float, str]:
    """The figure a row shows for one network, and its cell."""
    if case.p99:
        p99 = percentile(values, 99)
        return p99, f"{fmt_ms(p99)} (n={len(values)})"
    rate = statistics.median(values)
    return rate, f"{rate:,.0f}"


def test_one_millisecond_away(proxied_broker: ProxiedBroker, bench_report: Collector) -> None:
    began = time.perf_counter()
    proxy = proxied_broker.proxy
    proxy.add_toxic(
        name="rtt",
        type="latency",
        stream="downstream",
        attributes={"latency": LATENCY_MS, "jitter": 0},
    )
    hosts = {"loopback": BROKER_HOST, "1 ms RTT": proxied_broker.hostport}
    nowhere = unique_name("bench-rtt-nowhere")
    queue = unique_name("bench-rtt")
    admin = connect("drainer", connect_timeout=TIMEOUT)
    publish = f"publish, no confirms, {THREADS} threads, msg/s"
    sync = "sync confirms, 1 thread, msg/s"
    deferred = "streaming (deferred) confirms, 1 thread, msg/s"
    stuck = "publish beside a stuck consumer, P99"
    cases = [
        *(
            Case(publish, name, partial(run_publish, name, nowhere))
            for name in ("drainer", "legacy", "stock+lock", "stock per thread", "amqpstorm")
        ),
        Case(sync, "drainer", confirms(bench_confirms.run_sync, "drainer", queue)),
        Case(sync, "stock py-amqp", confirms(bench_confirms.run_sync, "stock", queue)),
        Case(sync, "drainer kombu", confirms(bench_confirms.run_kombu, "drainer", queue)),
        Case(sync, "stock kombu", confirms(bench_confirms.run_kombu, "stock", queue)),
        Case(sync, "pika BlockingConnection", confirms(bench_confirms.run_pika_blocking, queue)),
        Case(sync, "amqpstorm", confirms(bench_confirms.run_amqpstorm, queue)),
        Case(deferred, "raw socket (ceiling)", confirms(bench_confirms.run_ceiling, queue)),
        Case(deferred, "drainer", confirms(bench_confirms.run_deferred, "drainer", 1, queue)),
        Case(
            deferred,
            "drainer kombu confirm_publish='deferred'",
            confirms(bench_confirms.run_kombu, "deferred", queue),
        ),
        Case(
            deferred,
            "pika SelectConnection (window 5,000)",
            confirms(bench_confirms.run_pika_select, queue),
        ),
        Case(deferred, "aio-pika (gathers of 1,000)", confirms(bench_confirms.run_aio_pika, queue)),
        Case(stuck, "drainer", partial(run_stuck, "drainer", nowhere), p99=True),
        Case(stuck, "legacy", partial(run_stuck, "legacy", nowhere), p99=True),
    ]
    cases = [case for case in cases if installed(case.client)]
    values: dict[tuple[int, str], list[float]] = {}
    try:
        admin.channel().queue_declare(queue, auto_delete=False, arguments={"x-max-length": 1000})
        rtt = {net: round_trip_p50(hosts[net]) for net in NETWORKS}
        for i in range(ROUNDS):
            for k in range(len(cases)) if i % 2 == 0 else reversed(range(len(cases))):
                for net in NETWORKS if i % 2 == 0 else NETWORKS[::-1]:
                    values.setdefault((k, net), []).extend(cases[k].run(hosts[net]))
    finally:
        try:
            admin.channel().queue_delete(queue)
            admin.close()
        finally:
            proxy.destroy_toxic("rtt")  # the fixture deletes the proxy
    rows = []
    results = []
    for k, case in enumerate(cases):
        (near, near_cell), (far, far_cell) = (_cell(case, values[(k, net)]) for net in NETWORKS)
        rows.append([case.row, case.client, near_cell, far_cell, fmt_ratio(ratio(far, near))])
        results.append(
            {
                "row": case.row,
                "client": case.client,
                "loopback": near,
                "rtt_1ms": far,
                "values": {net: values[(k, net)] for net in NETWORKS},
            }
        )
    bench_report.add(
        Section(
            key="rtt",
            title="I. One millisecond away: loopback against 1 ms of round trip added",
            headers=["row", "client", "loopback", "1 ms RTT", "ratio (1 ms / loopback)"],
            rows=rows,
            notes=[
                f"{ROUNDS} round(s), the two networks of a row back to back, their order "
                f"reversed each round; rows 1-3 publish for {WINDOW:g} s per run (msg/s: "
                f"the median of rounds), row 4 for {STUCK_WINDOW:g} s (P99 of every call, "
                "n calls).",
                f"1 ms RTT: the test proxy with a {LATENCY_MS} ms latency toxic on its "
                "downstream (broker -> client), added before any connection. Measured "
                f"round trip (stock py-amqp basic_qos, P50 of {RTT_SAMPLES}): loopback "
                f"{fmt_ms(rtt['loopback'])}, through the proxy {fmt_ms(rtt['1 ms RTT'])} "
                "(the proxy's own relaying included).",
                "Rows 1 and 4 publish to a routing key bound to no queue; rows 2 and 3 to "
                "one queue (x-max-length 1,000), with benchmark G's code.",
                "Ratio: 1 ms RTT / loopback (a rate below 1x: slower; a P99 above 1x: slower).",
            ],
            raw={"latency_ms": LATENCY_MS, "rtt_p50_s": rtt, "results": results},
            seconds=time.perf_counter() - began,
            order=17,
        )
    )
