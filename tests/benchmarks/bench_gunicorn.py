"""Benchmark C: gunicorn ``gthread`` app against no AMQP and other clients.

The example app (examples/gunicorn_app.py) publishes one message per request, all request
threads of the worker sharing one connection (a channel each): with a publisher confirm
(the app's ``APP_CONFIRMS=1``, report section ``gunicorn``) and without
(``APP_CONFIRMS=0``, section ``gunicorn_no_confirms``). gunicorn runs with
``-k gthread --threads 16 -w 1``; the load is 20 concurrent HTTP connections for
``DURATION`` s per run. Modes (the app's ``DRAINER_MODE``), each publishing mode with
confirms and without (the two runs next to each other), in ABBA order over
``DRAINER_BENCH_GUNICORN_ROUNDS`` rounds (default 1):

* ``none``: the same app without AMQP (once per round: it does not publish; the
  baseline every row of both sections is divided by);
* ``drainer`` / ``legacy``: kombu on drainer_amqp's transport, an idle consumer thread on
  the same connection in ``drain_events(timeout=1)``;
* ``stock-lock``: a stock kombu connection behind one RLock, the idle consumer reading
  under that lock 50 ms at a time;
* ``per-thread``: a stock kombu connection per request thread (each reads its own
  confirms: no hand-over between threads), the idle consumer on one more;
* ``amqpstorm``: one amqpstorm connection, a channel per thread (confirming, or not), an
  idle consumer thread in ``start_consuming()``.

Load generator: ``wrk`` (Debian: ``apt-get install -y wrk``) with a Lua ``done()`` hook
that prints the exact latency percentiles; without ``wrk`` a Python client with 20
threads (``time.perf_counter()`` per request, one keep-alive connection per thread; forced
with ``DRAINER_BENCH_CLIENT=python``). The report says which one ran.

Hard checks, with confirms and without (the figures themselves are only reported): every
answer was a 200 (no socket errors), every answered request's message is in the queue
(without confirms: within a few seconds of the load's end, the broker may still be taking
the last ones in), drainer mode answered every request within the 30 s request timeout
(legacy's timeouts are only reported).

This file is named ``bench_*.py``: run it with
``pytest -m benchmark -s tests/benchmarks/bench_gunicorn.py``.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import amqp
import pytest
from support.broker import BROKER_HOST, unique_name, wait_until
from support.gunicorn import Gunicorn, health_by_pid

from benchmarks import QUICK
from benchmarks.cpu import broker_pid, cpu_seconds
from benchmarks.report import Collector, Section, Target, fmt_ms, fmt_ratio, percentile, ratio

# Seconds of load per run (mode, confirms or not) and round. Quick: long enough for legacy
# mode, whose publishes wait for the idle consumer's 1-s reads (as stock py-amqp's), to
# finish a few requests (without confirms about 10 a second, each taking up to 3 s).
DURATION = 3 if QUICK else 5
ROUNDS = int(os.environ.get("DRAINER_BENCH_GUNICORN_ROUNDS", "1"))
CONCURRENCY = 20
WORKERS, THREADS = 1, 16
MODES = ("none", "drainer", "legacy", "stock-lock", "per-thread", "amqpstorm")
# the report's client names
LABELS = {"none": "no AMQP", "stock-lock": "stock+lock", "per-thread": "conn per thread"}
# One round's runs: the baseline once (it does not publish), then every publishing mode
# with confirms and without; odd rounds run them in reverse (ABBA).
RUNS: tuple[tuple[str, bool | None], ...] = (("none", None),) + tuple(
    (mode, confirms) for mode in MODES[1:] for confirms in (True, False)
)
REQUEST_TIMEOUT = 30  # seconds; a slower request counts as a timeout, not a latency
SETTLE_TIMEOUT = 10.0  # seconds: without confirms, for the answered messages to be queued

WRK_SCRIPT = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d,'
    .. ' "status": %d, "timeout": %d, "p50": %d, "p95": %d, "p99": %d, "max": %d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(95), latency:percentile(99), latency.max))
end
"""


@dataclass
class Run:
    mode: str
    confirms: bool | None  # None: the no-AMQP baseline
    client: str
    requests: int  # answered with 200
    errors: int  # socket errors and non-200 answers
    timeouts: int  # requests not answered within REQUEST_TIMEOUT
    seconds: float
    p50: float
    p95: float
    p99: float
    max: float
    queued: int = 0  # messages found in the queue afterwards
    worker_cpu: float | None = None  # CPU seconds of the worker processes over the load
    broker_cpu: float | None = None  # CPU seconds of the broker process over the load
    extra: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # distinct client-side errors

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else math.nan

    @property
    def worker_us(self) -> float:
        """The worker processes' CPU µs per answered request (NaN: not measured)."""
        return _per_request(self.worker_cpu, self.requests)

    @property
    def broker_us(self) -> float:
        """The broker's CPU µs per answered request (NaN: not measured)."""
        return _per_request(self.broker_cpu, self.requests)


def _per_request(seconds: float | None, requests: int) -> float:
    return math.nan if seconds is None or not requests else 1e6 * seconds / requests


def _fmt_us(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.0f}"


def wrk_command(port: int, script: str) -> list[str]:
    return [
        "wrk", "-t2", f"-c{CONCURRENCY}", f"-d{DURATION}s", "--latency",
        f"--timeout={REQUEST_TIMEOUT}s", "-s", script, f"http://127.0.0.1:{port}/publish",
    ]  # fmt: skip


def load_with_wrk(mode: str, confirms: bool | None, port: int, script: str) -> Run:
    out = subprocess.run(
        wrk_command(port, script),
        capture_output=True,
        text=True,
        timeout=DURATION + 60,
        check=True,
    ).stdout
    line = next((x for x in out.splitlines() if x.startswith("WRK_JSON ")), None)
    assert line is not None, out
    r = json.loads(line.removeprefix("WRK_JSON "))
    errors = r["connect"] + r["read"] + r["write"] + r["status"]
    if r["requests"] == 0:  # no latency was measured: not 0 ms
        r.update(p50=math.nan, p95=math.nan, p99=math.nan, max=math.nan)
    return Run(
        mode=mode,
        confirms=confirms,
        client="wrk",
        # wrk counts every completed response in "requests", non-2xx ones too
        requests=r["requests"] - r["status"],
        errors=errors,
        timeouts=r["timeout"],
        seconds=r["duration_us"] / 1e6,
        p50=r["p50"] / 1e6,
        p95=r["p95"] / 1e6,
        p99=r["p99"] / 1e6,
        max=r["max"] / 1e6,
        extra={k: r[k] for k in ("connect", "read", "write", "status", "timeout")},
    )


def load_with_python(mode: str, confirms: bool | None, port: int) -> Run:
    """20 threads, each on one keep-alive connection, for DURATION seconds."""
    latencies: list[list[float]] = [[] for _ in range(CONCURRENCY)]
    errors = [0] * CONCURRENCY
    timeouts = [0] * CONCURRENCY
    failures: list[str] = []
    start = time.perf_counter()
    deadline = start + DURATION

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
        try:
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    conn.request("GET", "/publish")
                    response = conn.getresponse()
                    response.read()
                    ok = response.status == 200
                except TimeoutError:
                    timeouts[i] += 1
                    conn.close()  # reconnects on the next request
                    continue
                except OSError as exc:
                    ok = False
                    failures.append(repr(exc))
                    conn.close()
                if ok:
                    latencies[i].append(time.perf_counter() - t0)
                else:
                    errors[i] += 1
        finally:
            conn.close()

    threads = [
        threading.Thread(target=client, args=(i,), name=f"bench-client-{i}")
        for i in range(CONCURRENCY)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DURATION + REQUEST_TIMEOUT + 30)
        assert not t.is_alive(), f"{t.name} hung"
    seconds = time.perf_counter() - start
    flat = [x for per in latencies for x in per]
    return Run(
        mode=mode,
        confirms=confirms,
        client="python",
        requests=len(flat),
        errors=sum(errors),
        timeouts=sum(timeouts),
        seconds=seconds,
        p50=percentile(flat, 50),
        p95=percentile(flat, 95),
        p99=percentile(flat, 99),
        max=max(flat) if flat else math.nan,
        failures=sorted(set(failures)),
    )


def message_count(queue: str) -> int:
    conn = amqp.Connection(host=BROKER_HOST)
    conn.connect()
    try:
        return conn.channel().queue_declare(queue, passive=True).message_count
    finally:
        conn.close()


def delete_queue(queue: str) -> None:
    conn = amqp.Connection(host=BROKER_HOST)
    conn.connect()
    try:
        conn.channel().queue_delete(queue)
    finally:
        conn.close()


@pytest.fixture
def wrk_script() -> Iterator[str | None]:
    """The Lua hook for wrk, or None for the Python client: when wrk is not installed,
    or when ``DRAINER_BENCH_CLIENT=python`` asks for it."""
    if shutil.which("wrk") is None or os.environ.get("DRAINER_BENCH_CLIENT") == "python":
        yield None
        return
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_SCRIPT)
    try:
        yield f.name
    finally:
        os.unlink(f.name)


def one_run(mode: str, confirms: bool | None, wrk_script: str | None) -> Run:
    queue = unique_name(f"bench-gunicorn-{mode}")
    server = Gunicorn(
        mode,
        queue,
        workers=WORKERS,
        threads=THREADS,
        preload_connect=False,
        confirms=confirms is not False,
    )
    try:
        server.wait_ready()
        health = health_by_pid(server, WORKERS)  # every worker has connected before the load
        assert all(h["confirms"] is (confirms is not False) for h in health.values()), health
        warm = message_count(queue) if mode != "none" else 0
        watched = (list(health), [broker_pid()])
        before = [cpu_seconds(pids) for pids in watched]
        if wrk_script is not None:
            run = load_with_wrk(mode, confirms, server.port, wrk_script)
        else:
            run = load_with_python(mode, confirms, server.port)
        after = [cpu_seconds(pids) for pids in watched]
        run.worker_cpu, run.broker_cpu = (
            None if a is None or b is None else a - b for a, b in zip(after, before, strict=True)
        )
        if mode == "none":
            answered = run.requests
        elif confirms:  # each 200 was sent after the broker confirmed its message
            answered = message_count(queue) - warm
        else:  # each 200 was sent once its message was handed to the connection
            wait_until(
                lambda: message_count(queue) - warm >= run.requests, SETTLE_TIMEOUT, interval=0.1
            )
            answered = message_count(queue) - warm
        # Requests in flight when the load stopped may still publish: count after stopping.
        server.stop()
        assert server.process.returncode == 0, server.output()
        run.queued = message_count(queue) - warm if mode != "none" else run.requests
        assert answered >= run.requests, (answered, run)
        output = server.output()
        assert "Traceback" not in output, output
        return run
    finally:
        server.close()
        if mode != "none":
            delete_queue(queue)


def median(values: list[float]) -> float:
    return percentile(values, 50) if values else math.nan


def section_of(runs: list[Run], confirms: bool, command: str, seconds: float) -> Section:
    """The report section of the runs with (``confirms``) or without publisher confirms;
    the no-AMQP baseline's runs are in both."""
    mine = [r for r in runs if r.confirms in (None, confirms)]

    def of(mode: str, attr: str) -> float:
        return median([getattr(r, attr) for r in mine if r.mode == mode])

    base_rate = of("none", "rate")
    rows = []
    results = []
    for mode in MODES:
        rate = of(mode, "rate")
        timeouts = sum(r.timeouts for r in mine if r.mode == mode)
        rows.append(
            [
                LABELS.get(mode, mode),
                f"{rate:,.0f}",
                fmt_ratio(ratio(rate, base_rate)),
                fmt_ms(of(mode, "p50")),
                fmt_ms(of(mode, "p95")),
                fmt_ms(of(mode, "p99")),
                fmt_ms(of(mode, "max")),
                str(timeouts),
                _fmt_us(of(mode, "worker_us")),
                _fmt_us(of(mode, "broker_us")),
                "" if mode == "drainer" else fmt_ratio(ratio(of("drainer", "rate"), rate)),
            ]
        )
        results.append(
            {
                "client": LABELS.get(mode, mode),
                "req_s": rate,
                "vs_no_amqp": ratio(rate, base_rate),
                **{q: of(mode, q) for q in ("p50", "p95", "p99", "max")},
                "timeouts": timeouts,
                "worker_cpu_us_per_request": of(mode, "worker_us"),
                "broker_cpu_us_per_request": of(mode, "broker_us"),
                "rounds_req_s": [r.rate for r in mine if r.mode == mode],
            }
        )
    common = [
        f"gunicorn -k gthread --threads {THREADS} -w {WORKERS}; {CONCURRENCY} concurrent "
        f"keep-alive connections for {DURATION} s per app and round, {ROUNDS} round(s) "
        f"(ABBA order; every app with confirms and without, next to each other, the no-AMQP "
        f"app once per round); median over rounds. Load: {command}.",
        "Worker CPU: the gunicorn worker's user + system time over the load, per answered "
        "request (the worker is bound by its interpreter lock: its rate is about the inverse "
        "of this); broker CPU: the broker process's (the one listening on the broker's "
        "port), per answered request, '-' where it cannot be read. Medians over rounds.",
        "amqpstorm leaves TCP_NODELAY off, so the kernel holds its small writes back while "
        "one is unacknowledged (Nagle) and the broker reads many publishes at once: less "
        "broker CPU a request, longer tails (P99, max). py-amqp, kombu and drainer-amqp set "
        "TCP_NODELAY: each publish leaves at once, and is one read for the broker.",
    ]
    dr_rel = ratio(of("drainer", "rate"), base_rate)
    dr_vs_storm = ratio(of("drainer", "rate"), of("amqpstorm", "rate"))
    if confirms:
        targets = [
            Target("drainer req/s / no-AMQP req/s", fmt_ratio(dr_rel), ">= 0.7x", dr_rel >= 0.7),
            Target(
                "drainer req/s / amqpstorm req/s", fmt_ratio(dr_vs_storm), "> 1x", dr_vs_storm > 1
            ),
        ]
        key = "gunicorn"
        title = "C. gunicorn gthread (1 worker x 16 threads), one confirmed publish per request"
        notes = common + [
            "Every request publishes one message with a publisher confirm to a queue of its "
            "own per run (checked afterwards: every 200 has its message), on a channel of the "
            "request thread; the no-AMQP app only answers.",
            "Consumers: drainer/legacy have an idle consumer thread on the same connection in "
            "drain_events(timeout=1); stock+lock's idle consumer reads under the shared lock "
            "50 ms at a time (a 1-s read would stall every publish for up to 1 s, as in "
            "legacy); conn per thread's idle consumer has a connection of its own, read "
            "50 ms at a time under a lock that only the process's exit also takes; "
            "amqpstorm's idle consumer thread runs "
            "start_consuming(). Python's locks "
            "are not fair: the consumer, looping on the lock, may take it back before a "
            "request thread wakes, and starve the requests (a run can answer none: '-' "
            "latencies).",
            "The load generator runs on the same 2 cores as gunicorn and the broker: the "
            "no-AMQP baseline is limited by it as much as by the app.",
            "Targets are reported, not asserted.",
            "Wall time: the whole benchmark, this section's runs and those of the next one "
            "(without confirms), interleaved.",
        ]
    else:
        targets = [
            Target("drainer req/s / no-AMQP req/s", fmt_ratio(dr_rel), ">= 0.85x", dr_rel >= 0.85),
            Target(
                "drainer req/s / amqpstorm req/s",
                fmt_ratio(dr_vs_storm),
                ">= 1.1x",
                dr_vs_storm >= 1.1,
            ),
        ]
        key = "gunicorn_no_confirms"
        title = "C. gunicorn gthread (1 worker x 16 threads), one publish per request, no confirms"
        notes = common + [
            "The same app, consumers and load as the confirmed section (measured in the same "
            "runs, interleaved with it), but each publish is not confirmed (kombu's "
            "confirm_publish off, amqpstorm's channels without confirm_deliveries()): a 200 "
            "once the message is handed to the connection. Checked afterwards: every 200 has "
            "its message in the queue.",
            "The no-AMQP row is the same baseline runs as in the confirmed section.",
        ]
    return Section(
        key=key,
        title=title,
        headers=[
            "app",
            "req/s",
            "vs no AMQP",
            "P50",
            "P95",
            "P99",
            "max",
            "timeouts",
            "worker CPU µs/req",
            "broker CPU µs/req",
            "drainer / this (req/s)",
        ],
        rows=rows,
        targets=targets,
        notes=notes,
        raw={
            "duration_s": DURATION,
            "rounds": ROUNDS,
            "confirms": confirms,
            "client": "wrk" if command.startswith("wrk") else "python",
            "results": results,
            "runs": [{k: v for k, v in vars(r).items() if k not in ("failures",)} for r in mine],
        },
        seconds=seconds,
    )


@pytest.mark.benchmark
def test_gunicorn_gthread_against_other_clients(
    wrk_script: str | None, bench_report: Collector
) -> None:
    began = time.perf_counter()
    runs: list[Run] = []
    for i in range(ROUNDS):
        for mode, confirms in RUNS if i % 2 == 0 else RUNS[::-1]:
            runs.append(one_run(mode, confirms, wrk_script))
    if wrk_script is not None:
        command = " ".join(wrk_command(0, "<done-hook.lua>")).replace(":0/", ":<port>/")
    else:
        command = f"Python client, {CONCURRENCY} threads, keep-alive, perf_counter per request"

    for r in runs:
        # stock+lock's request threads can starve behind its consumer's loop on the lock
        # (Python's locks are not fair): a run without an answer is reported, as it is.
        assert r.requests > 0 or r.mode not in ("none", "drainer"), r
        assert r.errors == 0, r  # every answer was a 200: each publish succeeded
        # Each 200 was sent after its publish was confirmed (or, without confirms, handed to
        # the connection); requests still in flight at the end (one per client connection)
        # or abandoned after a timeout may have published without being counted.
        assert r.requests <= r.queued <= r.requests + r.timeouts + CONCURRENCY, r
    # Drainer mode answers every request in time; the others' timeouts are only reported.
    assert all(r.timeouts == 0 for r in runs if r.mode == "drainer"), runs

    seconds = time.perf_counter() - began
    bench_report.add(section_of(runs, True, command, seconds))
    bench_report.add(section_of(runs, False, command, 0.0))
