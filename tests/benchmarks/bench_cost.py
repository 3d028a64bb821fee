"""Benchmark H: what a publish costs the publishing process, not only how fast it goes.

Threads publish 64-byte bodies without confirms through kombu's ``Producer.publish``
(amqpstorm: ``channel.basic.publish``) to a routing key bound to no queue, a fixed
number of messages in all (``TOTAL``, split between the threads; each thread stops at
``CAP`` seconds), on one connection:
``drainer``, ``legacy``, ``stock+lock`` (a stock kombu connection behind one lock) and
``amqpstorm``; 1, 16 and 100 publishing threads; with and without an idle consumer on
the same connection (drainer/legacy: a thread in ``drain_events(timeout=1)``;
stock+lock: a thread reading under the lock 50 ms at a time, as the gunicorn benchmark's;
amqpstorm: a thread in ``start_consuming()``).

Per message, over the publishing window (noise on a shared machine hides a cost less
than a rate): CPU time of the process (user + system, ``getrusage``), split into the
publishing threads (``time.thread_time`` in each), the consumer thread (its CPU clock),
and the rest (the library's own threads: the drainer, amqpstorm's IO thread); voluntary
and involuntary context switches (``getrusage``, every thread of the process); system
calls, all and the publishers' (``perf stat``, counted in the kernel: see
:mod:`benchmarks.syscalls`; not measured without perf); the longest single call. Hard
check only: every publisher thread ends.

Run: ``pytest tests/benchmarks/bench_cost.py -m benchmark -s``.
"""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import amqpstorm
import pytest
from kombu import Producer
from support.broker import unique_name

from benchmarks import QUICK
from benchmarks.clients import _host_port, kombu_connection
from benchmarks.report import Collector, Section
from benchmarks.syscalls import SyscallCount

pytestmark = pytest.mark.benchmark

TOTAL = 2_000 if QUICK else 12_000  # messages per run, split between the threads
THREADS = (1, 16, 100)
CLIENTS = ("drainer", "legacy", "stock+lock", "amqpstorm")
BODY = b"x" * 64
JOIN = 120.0
#: Seconds a run may publish (legacy mode beside a consumer's one-second reads is slow).
CAP = 1.0 if QUICK else 3.0


@dataclass
class Cost:
    """Per-message figures of one run."""

    messages: int
    rate: float
    cpu_us: float
    publishers_us: float
    library_us: float
    consumer_us: float
    voluntary: float
    involuntary: float
    longest_ms: float
    syscalls: float | None  # per message, every thread (None: not measured)
    publisher_syscalls: float | None  # per message, the publishing threads'


class _Setup:
    """One client's connection, a publish callable per thread, and the idle consumer."""

    def __init__(self, client: str, threads: int, consumer: bool, routing_key: str) -> None:
        self.publish: list[Callable[[], object]] = []
        self.closers: list[Callable[[], object]] = []
        self.consume: Callable[[threading.Event], None] | None = None
        self.consumer_seconds = 0.0
        if client == "amqpstorm":
            self._storm(threads, consumer, routing_key)
        else:
            self._kombu(client, threads, consumer, routing_key)

    def _kombu(self, client: str, threads: int, consumer: bool, routing_key: str) -> None:
        conn = kombu_connection(client, confirms=False)
        lock = threading.RLock() if client.startswith("stock") else None
        self.closers.append(conn.release)
        for _ in range(threads):
            producer = Producer(conn.channel(), routing_key=routing_key)

            def publish(producer: Producer = producer) -> object:
                if lock is None:
                    return producer.publish(BODY, retry=False)
                with lock:
                    return producer.publish(BODY, retry=False)

            self.publish.append(publish)
        if not consumer:
            return
        channel = conn.channel()
        queue = channel.queue_declare(queue="", exclusive=True).queue
        channel.basic_consume(queue, callback=lambda message: None)

        def consume(stop: threading.Event) -> None:
            while not stop.is_set():
                try:
                    if lock is None:
                        conn.drain_events(timeout=1)
                    else:
                        with lock:
                            conn.drain_events(timeout=0.05)
                except TimeoutError:
                    pass

        self.consume = consume

    def _storm(self, threads: int, consumer: bool, routing_key: str) -> None:
        host, port = _host_port()
        conn = amqpstorm.Connection(host, "guest", "guest", port=port)
        self.closers.append(conn.close)
        for _ in range(threads):
            basic = conn.channel().basic

            def publish(basic: amqpstorm.basic.Basic = basic) -> object:
                return basic.publish(BODY, routing_key=routing_key, exchange="")

            self.publish.append(publish)
        if not consumer:
            return
        channel = conn.channel()
        queue = channel.queue.declare(exclusive=True)["queue"]
        channel.basic.consume(lambda message: None, queue)

        def stop_when(stop: threading.Event) -> None:
            stop.wait()
            channel.stop_consuming()

        def consume(stop: threading.Event) -> None:
            threading.Thread(target=stop_when, args=(stop,), name="idle-consumer-stop").start()
            channel.start_consuming()

        self.consume = consume

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


def run(client: str, threads: int, consumer: bool) -> Cost:
    setup = _Setup(client, threads, consumer, unique_name("drainer-bench-cost"))
    syscalls = SyscallCount()
    stop = threading.Event()
    consumer_cpu: list[float] = []
    consumer_thread = None
    try:
        if setup.consume is not None:
            consume = setup.consume

            def consumer_main() -> None:
                began = time.thread_time()
                try:
                    consume(stop)
                finally:
                    consumer_cpu.append(time.thread_time() - began)

            consumer_thread = threading.Thread(target=consumer_main, name="idle-consumer")
            consumer_thread.start()
            time.sleep(0.2)  # let it settle into its wait: not synchronisation, warm-up
        each = TOTAL // threads
        go = threading.Barrier(threads + 1)
        cpu: list[float] = [0.0] * threads
        longest: list[float] = [0.0] * threads
        done: list[int] = [0] * threads

        def publisher(i: int) -> None:
            publish = setup.publish[i]
            go.wait(JOIN)
            began = time.thread_time()
            cap = time.perf_counter() + CAP
            worst = 0.0
            for k in range(each):
                t = time.perf_counter()
                if t > cap:
                    break
                publish()
                worst = max(worst, time.perf_counter() - t)
                done[i] = k + 1
            cpu[i] = time.thread_time() - began
            longest[i] = worst

        workers = [threading.Thread(target=publisher, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        syscalls.attach()  # every thread of the window exists now
        syscalls.start()
        go.wait(JOIN)
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        consumer_before = _thread_cpu(consumer_thread)
        start = time.perf_counter()
        for worker in workers:
            worker.join(JOIN)
            assert not worker.is_alive(), f"{client}: a publisher hung"
        took = time.perf_counter() - start
        usage1 = resource.getrusage(resource.RUSAGE_SELF)
        consumer_spent = _thread_cpu(consumer_thread) - consumer_before
        syscalls.stop()
    finally:
        stop.set()
        if consumer_thread is not None:
            consumer_thread.join(JOIN)
        setup.close()
        syscalls.close()
    n = sum(done)
    counts = syscalls.counts
    publishers_ids = {worker.native_id for worker in workers}
    total = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    publishers = sum(cpu)
    return Cost(
        messages=n,
        rate=n / took,
        cpu_us=1e6 * total / n,
        publishers_us=1e6 * publishers / n,
        library_us=1e6 * max(total - publishers - consumer_spent, 0.0) / n,
        consumer_us=1e6 * consumer_spent / n,
        voluntary=(usage1.ru_nvcsw - usage0.ru_nvcsw) / n,
        involuntary=(usage1.ru_nivcsw - usage0.ru_nivcsw) / n,
        longest_ms=1e3 * max(longest),
        syscalls=None if counts is None else sum(counts.values()) / n,
        publisher_syscalls=None
        if counts is None
        else sum(c for tid, c in counts.items() if tid in publishers_ids) / n,
    )


def _syscalls(cost: Cost) -> str:
    if cost.syscalls is None or cost.publisher_syscalls is None:
        return "no perf"
    return f"{cost.syscalls:.2f} / {cost.publisher_syscalls:.2f}"


def _thread_cpu(thread: threading.Thread | None) -> float:
    """CPU seconds (user + system) of another ``thread`` so far (0 if none)."""
    if thread is None or thread.ident is None:
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def test_cost_per_message(bench_report: Collector) -> None:
    began = time.perf_counter()
    results: dict[str, Cost] = {}
    for consumer in (False, True):
        for threads in THREADS:
            for client in CLIENTS if threads % 2 else CLIENTS[::-1]:  # alternate the order
                key = f"{client}|{threads}|{'consumer' if consumer else '-'}"
                results[key] = run(client, threads, consumer)
    rows = []
    for key, cost in results.items():
        client, count, with_consumer = key.split("|")
        idle = with_consumer != "-"
        rows.append(
            [
                client,
                count,
                "idle consumer" if idle else "",
                f"{cost.rate:,.0f}",
                f"{cost.cpu_us:.1f}",
                f"{cost.publishers_us:.1f}",
                f"{cost.library_us:.1f}",
                f"{cost.consumer_us:.1f}" if idle else "",
                f"{cost.voluntary:.2f} / {cost.involuntary:.2f}",
                _syscalls(cost),
                f"{cost.longest_ms:.1f}",
            ]
        )
    bench_report.add(
        Section(
            key="cost",
            title="H. What a publish costs (no confirms, 64-byte bodies, one connection)",
            headers=[
                "client",
                "threads",
                "",
                "msg/s",
                "CPU µs/msg",
                "publishers",
                "library threads",
                "consumer",
                "ctx switches/msg (vol / invol)",
                "syscalls/msg (all / publishers)",
                "longest call ms",
            ],
            rows=rows,
            notes=[
                f"{TOTAL:,} messages per run, split between the threads, each stopping "
                f"after {CAP:g} s (legacy and stock+lock beside a consumer's reads publish "
                "fewer: their rate says how many); one run each.",
                "CPU: the publishing process's user + system time over the window, per "
                "message; publishers: their threads' own CPU; library threads: the rest "
                "(the drainer, amqpstorm's IO thread); consumer: the idle consumer thread.",
                "Context switches: getrusage (every thread of the process). System calls: "
                "perf stat's raw_syscalls:sys_enter tracepoint, counted in the kernel per "
                "thread over the window (every thread of the process, the benchmark's "
                "waiting main thread included; publishers: their threads'); 'no perf' "
                "where perf or its permission is missing.",
            ],
            raw={key: vars(cost) for key, cost in results.items()},
            seconds=time.perf_counter() - began,
            order=16,
        )
    )
