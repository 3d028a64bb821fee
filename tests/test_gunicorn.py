"""gunicorn ``gthread`` with ``--preload``: the example app (examples/gunicorn_app.py).

The master connects at import (``PRELOAD_CONNECT=1``), so its drainer thread is running
when it forks the workers. Each worker must then open a working connection of its own,
answer every request, leave the master's connection alone, and exit cleanly on SIGTERM.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import amqp
import pytest
from support.broker import BROKER_HOST, unique_name, wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]
APP = "examples.gunicorn_app:app"
REQUEST_TIMEOUT = 10.0  # seconds: a request not answered by then counts as a hang
START_TIMEOUT = 30.0
STOP_TIMEOUT = 20.0  # gunicorn runs with --graceful-timeout 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _has_control_socket_flag() -> bool:
    """gunicorn >= 25 opens a control socket at a fixed path unless told not to."""
    out = subprocess.run(
        [sys.executable, "-m", "gunicorn", "--help"], capture_output=True, text=True, timeout=30
    ).stdout
    return "--no-control-socket" in out


class Gunicorn:
    """A gunicorn master running the example app, started and stopped by the test.

    It runs in a session of its own, so a test that fails can end the master and its
    workers together (by that process group's id)."""

    _control_flag: bool | None = None

    def __init__(
        self,
        mode: str,
        queue: str,
        *,
        workers: int = 2,
        threads: int = 8,
        preload_connect: bool = True,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        if Gunicorn._control_flag is None:
            Gunicorn._control_flag = _has_control_socket_flag()
        self.port = free_port()
        self.log = tempfile.TemporaryFile(mode="w+")
        cmd = [
            sys.executable, "-m", "gunicorn",
            "-k", "gthread", "--threads", str(threads), "-w", str(workers),
            "--preload", "--graceful-timeout", "10",
            "-b", f"127.0.0.1:{self.port}",
        ]  # fmt: skip
        if Gunicorn._control_flag:
            cmd.append("--no-control-socket")
        cmd.append(APP)
        self.command = cmd
        env = dict(
            os.environ,
            DRAINER_MODE=mode,
            AMQP_URL=f"amqp://guest:guest@{BROKER_HOST}//",
            APP_QUEUE=queue,
            PRELOAD_CONNECT="1" if preload_connect else "0",
            PYTHONUNBUFFERED="1",
            **(extra_env or {}),
        )
        self.process = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def get(self, path: str, timeout: float = REQUEST_TIMEOUT) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def wait_ready(self) -> None:
        def answers() -> bool:
            assert self.process.poll() is None, f"gunicorn exited early:\n{self.output()}"
            try:
                return self.get("/health", timeout=5)[0] == 200
            except OSError:
                return False

        assert wait_until(answers, START_TIMEOUT, interval=0.1), self.output()

    def stop(self) -> float:
        """SIGTERM to the master; return how long it took to exit."""
        start = time.perf_counter()
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(STOP_TIMEOUT)
        return time.perf_counter() - start

    def kill(self) -> None:
        """Last resort for a test that failed: end the master and its workers."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        self.kill()
        self.log.close()


def broker_connections(prefix: str) -> list[str]:
    """Names (``connection_name`` client property) of the broker's connections that
    start with ``prefix``."""
    out = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "client_properties", "--formatter", "json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    names = []
    for row in json.loads(out or "[]"):
        for key, _type, value in row.get("client_properties", []):
            if key == "connection_name" and str(value).startswith(prefix):
                names.append(str(value))
    return sorted(names)


@pytest.fixture
def app_queue() -> Iterator[str]:
    """The queue the app declares and publishes to; deleted at teardown."""
    name = unique_name("gunicorn-app")
    yield name
    conn = amqp.Connection(host=BROKER_HOST)
    conn.connect()
    try:
        channel = conn.channel()
        channel.queue_delete(name)
    finally:
        conn.close()


def message_count(queue: str) -> int:
    conn = amqp.Connection(host=BROKER_HOST)
    conn.connect()
    try:
        return conn.channel().queue_declare(queue, passive=True).message_count
    finally:
        conn.close()


def fire(server: Gunicorn, path: str, total: int, clients: int) -> list[tuple[int, bytes] | str]:
    """``total`` GETs from ``clients`` threads, one HTTP connection per request.
    Each result is ``(status, body)``, or the error's repr if the request failed."""
    results: list[tuple[int, bytes] | str] = []
    lock = threading.Lock()
    remaining = iter(range(total))

    def client() -> None:
        while True:
            with lock:
                if next(remaining, None) is None:
                    return
            try:
                result: tuple[int, bytes] | str = server.get(path)
            except OSError as exc:
                result = repr(exc)
            with lock:
                results.append(result)

    threads = [threading.Thread(target=client, name=f"http-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT * total)
        assert not t.is_alive(), f"{t.name} hung"
    return results


def health_by_pid(server: Gunicorn, workers: int) -> dict[int, dict[str, Any]]:
    """``/health`` of every worker (requests land on any worker: ask until each answered)."""
    seen: dict[int, dict[str, Any]] = {}

    def ask() -> bool:
        status, body = server.get("/health")
        assert status == 200, body
        info = json.loads(body)
        seen[info["pid"]] = info
        return len(seen) == workers

    assert wait_until(ask, START_TIMEOUT, interval=0), f"workers that answered: {sorted(seen)}"
    return seen


def test_preloaded_gthread_workers_each_get_a_working_connection(app_queue: str) -> None:
    workers, requests = 2, 200
    server = Gunicorn("drainer", app_queue, workers=workers)
    try:
        server.wait_ready()
        master_pid = server.process.pid
        health = health_by_pid(server, workers)
        assert master_pid not in health
        for info in health.values():
            # A connection of its own, with its drainer thread and the app's consumer
            # thread; the master's connection, inherited through fork, reads as lost.
            assert info["mode"] == "drainer", info
            assert info["connected"] and info["drainer_running"], info
            assert info["consumer_alive"], info
            assert info["inherited_connected"] is False, info

        results = fire(server, "/publish", total=requests, clients=16)
        failed = [r for r in results if isinstance(r, str) or r[0] != 200]
        assert len(results) == requests and failed == [], failed[:5]
        served_by = Counter(int(r[1].split()[-1]) for r in results if not isinstance(r, str))

        def every_worker_published() -> bool:  # requests land on any worker
            if set(served_by) >= set(health):
                return True
            status, body = server.get("/publish")
            assert status == 200, body
            served_by[int(body.split()[-1])] += 1
            return False

        assert wait_until(every_worker_published, START_TIMEOUT, interval=0), served_by
        assert set(served_by) == set(health), served_by

        # Every publish was confirmed before its request returned.
        assert message_count(app_queue) == sum(served_by.values())
        # One connection per worker, and the master's own survived the forks.
        expected = [f"{app_queue}:preload:{master_pid}"]
        expected += [f"{app_queue}:worker:{pid}" for pid in health]
        assert broker_connections(f"{app_queue}:") == sorted(expected)

        elapsed = server.stop()
        assert server.process.returncode == 0, server.output()
        # Every process closed its connection on the way out.
        assert wait_until(lambda: broker_connections(f"{app_queue}:") == [], 15, interval=0.5)
        output = server.output()
        assert "Traceback" not in output and "[ERROR]" not in output, output
        print(f"gunicorn stopped in {elapsed:.2f}s; requests per worker: {dict(served_by)}")
    finally:
        server.close()
