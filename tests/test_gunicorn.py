"""gunicorn ``gthread`` with ``--preload``: the example app (examples/gunicorn_app.py).

The master connects at import (``PRELOAD_CONNECT=1``), so its drainer thread is running
when it forks the workers. Each worker must then open a working connection of its own,
answer every request, leave the master's connection alone, and exit cleanly on SIGTERM.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator

import amqp
import pytest
from support.broker import BROKER_HOST, unique_name, wait_until
from support.gunicorn import REQUEST_TIMEOUT, START_TIMEOUT, Gunicorn, health_by_pid


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
