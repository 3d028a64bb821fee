"""Fixtures and helpers for tests against the real RabbitMQ on 127.0.0.1:5672.

Tests share one broker: every queue name is unique, every declared queue is deleted,
and every connection is closed. Nothing here assumes the broker is otherwise idle.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

import drainer_amqp

__all__ = [
    "BROKER_HOST",
    "JOIN",
    "connect",
    "drainer_threads",
    "queue",
    "run_threads",
    "broker_connection_names",
    "close_broker_connections",
    "no_leaks",
    "sockets_to",
    "thread_stacks",
    "unique_name",
    "wait_until",
]

BROKER_HOST = os.environ.get("AMQP_HOST", "127.0.0.1:5672")
JOIN = 15.0  # seconds: a thread not done by then is a hang


def unique_name(prefix: str = "drainer-test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until true or ``timeout``; for state with no event to wait on
    (another process, the broker). Returns the last result."""
    done = threading.Event()
    deadline = timeout
    while deadline > 0:
        if predicate():
            return True
        done.wait(interval)
        deadline -= interval
    return predicate()


def broker_connection_names(local_port: int) -> list[str]:
    """The broker's ids (Erlang pids) of connections coming from our ``local_port``."""
    out = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "pid", "peer_port"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    names = []
    for line in out.splitlines():
        parts = line.rsplit("\t", 1)
        if len(parts) == 2 and parts[1].strip() == str(local_port):
            names.append(parts[0])
    return names


def close_broker_connections(local_port: int, reason: str = "closed by test") -> int:
    """Close, from the broker's side, every connection from our ``local_port``."""
    names = broker_connection_names(local_port)
    for name in names:
        subprocess.run(
            ["rabbitmqctl", "-q", "close_connection", name, reason],
            capture_output=True,
            timeout=30,
            check=True,
        )
    return len(names)


def drainer_threads() -> list[threading.Thread]:
    """The library's reader threads alive in this process."""
    return [t for t in threading.enumerate() if t.name.startswith("drainer-amqp-")]


def sockets_to(port: int) -> list[Any]:
    """This process's established TCP sockets whose remote port is ``port``."""
    return [
        c
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    ]


def thread_stacks(threads: list[threading.Thread]) -> str:
    """The current stack of each live thread in ``threads``, for a hang report."""
    frames = sys._current_frames()
    return "\n".join(
        f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}"
        for t in threads
        if t.is_alive() and t.ident in frames
    )


@pytest.fixture
def connect() -> Iterator[Callable[..., drainer_amqp.Connection]]:
    """Open connections on demand; close every one at teardown."""
    opened: list[drainer_amqp.Connection] = []

    def _connect(mode: str = "drainer", **kwargs: Any) -> drainer_amqp.Connection:
        kwargs.setdefault("host", BROKER_HOST)
        conn = drainer_amqp.Connection(dedicated_drainer=(mode == "drainer"), **kwargs)
        opened.append(conn)
        conn.connect()
        return conn

    yield _connect
    for conn in opened:
        conn.close()


@pytest.fixture
def queue(connect: Callable[..., drainer_amqp.Connection]) -> Iterator[str]:
    """A unique durable-free queue, deleted at teardown."""
    name = unique_name()
    admin = connect("legacy")
    admin.channel().queue_declare(name, auto_delete=False)
    yield name
    admin.channel().queue_delete(name)


def run_threads(targets: list[Callable[[], object]], name: str) -> list[BaseException | None]:
    """Run each target in its own thread; return each one's exception (or None)."""
    errors: list[BaseException | None] = [None] * len(targets)

    def wrap(i: int, target: Callable[[], object]) -> None:
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[i] = exc

    threads = [
        threading.Thread(target=wrap, args=(i, target), name=f"{name}-{i}")
        for i, target in enumerate(targets)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN)
        assert not t.is_alive(), f"{t.name} hung"
    return errors


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fail the test if it leaves a drainer thread or a socket/file descriptor behind."""
    process = psutil.Process()
    threads_before = set(drainer_threads())
    fds_before = process.num_fds()
    yield
    # Garbage is not a leak: a connection nothing refers to any more (a kombu pool that
    # lost a race in its lazy creation and was replaced) goes with its thread when the
    # collector takes it, as a stock connection goes with its socket.
    gc.collect()
    assert wait_until(lambda: not (set(drainer_threads()) - threads_before), 5), (
        f"drainer threads left: {set(drainer_threads()) - threads_before}"
    )
    assert wait_until(lambda: process.num_fds() <= fds_before, 5), (
        f"file descriptors: {fds_before} before, {process.num_fds()} after"
    )
