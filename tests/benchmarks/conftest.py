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
