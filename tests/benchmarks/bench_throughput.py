"""Benchmark 2: publish throughput of threads sharing one connection.

10 and 100 publisher threads share one connection, a channel each, and publish as fast
as they can for ``WINDOW`` seconds: first plain ``basic_publish`` (no confirms), then
``basic_publish_confirm`` (publisher confirms, one wait per message). After its window
each thread makes one round trip on its channel (``basic_qos``), so messages still in
socket buffers are not counted as done: the rate is messages / (start -> last round
trip done).

Destination: the default exchange with a unique routing key bound to no queue. The
broker parses, routes and (with confirms) acknowledges every message, then drops it;
nothing piles up in a queue and there is nothing to clean up.

Ceiling (same run, one round before each pair of mode rounds): one thread writes
pre-encoded Basic.Publish method + header + body frames, 64 messages per ``sendall``,
straight to the socket of a py-amqp connection (handshake and channel open done by
py-amqp), then makes the same round trip. Each mode's rate is reported as a fraction
of it.

This file is named ``bench_*.py``: collect it with ``-o python_files='test_*.py bench_*.py'``
or by passing its path.
"""

from __future__ import annotations

import statistics
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import amqp
import pytest
from amqp import spec
from amqp.serialization import dumps
from support.broker import BROKER_HOST, unique_name

from benchmarks import QUICK, connect, interleaved
from benchmarks.report import (
    SPREAD_HEADERS,
    Collector,
    Section,
    Target,
    fmt_ms,
    fmt_ratio,
    per_thread_result,
    percentile,
    ratio,
    spread_cells,
)

pytestmark = pytest.mark.benchmark

THREADS = (10, 100)
ROUNDS = 1 if QUICK else 2
WINDOW = 0.6 if QUICK else 1.5  # seconds of publishing per run
BODY = b"x" * 64
BATCH = 64  # messages per sendall in the ceiling
TARGET_10 = 1.3  # drainer / legacy, no confirms, 10 threads
TARGET_100 = 0.95  # drainer / legacy, no confirms, 100 threads
STALL_AFTER = 20.0  # seconds after the window: a thread still blocked then has stalled
TARGET_CONFIRMS_100 = 3.0  # drainer / legacy, confirms, 100 threads ("several times")


@dataclass
class Run:
    mode: str
    threads: int
    confirms: bool
    messages: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    per_thread: list[int] = field(default_factory=list)  #: publishes in the window, by thread
    stalled: int = 0  #: threads still blocked STALL_AFTER s after the window
    stall_stack: str = ""

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0


def run_publishers(mode: str, threads: int, confirms: bool) -> Run:
    run = Run(mode, threads, confirms)
    conn = connect(mode, host=BROKER_HOST)
    routing_key = unique_name("bench-nowhere")
    ready = threading.Barrier(threads + 1)
    go = threading.Event()
    clock: dict[str, float] = {}
    counts = [0] * threads
    latencies: list[list[float]] = [[] for _ in range(threads)]
    started = [0.0] * threads  #: when the call in progress began
    finished = [0.0] * threads
    errors: list[BaseException] = []
    errors_before_close = 0
    workers: list[threading.Thread] = []
    try:
        channels = [conn.channel() for _ in range(threads)]

        def worker(i: int) -> None:
            channel = channels[i]
            message = amqp.Message(BODY)
            publish = channel.basic_publish_confirm if confirms else channel.basic_publish
            lat = latencies[i]
            try:
                publish(message, exchange="", routing_key=routing_key)  # warm-up (+ select)
                ready.wait(timeout=60)
                if not go.wait(timeout=60):
                    raise TimeoutError("no start signal")
                deadline = clock["deadline"]
                now = time.perf_counter()
                while now < deadline:
                    started[i] = now
                    publish(message, exchange="", routing_key=routing_key)
                    end = time.perf_counter()
                    lat.append(end - now)
                    now = end
                    counts[i] += 1
                started[i] = 0.0
                channel.basic_qos(0, 0, False)  # a round trip: the broker has them all
                finished[i] = time.perf_counter()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                ready.abort()

        workers = [
            threading.Thread(target=worker, args=(i,), name=f"bench-pub-{mode}-{i}")
            for i in range(threads)
        ]
        for w in workers:
            w.start()
        try:
            ready.wait(timeout=60)
        except threading.BrokenBarrierError:
            pass  # a worker failed: the others stop at once (deadline in the past)
        start = time.perf_counter()
        clock["deadline"] = start + WINDOW if not errors else start
        go.set()
        end = time.monotonic() + WINDOW + STALL_AFTER
        for w in workers:
            w.join(max(end - time.monotonic(), 0.0))
        stalled = [w for w in workers if w.is_alive()]
        if stalled:  # reported, with where the first one is blocked
            run.stalled = len(stalled)
            now = time.perf_counter()
            for i, w in enumerate(workers):  # the calls in progress: as long as that, at least
                if w.is_alive() and started[i]:
                    latencies[i].append(now - started[i])
            frame = sys._current_frames().get(stalled[0].ident or -1)
            run.stall_stack = "".join(traceback.format_stack(frame)) if frame else ""
            errors_before_close = len(errors)
    finally:
        conn.close()
        for w in workers:
            w.join(10)
    assert not any(w.is_alive() for w in workers), f"{mode}: publisher threads did not stop"
    if run.stalled:
        del errors[errors_before_close:]  # the stalled threads, woken by close()
    assert not errors, f"{mode} x{threads} confirms={confirms}: {errors[0]!r}"
    run.messages = sum(counts)
    run.seconds = max(finished) - start
    run.latencies = [x for lat in latencies for x in lat]
    run.per_thread = counts
    return run


def publish_frames(channel_id: int, routing_key: str, body: bytes) -> bytes:
    """One Basic.Publish as wire bytes: method, content header and body frames."""
    method = struct.pack(">HH", *spec.Basic.Publish) + dumps(
        "Bssbb", (0, "", routing_key, False, False)
    )
    header = struct.pack(">HHQ", spec.Basic.Publish[0], 0, len(body))
    header += amqp.Message(body)._serialize_properties()
    return b"".join(
        struct.pack(">BHI", kind, channel_id, len(payload)) + payload + b"\xce"
        for kind, payload in ((1, method), (2, header), (3, body))
    )


def run_ceiling() -> float:
    """Messages per second one thread gets through a raw socket (see module docstring)."""
    conn = amqp.Connection(host=BROKER_HOST)
    conn.connect()
    try:
        channel = conn.channel()
        batch = publish_frames(channel.channel_id, unique_name("bench-nowhere"), BODY) * BATCH
        sock = conn.transport.sock
        sent = 0
        start = time.perf_counter()
        deadline = start + WINDOW
        while time.perf_counter() < deadline:
            sock.sendall(batch)
            sent += BATCH
        channel.basic_qos(0, 0, False)  # every publish before it has been handled
        return sent / (time.perf_counter() - start)
    finally:
        conn.close()


def test_publish_throughput(bench_report: Collector) -> None:
    began = time.perf_counter()
    runs: list[Run] = []
    ceilings: list[float] = []
    for i, mode in interleaved(ROUNDS):
        if mode == "legacy" and i % 2 == 0 or mode == "drainer" and i % 2 == 1:
            ceilings.append(run_ceiling())  # once per round, before its first mode
        for confirms in (False, True):
            for threads in THREADS:
                runs.append(run_publishers(mode, threads, confirms))
    ceiling = statistics.median(ceilings)

    def rate(mode: str, threads: int, confirms: bool) -> float:
        rates = [
            r.rate
            for r in runs
            if (r.mode, r.threads, r.confirms) == (mode, threads, confirms) and not r.stalled
        ]
        return statistics.median(rates) if rates else float("nan")

    def p99(mode: str, threads: int, confirms: bool) -> float:
        lat = [
            x
            for r in runs
            if (r.mode, r.threads, r.confirms) == (mode, threads, confirms)
            for x in r.latencies
        ]
        return percentile(lat, 99)

    rows: list[list[str]] = [
        ["raw socket ceiling", "1", "no", f"{ceiling:,.0f}", "-", "", "100%", ""]
    ]
    results = []
    fair_rows: list[list[str]] = []
    ratios: dict[tuple[int, bool], float] = {}
    for confirms in (False, True):
        for threads in THREADS:
            leg = rate("legacy", threads, confirms)
            dr = rate("drainer", threads, confirms)
            ratios[(threads, confirms)] = ratio(dr, leg)
            for mode, value in (("legacy", leg), ("drainer", dr)):
                p = p99(mode, threads, confirms)
                mine = [
                    r for r in runs if (r.mode, r.threads, r.confirms) == (mode, threads, confirms)
                ]
                counts = [n for r in mine for n in r.per_thread]
                lat = [x for r in mine for x in r.latencies]
                fair_rows.append(
                    [mode, str(threads), "yes" if confirms else "no", *spread_cells(counts, lat)]
                )
                results.append(
                    {
                        "mode": mode,
                        "threads": threads,
                        "confirms": confirms,
                        "msg_s": value,
                        **per_thread_result(counts, lat),
                        "rounds_msg_s": [
                            r.rate
                            for r in runs
                            if (r.mode, r.threads, r.confirms) == (mode, threads, confirms)
                        ],
                    }
                )
                rows.append(
                    [
                        mode,
                        str(threads),
                        "yes" if confirms else "no",
                        f"{value:,.0f}",
                        fmt_ms(p),
                        fmt_ratio(ratio(dr, leg)) if mode == "drainer" else "",
                        f"{100 * value / ceiling:.1f}%",
                        str(
                            sum(
                                r.stalled > 0
                                for r in runs
                                if (r.mode, r.threads, r.confirms) == (mode, threads, confirms)
                            )
                        ),
                    ]
                )
    r10, r100, c100 = ratios[(10, False)], ratios[(100, False)], ratios[(100, True)]
    targets = [
        Target(
            "no confirms, 10 threads: drainer/legacy",
            fmt_ratio(r10),
            f">= {TARGET_10}x",
            r10 >= TARGET_10,
        ),
        Target(
            "no confirms, 100 threads: drainer/legacy",
            fmt_ratio(r100),
            f">= {TARGET_100}x",
            r100 >= TARGET_100,
        ),
        Target(
            "confirms, 100 threads: drainer/legacy",
            fmt_ratio(c100),
            f">= {TARGET_CONFIRMS_100:.0f}x ('several times')",
            c100 >= TARGET_CONFIRMS_100,
        ),
    ]
    section = Section(
        key="throughput",
        title="2. Publish throughput, threads sharing one connection (a channel each)",
        headers=[
            "mode",
            "threads",
            "confirms",
            "msg/s",
            "P99 publish",
            "drainer/legacy",
            "of ceiling",
            "stalled runs",
        ],
        rows=rows,
        targets=targets,
        notes=[
            f"{ROUNDS} rounds per configuration and mode, interleaved (ABBA); each run a "
            f"fresh connection, {WINDOW:g} s of publishing after a start barrier; msg/s is "
            "the median over rounds, P99 is over every publish call of every round.",
            "Rate = messages published in the window / (window start -> every thread's "
            "closing basic_qos round trip done), so bytes left in socket buffers do not "
            "count.",
            "Destination: default exchange, unique routing key bound to no queue (the "
            "broker routes and, with confirms, acks each message, then drops it). Body "
            f"{len(BODY)} bytes.",
            "Ceiling: one thread writing pre-encoded Basic.Publish frames (method + header "
            f"+ body, {BATCH} messages per sendall) on the raw socket of a py-amqp "
            "connection, then the same round trip; median of one run per round.",
            "Targets here are reported, not asserted: the machine has 2 cores shared with "
            "the broker, and these ratios depend on scheduling more than on the library.",
            f"'stalled runs': runs where some thread was still blocked {STALL_AFTER:g} s "
            "after the window (excluded from msg/s; asserted zero for the drainer only). "
            "Stacks in results.json.",
        ],
        raw={
            "rounds": ROUNDS,
            "window_s": WINDOW,
            "body_bytes": len(BODY),
            "ceiling_msg_s": ceiling,
            "ceiling_rounds_msg_s": ceilings,
            "results": results,
            "stalls": [
                {
                    "mode": r.mode,
                    "threads": r.threads,
                    "confirms": r.confirms,
                    "stalled_threads": r.stalled,
                    "stack": r.stall_stack,
                }
                for r in runs
                if r.stalled
            ],
        },
        seconds=time.perf_counter() - began,
    )
    bench_report.add(section)
    bench_report.add(
        Section(
            key="throughput_fairness",
            title="2b. Fairness between the threads of benchmark 2",
            headers=["mode", "threads", "confirms", *SPREAD_HEADERS],
            rows=fair_rows,
            notes=[
                "Per-thread publishes: how many publishes each thread completed in its "
                "window (every thread of every round); 'min % of mean' near 0 means some "
                "thread starved while others streamed.",
                "Latency: time.perf_counter() around every publish call of every thread and "
                "round, the slow ones included; a call still blocked when a run is declared "
                "stalled counts with the time it had been blocked so far. 'max' is the "
                "longest single call.",
            ],
        )
    )
    drainer_stalls = [r for r in runs if r.mode == "drainer" and r.stalled]
    assert not drainer_stalls, "drainer threads stalled:\n" + drainer_stalls[0].stall_stack
    failed = [t.line() for t in targets if t.asserted and not t.met]
    assert not failed, "targets not met:\n" + "\n".join(failed)
