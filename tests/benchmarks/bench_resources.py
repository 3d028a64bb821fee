"""Benchmarks D and E: what connections cost in one process.

D. Idle connections: open ``IDLE`` connections (200; quick mode 50; 1,000 with
``DRAINER_BENCH_OWN_BROKER=1``) in this process,
drainer mode and stock py-amqp in turn, measure threads, file descriptors and RSS
(psutil), close them all and check that nothing leaked (threads and descriptors back to
where they were). The broker's socket limit (``rabbitmqctl status``) is shared with
everyone: the count is capped to leave ``BROKER_HEADROOM`` sockets free, and the report
says so when it is. The default broker allows about 830 sockets; with
``DRAINER_BENCH_OWN_BROKER=1`` (opt-in: about 11 s more) 1,000 connections go to a node
of our own instead (:class:`support.rabbit_nodes.RabbitNode`, open-file limit
``OWN_BROKER_NOFILE``). The soft ``RLIMIT_NOFILE`` is raised in-process when needed and
restored afterwards.

E. Deliveries nobody drains: in a child process (so RSS is its own), a consumer with no
prefetch limit (``basic_qos`` never called, acks on) on a queue of its own never drains
it; ``UNDRAINED`` 1-KiB messages (quick mode: 10k) are published to that queue on a
second, stock connection of the same process; once the broker has pushed what it can
(its ready count at zero or unchanged for 2 s), the child reports its RSS growth. Modes:
drainer, legacy, stock py-amqp.

Hard checks only: no error, every connection opened and closed, nothing leaked (D),
every message published and the queue deleted (E). Figures are reported.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import amqp
import psutil
import pytest
from support.broker import BROKER_HOST, drainer_threads, unique_name, wait_until
from support.rabbit_nodes import RabbitNode

import drainer_amqp
from benchmarks import QUICK
from benchmarks.report import REPO_ROOT, Collector, Section, fmt_ratio, ratio

pytestmark = pytest.mark.benchmark

BROKER_HEADROOM = 150  # broker sockets left for everyone else
FDS_PER_CONNECTION = 8  # generous: the drainer mode uses 4 (socket, wake-up pair, poller)
UNDRAINED = 10_000 if QUICK else 100_000
UNDRAINED_BODY = 1024
IDLE_MODES = ("drainer", "stock py-amqp")
#: ``DRAINER_BENCH_OWN_BROKER=1``: benchmark D against a node of our own (see above).
OWN_BROKER = os.environ.get("DRAINER_BENCH_OWN_BROKER", "") not in ("", "0")
OWN_BROKER_NOFILE = 8192  # the node's ``ulimit -n``: about 7,300 sockets
IDLE = 1000 if OWN_BROKER else 50 if QUICK else 200
UNDRAINED_MODES = ("drainer", "legacy", "stock py-amqp")


def library_version() -> str:
    """drainer_amqp's version and the commit of this checkout (measured code)."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"

    lib = git("log", "-1", "--format=%h %s", "--", "src")
    return (
        f"drainer-amqp {drainer_amqp.__version__}, library commit {lib!r} (last commit "
        f"touching src/), checkout {git('rev-parse', '--short', 'HEAD')}"
    )


# -- D: idle connections ----------------------------------------------------------------
def broker_sockets(node: RabbitNode | None = None) -> tuple[int, int] | None:
    """(sockets used, sockets limit) of the broker (the default one, or ``node``), or
    None if rabbitmqctl cannot tell."""
    try:
        if node is not None:
            out = node.ctl("status", "--formatter", "json")
        else:
            out = subprocess.run(
                ["rabbitmqctl", "-q", "status", "--formatter", "json"],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
        fds = json.loads(out)["file_descriptors"]
        return int(fds["sockets_used"]), int(fds["sockets_limit"])
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError, KeyError):
        return None


def snapshot(proc: psutil.Process) -> dict[str, int]:
    gc.collect()
    return {
        "threads": proc.num_threads(),
        "fds": proc.num_fds(),
        "rss": proc.memory_info().rss,
    }


def open_idle(mode: str, host: str = BROKER_HOST) -> amqp.Connection:
    conn: amqp.Connection
    if mode == "drainer":
        conn = drainer_amqp.Connection(host=host, dedicated_drainer=True)
    else:
        conn = amqp.Connection(host=host)
    conn.connect()
    return conn


def measure_idle(mode: str, count: int, host: str = BROKER_HOST) -> dict[str, Any]:
    proc = psutil.Process()
    before = snapshot(proc)
    conns: list[amqp.Connection] = []
    try:
        start = time.perf_counter()
        for _ in range(count):
            conns.append(open_idle(mode, host))
        opened = time.perf_counter() - start
        during = snapshot(proc)
    finally:
        start = time.perf_counter()
        for conn in conns:
            conn.close()
        closed = time.perf_counter() - start
    assert len(conns) == count
    # Drainer threads end on their own after close(): wait for them, then for the fds.
    assert wait_until(lambda: not drainer_threads(), 30), f"{len(drainer_threads())} drainers left"
    assert wait_until(lambda: proc.num_threads() <= before["threads"], 30), (
        f"{mode}: {proc.num_threads()} threads after close, {before['threads']} before"
    )
    assert wait_until(lambda: proc.num_fds() <= before["fds"], 30), (
        f"{mode}: {proc.num_fds()} fds after close, {before['fds']} before"
    )
    after = snapshot(proc)
    return {
        "mode": mode,
        "count": count,
        "before": before,
        "open": during,
        "after": after,
        "open_s": opened,
        "close_s": closed,
        "threads_per_conn": (during["threads"] - before["threads"]) / count,
        "fds_per_conn": (during["fds"] - before["fds"]) / count,
        "rss_per_conn": (during["rss"] - before["rss"]) / count,
    }


def idle_in_child(mode: str, count: int, host: str = BROKER_HOST) -> dict[str, Any]:
    """:func:`measure_idle` in a fresh interpreter (it inherits our RLIMIT_NOFILE)."""
    tests_dir = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")])
    code = (
        "import json, sys; from benchmarks.bench_resources import measure_idle; "
        "print('RESULT ' + json.dumps(measure_idle(sys.argv[1], int(sys.argv[2]), sys.argv[3])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, mode, str(count), host],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=path),
    )
    assert out.returncode == 0, out.stderr  # the leak checks run in the child
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out.stdout + out.stderr
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def test_idle_connections(bench_report: Collector) -> None:
    if not OWN_BROKER:
        idle_connections(bench_report, BROKER_HOST, None)
        return
    node = RabbitNode(nofile=OWN_BROKER_NOFILE)
    try:
        node.start()
        idle_connections(bench_report, f"127.0.0.1:{node.port}", node)
    finally:
        node.cleanup()


def idle_connections(bench_report: Collector, host: str, node: RabbitNode | None) -> None:
    """Benchmark D against ``host`` (``node``'s, if given, else the default broker's)."""
    began = time.perf_counter()
    sockets = broker_sockets(node)
    count = IDLE
    if sockets is not None:
        used, limit = sockets
        count = max(1, min(IDLE, limit - used - BROKER_HEADROOM))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = psutil.Process().num_fds() + count * FDS_PER_CONNECTION + 256
    raised = needed > soft
    if raised:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))
    results = []
    try:
        for mode in IDLE_MODES:  # each in a child: memory freed by one mode skews the next
            results.append(idle_in_child(mode, count, host))
    finally:
        if raised:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    stock = results[-1]
    rows = []
    for r in results:
        rows.append(
            [
                r["mode"],
                str(r["count"]),
                f"{r['threads_per_conn']:.2f}",
                f"{r['fds_per_conn']:.2f}",
                f"{r['rss_per_conn'] / 1024:.0f} KiB",
                f"{(r['open']['rss'] - r['before']['rss']) / 2**20:.1f} MiB",
                f"{r['open_s'] * 1000 / r['count']:.2f} ms",
                f"{r['close_s'] * 1000 / r['count']:.2f} ms",
                f"{(r['after']['rss'] - r['before']['rss']) / 2**20:.1f} MiB",
                fmt_ratio(ratio(r["rss_per_conn"], stock["rss_per_conn"])),
            ]
        )
    notes = [
        f"{count} connections per mode, opened one after another in one child process "
        "per mode, "
        "measured (psutil num_threads, num_fds, RSS after gc.collect()), then all closed; "
        "after close the threads and descriptors must be back to their starting counts "
        "(asserted: nothing leaked). RSS after close is reported only (the allocator keeps "
        "freed memory).",
        (
            f"Broker: a node of our own ({node.name}, ulimit -n {node.nofile})"
            if node is not None
            else f"Broker: the default one ({host})"
        ),
        f"Broker sockets before: {sockets[0]} used of {sockets[1]} (rabbitmqctl status)"
        if sockets
        else "Broker socket limit unknown (rabbitmqctl status failed).",
        f"RLIMIT_NOFILE soft {soft} / hard {hard}"
        + (f", raised to {min(needed, hard)} for the run and restored" if raised else ""),
        library_version(),
    ]
    if count < IDLE:
        notes.insert(
            1,
            f"Capped at {count} instead of {IDLE}: the shared broker allows "
            f"{sockets[1] if sockets else '?'} sockets in all and this benchmark leaves "
            f"{BROKER_HEADROOM} for others (the broker's limit is not ours to raise; "
            "DRAINER_BENCH_OWN_BROKER=1 measures against a node with a higher one).",
        )
    section = Section(
        key="idle_connections",
        title="D. Idle connections in one process: threads, descriptors, memory",
        headers=[
            "mode",
            "connections",
            "threads/conn",
            "fds/conn",
            "RSS/conn",
            "RSS total",
            "open/conn",
            "close/conn",
            "RSS left after close",
            "RSS/conn vs stock",
        ],
        rows=rows,
        notes=notes,
        raw={
            "requested": IDLE,
            "count": count,
            "broker": node.name if node is not None else host,
            "broker_sockets": sockets,
            "results": results,
        },
        seconds=time.perf_counter() - began,
    )
    bench_report.add(section)


# -- E: deliveries nobody drains ------------------------------------------------------------
_UNDRAINED_CHILD = """
import json, sys, threading, time
import amqp, psutil, drainer_amqp

mode, queue, host = sys.argv[1], sys.argv[4], sys.argv[5]
count, size = int(sys.argv[2]), int(sys.argv[3])
proc = psutil.Process()
pub = amqp.Connection(host=host)
pub.connect()
pch = pub.channel()
pch.queue_declare(queue, durable=False, auto_delete=False)
if mode == "stock py-amqp":
    cons = amqp.Connection(host=host)
else:
    cons = drainer_amqp.Connection(host=host, dedicated_drainer=(mode == "drainer"))
cons.connect()
cch = cons.channel()
cch.basic_consume(queue, callback=lambda message: None)  # acks on, basic_qos never set
rss0 = proc.memory_info().rss
message = amqp.Message(b"x" * size)
start = time.perf_counter()
for _ in range(count):
    pch.basic_publish(message, exchange="", routing_key=queue)
pch.basic_qos(0, 0, False)  # a round trip: the broker has every message
published = time.perf_counter() - start
last, still, peak = None, time.monotonic(), rss0
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    ready = pch.queue_declare(queue, passive=True).message_count
    peak = max(peak, proc.memory_info().rss)
    if ready != last:
        last, still = ready, time.monotonic()
    elif ready == 0 or time.monotonic() - still >= 2.0:
        break
    threading.Event().wait(0.1)
rss1 = proc.memory_info().rss
stats = cons.drainer_stats() if hasattr(cons, "drainer_stats") else {}
cons.close()  # before the queue goes: stock py-amqp raises on the broker's Basic.Cancel
pch.queue_delete(queue)
pub.close()
print("RESULT " + json.dumps({
    "mode": mode, "count": count, "published_s": published, "ready_left": last,
    "rss_before": rss0, "rss_after": rss1, "rss_peak": peak,
    "pending_callbacks": stats.get("pending_callbacks"),
}), flush=True)
"""


def run_undrained(mode: str) -> dict[str, Any]:
    queue = unique_name("bench-undrained")
    tests_dir = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")])
    )
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                _UNDRAINED_CHILD,
                mode,
                str(UNDRAINED),
                str(UNDRAINED_BODY),
                queue,
                BROKER_HOST,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
    finally:
        cleanup = amqp.Connection(host=BROKER_HOST)
        cleanup.connect()
        try:
            cleanup.channel().queue_delete(queue)  # a no-op when the child deleted it
        finally:
            cleanup.close()
    assert out.returncode == 0, out.stderr
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out.stdout + out.stderr
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def test_undrained_deliveries(bench_report: Collector) -> None:
    began = time.perf_counter()
    results = [run_undrained(mode) for mode in UNDRAINED_MODES]
    growth = {r["mode"]: (r["rss_after"] - r["rss_before"]) for r in results}
    payload = UNDRAINED * UNDRAINED_BODY
    rows = []
    for r in results:
        g = growth[r["mode"]]
        rows.append(
            [
                r["mode"],
                f"{UNDRAINED:,}",
                f"{g / 2**20:.1f} MiB",
                f"{(r['rss_peak'] - r['rss_before']) / 2**20:.1f} MiB",
                f"{100 * g / payload:.0f}%",
                str(r["ready_left"]),
                "-" if r["pending_callbacks"] is None else f"{r['pending_callbacks']:,}",
                ""
                if r["mode"] == "drainer"
                else f"{(growth['drainer'] - g) / 2**20:+.1f} MiB"
                + (f" ({fmt_ratio(ratio(growth['drainer'], g))})" if g >= 2**20 else ""),
            ]
        )
    section = Section(
        key="undrained",
        title="E. Deliveries nobody drains: RSS growth of the consuming process",
        headers=[
            "mode",
            "messages",
            "RSS growth",
            "RSS peak growth",
            "of payload",
            "left in the queue",
            "pending callbacks",
            "drainer growth - this (ratio)",
        ],
        rows=rows,
        notes=[
            f"One child process per mode: a consumer (acks on, no basic_qos: no prefetch "
            f"limit) that never calls drain_events; {UNDRAINED:,} messages of "
            f"{UNDRAINED_BODY} bytes ({payload / 2**20:.0f} MiB of bodies) published to its "
            "queue from a second, stock connection of the same process; RSS measured once "
            "the broker's ready count is zero or has not moved for 2 s.",
            "Stock py-amqp and legacy mode read nothing when nobody drains: the broker stops "
            "at the TCP window (kernel buffers, not RSS) and keeps the rest ('left in the "
            "queue'). The drainer reads everything into its inbox ('pending callbacks', "
            "from drainer_stats()). The last column is the drainer's growth minus this "
            "mode's, with their ratio when this mode grew by 1 MiB or more.",
            f"Measured: {library_version()}. That code caps the drainer's inbox "
            "(Connection kwarg inbox_limit, default 10000 queued callbacks): the drainer "
            "stops reading beyond it, so the rest stays in the broker.",
        ],
        raw={"count": UNDRAINED, "body_bytes": UNDRAINED_BODY, "results": results},
        seconds=time.perf_counter() - began,
    )
    bench_report.add(section)
    assert all(r["count"] == UNDRAINED for r in results)
