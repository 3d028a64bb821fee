"""Benchmarks A and B: the drainer against the clients users would otherwise pick.

A. Throughput: 10 and 100 threads publish 64-byte bodies through kombu's
``Producer.publish`` (amqpstorm: ``channel.basic.publish``) for ``WINDOW`` seconds, with
and without publisher confirms, for every client in :mod:`benchmarks.clients`. After its
window each thread makes one round trip on its channel, so the rate counts only what
reached the broker: messages / (start -> last round trip done).

Destination: a queue each run declares (unique name, non-durable, transient messages)
through the default exchange, deleted after the run. The queue's message count is the
"nothing lost" check: it must equal the number of publishes that returned.

The raw-socket ceiling is benchmark 2's (``bench_throughput.run_ceiling``), measured once
per round in this run.

B. One-thread per-call cost: µs per ``channel.basic_publish`` (drainer Connection vs
stock ``amqp.Connection``), per ``Producer.publish`` (drainer vs stock kombu) and per
amqpstorm ``basic.publish``; ``CALLS`` calls per run, median over runs, clients
interleaved (ABBA), ``time.perf_counter``.

Targets are reported, never asserted; the tests assert behaviour only (no error, no
stalled thread, nothing lost).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import amqp
import amqpstorm
import pytest
from kombu import Producer
from support.broker import BROKER_HOST, unique_name, wait_until

import drainer_amqp
from benchmarks import QUICK
from benchmarks.bench_throughput import run_ceiling
from benchmarks.clients import CLIENTS, kombu_connection, open_client
from benchmarks.report import (
    Collector,
    Section,
    Target,
    fmt_ms,
    fmt_ratio,
    percentile,
    ratio,
)

pytestmark = pytest.mark.benchmark

THREADS = (10, 100)
ROUNDS = 1 if QUICK else 2
WINDOW = 0.3 if QUICK else 1.5  # seconds of publishing per run
BODY = b"x" * 64
STALL_AFTER = 20.0  # seconds after the window: a thread still blocked then has stalled
CALLS = 1000 if QUICK else 20000  # benchmark B: calls per run
CALL_RUNS = 3 if QUICK else 5  # benchmark B: runs per client


def abba(items: tuple[str, ...], rounds: int) -> Iterator[tuple[int, str]]:
    """``(round, item)``: items in order on even rounds, reversed on odd ones."""
    for i in range(rounds):
        yield from ((i, x) for x in (items if i % 2 == 0 else items[::-1]))


# -- helpers on a separate stock connection: the queue and its count ---------------------
class Admin:
    """A stock py-amqp connection to declare, count and delete the runs' queues (the
    benchmark's thread only)."""

    def __init__(self) -> None:
        self.conn = amqp.Connection(host=BROKER_HOST)
        self.conn.connect()
        self.channel = self.conn.channel()

    def declare(self) -> str:
        name = unique_name("bench-clients")
        self.channel.queue_declare(name, durable=False, auto_delete=False)
        return name

    def count(self, queue: str) -> int:
        return int(self.channel.queue_declare(queue, passive=True).message_count)

    def delete(self, queue: str) -> None:
        self.channel.queue_delete(queue)

    def close(self) -> None:
        self.conn.close()


# -- A: throughput --------------------------------------------------------------------------
@dataclass
class Run:
    client: str
    threads: int
    confirms: bool
    messages: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    stalled: int = 0
    stall_stack: str = ""

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0


def run_client(admin: Admin, name: str, threads: int, confirms: bool) -> Run:
    run = Run(name, threads, confirms)
    queue = admin.declare()
    try:
        client = open_client(name, threads, confirms, queue, BODY)
    except BaseException:
        admin.delete(queue)
        raise
    ready = threading.Barrier(threads + 1)
    go = threading.Event()
    clock: dict[str, float] = {}
    counts = [0] * threads
    latencies: list[list[float]] = [[] for _ in range(threads)]
    finished = [0.0] * threads
    errors: list[BaseException] = []
    workers: list[threading.Thread] = []

    def worker(i: int) -> None:
        publish, lat = client.publish[i], latencies[i]
        try:
            publish()  # warm-up, counted in the queue check below
            ready.wait(timeout=60)
            if not go.wait(timeout=60):
                raise TimeoutError("no start signal")
            deadline = clock["deadline"]
            n = 0
            now = time.perf_counter()
            while now < deadline:
                publish()
                end = time.perf_counter()
                lat.append(end - now)
                now = end
                n += 1
            counts[i] = n
            client.sync[i]()
            finished[i] = time.perf_counter()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            ready.abort()

    try:
        workers = [
            threading.Thread(target=worker, args=(i,), name=f"bench-{name}-{i}")
            for i in range(threads)
        ]
        for w in workers:
            w.start()
        try:
            ready.wait(timeout=60)
        except threading.BrokenBarrierError:
            pass  # a worker failed: the others stop at once
        start = time.perf_counter()
        clock["deadline"] = start + WINDOW if not errors else start
        go.set()
        end = time.monotonic() + WINDOW + STALL_AFTER
        for w in workers:
            w.join(max(end - time.monotonic(), 0.0))
        stalled = [w for w in workers if w.is_alive()]
        if stalled:
            run.stalled = len(stalled)
            frame = sys._current_frames().get(stalled[0].ident or -1)
            run.stall_stack = "".join(traceback.format_stack(frame)) if frame else ""
    finally:
        client.close()
        for w in workers:
            w.join(10)
    try:
        label = f"{name} x{threads} confirms={confirms}"
        assert not any(w.is_alive() for w in workers), f"{label}: threads did not stop"
        assert not run.stalled, f"{label}: {run.stalled} threads stalled:\n{run.stall_stack}"
        assert not errors, f"{label}: {errors[0]!r}"
        run.messages = sum(counts)
        expected = run.messages + threads  # + the warm-ups
        assert wait_until(lambda: admin.count(queue) >= expected, 10), (
            f"{label}: {admin.count(queue)} messages in the queue, {expected} published"
        )
        assert admin.count(queue) == expected, f"{label}: {admin.count(queue)} != {expected}"
    finally:
        admin.delete(queue)
    run.seconds = max(finished) - start
    run.latencies = [x for lat in latencies for x in lat]
    return run


def test_client_throughput(bench_report: Collector) -> None:
    began = time.perf_counter()
    admin = Admin()
    runs: list[Run] = []
    ceilings: list[float] = []
    try:
        for i in range(ROUNDS):
            ceilings.append(run_ceiling())
            order = CLIENTS if i % 2 == 0 else CLIENTS[::-1]
            for confirms in (False, True):
                for threads in THREADS:
                    for name in order:
                        runs.append(run_client(admin, name, threads, confirms))
    finally:
        admin.close()
    ceiling = statistics.median(ceilings)

    def of(name: str, threads: int, confirms: bool) -> list[Run]:
        return [r for r in runs if (r.client, r.threads, r.confirms) == (name, threads, confirms)]

    def rate(name: str, threads: int, confirms: bool) -> float:
        return statistics.median(r.rate for r in of(name, threads, confirms))

    def lat(name: str, threads: int, confirms: bool) -> list[float]:
        return [x for r in of(name, threads, confirms) for x in r.latencies]

    rows: list[list[str]] = [
        ["raw socket ceiling (1 thread)", "-", "no", f"{ceiling:,.0f}", "-", "-", "-", "-", "-"]
    ]
    results = []
    for confirms in (False, True):
        for threads in THREADS:
            dr = rate("drainer", threads, confirms)
            for name in CLIENTS:
                value = rate(name, threads, confirms)
                samples = lat(name, threads, confirms)
                p50, p95, p99 = (percentile(samples, q) for q in (50, 95, 99))
                results.append(
                    {
                        "client": name,
                        "threads": threads,
                        "confirms": confirms,
                        "msg_s": value,
                        "p50_s": p50,
                        "p95_s": p95,
                        "p99_s": p99,
                        "rounds_msg_s": [r.rate for r in of(name, threads, confirms)],
                    }
                )
                rows.append(
                    [
                        name,
                        str(threads),
                        "yes" if confirms else "no",
                        f"{value:,.0f}",
                        fmt_ms(p50),
                        fmt_ms(p99),
                        f"{fmt_ms(p50)} / {fmt_ms(p95)} / {fmt_ms(p99)}" if confirms else "-",
                        "" if name == "drainer" else fmt_ratio(ratio(dr, value)),
                        f"{100 * value / ceiling:.1f}%",
                    ]
                )

    def r(threads: int, confirms: bool, other: str) -> float:
        return ratio(rate("drainer", threads, confirms), rate(other, threads, confirms))

    def target(threads: int, confirms: bool, other: str, bound: float) -> Target:
        value = r(threads, confirms, other)
        kind = "confirms" if confirms else "no confirms"
        return Target(
            f"{kind}, {threads} threads: drainer/{other} msg/s",
            fmt_ratio(value),
            f">= {bound:g}x",
            value >= bound,
        )

    p99_dr = percentile(lat("drainer", 100, False), 99)
    p99_st = percentile(lat("amqpstorm", 100, False), 99)
    targets = [
        target(10, False, "stock+lock", 2.0),
        target(10, False, "amqpstorm", 1.5),
        target(100, False, "stock+lock", 1.5),
        target(100, False, "amqpstorm", 1.5),
        target(10, True, "stock+lock", 2.0),
        target(100, True, "stock+lock", 2.0),
        Target(
            "no confirms, 100 threads: drainer P99 publish vs amqpstorm's",
            f"{fmt_ms(p99_dr)} vs {fmt_ms(p99_st)}",
            "<= amqpstorm's",
            p99_dr <= p99_st,
        ),
    ]
    section = Section(
        key="clients_throughput",
        title="A. Publish throughput against other clients (Producer.publish, 64-byte bodies)",
        headers=[
            "client",
            "threads",
            "confirms",
            "msg/s",
            "P50 publish",
            "P99 publish",
            "confirm P50 / P95 / P99",
            "drainer / this",
            "of ceiling",
        ],
        rows=rows,
        targets=targets,
        notes=[
            f"{ROUNDS} round(s); in each, every configuration runs every client in turn, "
            "the client order reversed on odd rounds (ABBA). Each run: fresh connection(s), "
            f"{WINDOW:g} s of publishing after a start barrier; msg/s is the median over "
            "rounds, percentiles over every call of every round.",
            "Rate = publishes in the window / (window start -> every thread's closing round "
            "trip on its channel done), so nothing still in socket buffers counts.",
            "Destination: a queue declared per run (unique name, non-durable) through the "
            "default exchange; after each run its message count must equal the publishes "
            "(asserted: nothing lost), then it is deleted.",
            "Clients: drainer / legacy = kombu on drainer_amqp:Transport, one shared "
            "connection, a channel + Producer per thread; stock+lock = one stock kombu "
            "(pyamqp) connection behind one RLock held around each publish (and its confirm "
            "wait); stock per thread = one stock kombu connection per thread; amqpstorm = "
            "one shared amqpstorm Connection, a channel per thread, basic.publish.",
            "With confirms every call returns on the broker's ack (kombu confirm_publish, "
            "amqpstorm confirm_deliveries), so the publish latency is the confirm latency: "
            "the confirm column gives its P50/P95/P99.",
            "Ceiling: benchmark 2's raw-socket row (one thread writing pre-encoded frames), "
            "measured once per round in this run.",
            "Targets are reported, not asserted (2 cores shared with the broker and other jobs).",
        ],
        raw={
            "rounds": ROUNDS,
            "window_s": WINDOW,
            "body_bytes": len(BODY),
            "ceiling_msg_s": ceiling,
            "results": results,
        },
        seconds=time.perf_counter() - began,
    )
    bench_report.add(section)


# -- B: one-thread per-call cost ----------------------------------------------------------
def _timed(call: Callable[[], object], n: int) -> float:
    """Seconds per call of ``n`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n


@dataclass
class Subject:
    """One client for benchmark B: ``call`` publishes one message, ``sync`` is a round
    trip, ``close`` ends it (the benchmark's thread only)."""

    call: Callable[[], object]
    sync: Callable[[], object]
    close: Callable[[], object]


def open_subject(name: str, routing_key: str) -> Subject:
    if name.endswith("basic_publish"):
        if name.startswith("drainer"):
            conn: amqp.Connection = drainer_amqp.Connection(
                host=BROKER_HOST, dedicated_drainer=True
            )
        elif name.startswith("legacy"):
            conn = drainer_amqp.Connection(host=BROKER_HOST, dedicated_drainer=False)
        else:
            conn = amqp.Connection(host=BROKER_HOST)
        conn.connect()
        channel = conn.channel()
        message = amqp.Message(BODY)
        return Subject(
            lambda: channel.basic_publish(message, exchange="", routing_key=routing_key),
            lambda: channel.basic_qos(0, 0, False),
            conn.close,
        )
    if name.endswith("Producer.publish"):
        kconn = kombu_connection(name.split()[0], confirms=False)
        kchannel = kconn.channel()
        producer = Producer(kchannel, routing_key=routing_key)
        return Subject(
            lambda: producer.publish(BODY, retry=False),
            lambda: kchannel.basic_qos(0, 0, False),
            kconn.release,
        )
    host, _, port = BROKER_HOST.partition(":")
    sconn = amqpstorm.Connection(host, "guest", "guest", port=int(port or 5672))
    basic = sconn.channel().basic
    return Subject(
        lambda: basic.publish(BODY, routing_key=routing_key, exchange=""),
        lambda: basic.qos(0),
        sconn.close,
    )


SUBJECTS = (
    "drainer basic_publish",
    "legacy basic_publish",
    "stock basic_publish",
    "drainer Producer.publish",
    "legacy Producer.publish",
    "stock Producer.publish",
    "amqpstorm basic.publish",
)
BASELINE = {
    "drainer basic_publish": "stock basic_publish",
    "drainer Producer.publish": "stock Producer.publish",
}


def test_one_thread_call_cost(bench_report: Collector) -> None:
    began = time.perf_counter()
    routing_key = unique_name("bench-nowhere")  # bound to no queue: nothing piles up
    per_call: dict[str, list[float]] = {s: [] for s in SUBJECTS}
    for _, name in abba(SUBJECTS, CALL_RUNS):
        subject = open_subject(name, routing_key)
        try:
            _timed(subject.call, CALLS // 10)  # warm-up
            subject.sync()
            per_call[name].append(_timed(subject.call, CALLS))
            subject.sync()  # every call reached the broker without an error
        finally:
            subject.close()
    med = {s: statistics.median(v) for s, v in per_call.items()}
    rows = []
    for s in SUBJECTS:
        base = BASELINE.get(s)
        vs_storm = ratio(med[s], med["amqpstorm basic.publish"])
        rows.append(
            [
                s,
                f"{med[s] * 1e6:.1f}",
                f"{min(per_call[s]) * 1e6:.1f} - {max(per_call[s]) * 1e6:.1f}",
                fmt_ratio(ratio(med[s], med[base])) if base else "",
                fmt_ratio(vs_storm),
            ]
        )
    bp, pp = med["drainer basic_publish"] * 1e6, med["drainer Producer.publish"] * 1e6
    targets = [
        Target("one thread: drainer basic_publish", f"{bp:.1f} µs", "<= 8 µs", bp <= 8.0),
        Target("one thread: drainer Producer.publish", f"{pp:.1f} µs", "<= 30 µs", pp <= 30.0),
    ]
    section = Section(
        key="call_cost",
        title="B. One-thread cost per publish call (µs, no confirms)",
        headers=["call", "median µs/call", "range over runs", "vs stock", "vs amqpstorm"],
        rows=rows,
        targets=targets,
        notes=[
            f"{CALL_RUNS} runs per call of {CALLS:,} back-to-back calls each (after "
            f"{CALLS // 10:,} warm-up calls), 64-byte body, one thread; runs interleaved "
            "ABBA over the calls; each run a fresh connection; time.perf_counter around "
            "the whole loop; a round trip after the loop checks every publish got through.",
            "Destination: default exchange, routing key bound to no queue (dropped).",
            "'vs stock': drainer / stock py-amqp (basic_publish) or stock kombu "
            "(Producer.publish); 'vs amqpstorm': this / amqpstorm basic.publish.",
            "Targets are reported, not asserted.",
        ],
        raw={"calls": CALLS, "runs": CALL_RUNS, "per_call_s": per_call, "median_s": med},
        seconds=time.perf_counter() - began,
    )
    bench_report.add(section)
