"""Benchmark-only fixtures: quick/full mode, the session's results collector, and the
test proxy in a child process.

``DRAINER_BENCH_QUICK=1`` selects quick mode (CI): fewer messages and rounds, the same
hard checks. At the end of the session the collector writes ``bench-results/``
(see :mod:`benchmarks.report`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import amqp
import pytest
from support.broker import BROKER_HOST

from benchmarks import QUICK
from benchmarks.report import Collector


@pytest.fixture(scope="session")
def bench_quick() -> bool:
    """True in quick mode (``DRAINER_BENCH_QUICK=1``)."""
    return QUICK


@pytest.fixture(scope="session")
def bench_report() -> Iterator[Collector]:
    """Where each benchmark adds its section; the report is written at session end."""
    collector = Collector(quick=QUICK)
    yield collector
    try:
        conn = amqp.Connection(host=BROKER_HOST)
        conn.connect()
        try:
            version = conn.server_properties.get("version")
            collector.broker_version = (
                version.decode() if isinstance(version, bytes) else str(version)
            )
        finally:
            conn.close()
    except (OSError, amqp.AMQPError):
        collector.broker_version = None
    out = collector.write()
    if out is not None:
        print(f"\nbenchmark report written to {out / 'report.md'}", flush=True)


_SERVE_PROXY = """
import sys
from support.toxiproxy.server import ToxiproxyServer
server = ToxiproxyServer("127.0.0.1", 0).start()
print(server.url, flush=True)
sys.stdin.read()  # until the parent closes our stdin
server.stop()
"""


@pytest.fixture(scope="session")
def toxiproxy_url() -> Iterator[str]:
    """Overrides the suite's fixture: the built-in Toxiproxy-compatible server runs in a
    child process, as a real Toxiproxy would, so its pump threads do not share the
    benchmark's GIL (they would add their own delays to every proxied measurement).
    ``TOXIPROXY_URL`` still selects an external Toxiproxy."""
    external = os.environ.get("TOXIPROXY_URL")
    if external:
        yield external.rstrip("/")
        return
    tests_dir = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")])
    )
    child = subprocess.Popen(
        [sys.executable, "-c", _SERVE_PROXY],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdin is not None and child.stdout is not None
    stdout = child.stdout
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(30)
    try:
        assert line and line[0].startswith("http://"), f"proxy server did not start: {line}"
        yield line[0].strip()
    finally:
        child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)
        child.stdout.close()


# -- progress: what runs now, how long it usually takes, how long is left -------------------
#: Usual seconds of each benchmark in full mode on the project's 2-core machine (quick mode:
#: about a fifth), by file and test name; an unknown one counts 30 s.
USUAL = {
    "bench_celery.py::test_celery_worker": 51,
    "bench_clients.py::test_client_throughput": 76,
    "bench_clients.py::test_close_while_publishing": 21,
    "bench_clients.py::test_one_thread_call_cost": 16,
    "bench_clients.py::test_link_failure_loss": 7,
    "bench_confirms.py::test_confirmed_publishing": 41,
    "bench_consume.py::test_consume": 27,
    "bench_cost.py::test_cost_per_message": 44,
    "bench_failover.py::test_failover_time": 146,
    "bench_gunicorn.py::test_gunicorn_gthread_against_other_clients": 67,
    "bench_quorum.py::test_quorum_confirms": 70,
    "bench_recovery_latency.py::test_error_propagation_reset_peer": 3,
    "bench_resources.py::test_idle_connections": 2,
    "bench_resources.py::test_undrained_deliveries": 14,
    "bench_rtt.py::test_one_millisecond_away": 72,
    "bench_throughput.py::test_publish_throughput": 29,
    "test_drainer_benchmarks.py::test_publish_latency_beside_stuck_consumer": 32,
    "test_drainer_fragmentation.py::test_fragmented_large_message": 18,
    "test_drainer_shutdown.py::test_close_with_busy_threads": 10,
    "test_heartbeat_publish_only.py::test_publish_only_connection_survives_idle": 12,
}
_progress: dict[str, float] = {}  # the usual seconds of each benchmark not started yet
_started: dict[str, tuple[float, float]] = {}  # the running one: its start, its usual time


def _usual(nodeid: str) -> float:
    name = nodeid.rpartition("/")[2].partition("[")[0]
    return USUAL.get(name, 30) / (5 if QUICK else 1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _progress.clear()
    _progress.update({item.nodeid: _usual(item.nodeid) for item in items})


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    usual = _progress.pop(nodeid, _usual(nodeid))
    left = usual + sum(_progress.values())
    _started[nodeid] = (time.monotonic(), usual)
    print(
        f"\n== {nodeid.rpartition('/')[2]}: usually {usual:.0f} s; about {left / 60:.1f} min "
        "of benchmarks left",
        flush=True,
    )


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    began, usual = _started.pop(nodeid, (time.monotonic(), 0.0))
    took = time.monotonic() - began
    if usual and took > 2 * usual + 10:
        print(
            f"== {nodeid.rpartition('/')[2]} took {took:.0f} s, usually {usual:.0f} s", flush=True
        )
