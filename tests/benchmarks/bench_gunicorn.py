"""Benchmark: gunicorn ``gthread`` app, one shared connection per worker, legacy vs drainer.

The example app (examples/gunicorn_app.py) publishes one confirmed message per request
through a kombu connection shared by a worker's request threads, while a consumer thread
drains the same connection with ``drain_events(timeout=1)``. gunicorn runs with
``-k gthread --threads 8 -w 2``; the load is 20 concurrent HTTP connections for 30 s per
mode (``DRAINER_BENCH_QUICK=1``: 5 s), modes interleaved legacy, drainer, drainer,
legacy, ... when ``DRAINER_BENCH_GUNICORN_ROUNDS`` > 1 (default 1 round = one run each).

Load generator: ``wrk`` (Debian: ``apt-get install -y wrk``) with a Lua ``done()`` hook
that prints the exact latency percentiles; without ``wrk`` a Python client with 20
threads (``time.perf_counter()`` per request, one keep-alive connection per thread; forced
with ``DRAINER_BENCH_CLIENT=python``). The printed table says which one ran.

Expected: in legacy mode a publish waits behind the consumer's blocking read, so request
latency collapses toward the consumer's drain timeout (1 s); in drainer mode it stays
near the app's own cost (a broker round trip for the confirm).

Hard checks (the figures themselves are only reported): every answer was a 200 (no
socket errors), every answered request's message is in the queue, drainer mode answered
every request within the 30 s request timeout (legacy's timeouts are only reported). The
p95 ratio is printed, never asserted: a few seconds of load on shared cores is noise.

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
from support.broker import BROKER_HOST, unique_name
from test_gunicorn import Gunicorn, health_by_pid

from benchmarks.report import percentile

QUICK = os.environ.get("DRAINER_BENCH_QUICK", "") not in ("", "0")
DURATION = 5 if QUICK else 30  # seconds of load per mode and round
ROUNDS = int(os.environ.get("DRAINER_BENCH_GUNICORN_ROUNDS", "1"))
CONCURRENCY = 20
WORKERS, THREADS = 2, 8
REQUEST_TIMEOUT = 30  # seconds; a slower request counts as a timeout, not a latency

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
    extra: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # distinct client-side errors

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else math.nan


def wrk_command(port: int, script: str) -> list[str]:
    return [
        "wrk", "-t2", f"-c{CONCURRENCY}", f"-d{DURATION}s", "--latency",
        f"--timeout={REQUEST_TIMEOUT}s", "-s", script, f"http://127.0.0.1:{port}/publish",
    ]  # fmt: skip


def load_with_wrk(mode: str, port: int, script: str) -> Run:
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
    return Run(
        mode=mode,
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


def load_with_python(mode: str, port: int) -> Run:
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


def one_run(mode: str, wrk_script: str | None) -> Run:
    queue = unique_name(f"bench-gunicorn-{mode}")
    server = Gunicorn(mode, queue, workers=WORKERS, threads=THREADS, preload_connect=False)
    try:
        server.wait_ready()
        health_by_pid(server, WORKERS)  # every worker has connected before the load
        warm = message_count(queue)
        if wrk_script is not None:
            run = load_with_wrk(mode, server.port, wrk_script)
        else:
            run = load_with_python(mode, server.port)
        answered = message_count(queue) - warm
        # Requests in flight when the load stopped may still publish: count after stopping.
        server.stop()
        assert server.process.returncode == 0, server.output()
        run.queued = message_count(queue) - warm
        assert answered >= run.requests, (answered, run)
        output = server.output()
        assert "Traceback" not in output, output
        return run
    finally:
        server.close()
        delete_queue(queue)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:9.1f}"


def print_table(runs: list[Run], command: str) -> None:
    print()
    print(f"gunicorn -k gthread --threads {THREADS} -w {WORKERS}: {CONCURRENCY} concurrent")
    print(f"requests for {DURATION}s per run; load: {command}")
    print(
        f"{'mode':8} {'client':6} {'requests':>9} {'req/s':>8} {'p50 ms':>9} {'p95 ms':>9} "
        f"{'p99 ms':>9} {'max ms':>9} {'errors':>7} {'t/o':>4} {'queued':>7}"
    )
    for r in runs:
        print(
            f"{r.mode:8} {r.client:6} {r.requests:9d} {r.rate:8.1f} {ms(r.p50)} {ms(r.p95)} "
            f"{ms(r.p99)} {ms(r.max)} {r.errors:7d} {r.timeouts:4d} {r.queued:7d}"
        )
    for r in runs:
        if r.extra and any(r.extra.values()):
            print(f"{r.mode}: wrk errors {r.extra}")
        if r.failures:
            print(f"{r.mode}: client errors {r.failures}")


@pytest.mark.benchmark
def test_gunicorn_gthread_request_latency_legacy_vs_drainer(wrk_script: str | None) -> None:
    runs: list[Run] = []
    for i in range(ROUNDS):
        modes = ("legacy", "drainer") if i % 2 == 0 else ("drainer", "legacy")
        for mode in modes:
            runs.append(one_run(mode, wrk_script))
    if wrk_script is not None:
        command = " ".join(wrk_command(0, "<done-hook.lua>")).replace(":0/", ":<port>/")
    else:
        command = f"Python client, {CONCURRENCY} threads, keep-alive, perf_counter per request"
    print_table(runs, command)

    for r in runs:
        assert r.requests > 0, r
        assert r.errors == 0, r  # every answer was a 200: each publish was confirmed
        # Each 200 was sent after its publish was confirmed; requests still in flight at
        # the end (one per client connection) or abandoned after a timeout may have
        # published without being counted.
        assert r.requests <= r.queued <= r.requests + r.timeouts + CONCURRENCY, r
    legacy = [r for r in runs if r.mode == "legacy"]
    drainer = [r for r in runs if r.mode == "drainer"]
    # Drainer mode answers every request in time; legacy's timeouts are only reported.
    assert all(r.timeouts == 0 for r in drainer), drainer
    # Latency ratios are reported, never asserted: a few seconds of load on 2 shared
    # cores is noise, and the gate must not fail on noise.
    ratio = min(r.p95 for r in legacy) / max(r.p95 for r in drainer)
    print(f"best legacy p95 / worst drainer p95: {ratio:.2f}x (reported, not asserted)")
