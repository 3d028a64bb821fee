"""Threads that publish unique bodies, and the scenarios that check by identity what a
publish that returned promised (tests/test_promises.py, benchmark A.5).

Every body is unique (``b"<thread>-<n>"``, padded), so the queue's contents say which
returned publish was lost."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import amqp
from amqp import Message

import drainer_amqp

from .broker import BROKER_HOST, JOIN, wait_until
from .relays import RECV_SIZE, relay

__all__ = ["LinkLoss", "Publishers", "connect", "lose_the_link_while_publishing", "queue_bodies"]


def connect(mode: str, host: str = BROKER_HOST, **options: Any) -> drainer_amqp.Connection:
    """A connected connection in ``mode``: "drainer", "legacy", or "stock" (py-amqp's
    own, for comparison: its callers must take turns)."""
    if mode == "stock":
        conn = amqp.Connection(host=host, **options)
    else:
        conn = drainer_amqp.Connection(host=host, dedicated_drainer=mode == "drainer", **options)
    conn.connect()
    return conn


def queue_bodies(name: str) -> list[bytes]:
    """Every message body in queue ``name``, taken (no_ack) by a consumer on a stock
    py-amqp connection: once the queue is empty the consumer is cancelled, and the
    broker sends the cancel's reply after every delivery it made to it."""
    conn = connect("stock")
    try:
        channel = conn.channel()
        bodies: list[bytes] = []
        tag = channel.basic_consume(name, no_ack=True, callback=lambda m: bodies.append(m.body))
        deadline = time.monotonic() + JOIN
        while channel.queue_declare(name, passive=True).message_count:
            assert time.monotonic() < deadline, f"{name}: not emptied within {JOIN} s"
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.05)
        channel.basic_cancel(tag)
        return bodies
    finally:
        conn.close()


class Publishers:
    """``n`` threads publishing unique bodies until told to stop or the connection ends.

    ``returned[i]`` holds the bodies whose publish returned OK in thread ``i``;
    ``started`` is set once every thread has published at least once."""

    def __init__(self, n: int, publish: Callable[[int, bytes], object]) -> None:
        self.returned: list[list[bytes]] = [[] for _ in range(n)]
        self.longest = [0.0] * n
        self.errors: list[BaseException | None] = [None] * n
        self.stop = threading.Event()
        self._publish = publish
        self._ready = threading.Barrier(n + 1)
        self.threads = [
            threading.Thread(target=self._run, args=(i,), name=f"publisher-{i}", daemon=True)
            for i in range(n)
        ]

    def __enter__(self) -> Publishers:
        for thread in self.threads:
            thread.start()
        self._ready.wait(JOIN)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(JOIN)
            assert not thread.is_alive(), f"{thread.name} hung"

    def _run(self, i: int) -> None:
        mine = self.returned[i]
        n = 0
        try:
            while not self.stop.is_set():
                body = b"%d-%d" % (i, n)
                start = time.perf_counter()
                self._publish(i, body)
                self.longest[i] = max(self.longest[i], time.perf_counter() - start)
                mine.append(body)
                if n == 0:
                    self._ready.wait(JOIN)
                n += 1
        except BaseException as exc:  # noqa: BLE001 - a closed connection ends the loop
            self.errors[i] = exc
            if n == 0:
                self._ready.abort()

    def wait_for(self, count: int) -> None:
        """Until every thread has published ``count`` messages."""
        assert wait_until(lambda: min(map(len, self.returned)) >= count, JOIN), self.counts()

    def counts(self) -> list[int]:
        return [len(r) for r in self.returned]

    def all_returned(self) -> set[bytes]:
        return {body for bodies in self.returned for body in bodies}


def stalled(publishers: Publishers) -> Callable[[], bool]:
    """A condition: no publish has returned since the last time it was asked."""
    last = [-1]

    def check() -> bool:
        now = sum(publishers.counts())
        same, last[0] = now == last[0], now
        return same

    return check


@dataclass
class LinkLoss:
    """What :func:`lose_the_link_while_publishing` saw."""

    mode: str
    returned: int = 0  #: publishes that returned OK
    lost: int = 0  #: of those, not in the queue afterwards
    held: int = 0  #: bytes the kernel's buffers on the way could hold
    body_size: int = 0
    strangers: int = 0  #: bodies in the queue that no thread published
    errors: list[BaseException | None] = field(default_factory=list)


def lose_the_link_while_publishing(
    mode: str, queue: str, threads: int, body_size: int = 1024, buffer: int = 32 * 1024
) -> LinkLoss:
    """``threads`` threads publish ``body_size``-byte bodies to ``queue`` (empty) through
    a relay; the relay stops reading, and once no publish returns any more the link dies.

    The kernel's buffers on the way are made small (``buffer``), so what a client held
    back beyond them would show: ``held`` is the client's send buffer, the relay's
    receive buffer and the relay's one read. ``mode``: as :func:`connect`; "stock"
    callers take turns under a lock."""
    with relay(client_rcvbuf=buffer) as link:
        conn = connect(mode, host=f"127.0.0.1:{link.port}")
        sock = conn.transport.sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
        try:
            channels = [conn.channel() for _ in range(threads)]
            turns = threading.Lock() if mode == "stock" else contextlib.nullcontext()

            def publish(i: int, body: bytes) -> None:
                with turns:
                    channels[i].basic_publish(
                        Message(body.ljust(body_size, b".")), routing_key=queue
                    )

            with Publishers(threads, publish) as publishers:
                publishers.wait_for(50)
                link.forwarding.clear()
                assert wait_until(stalled(publishers), JOIN, 0.2), "publishing never stalled"
                held = (
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                    + link.client_socket.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
                    + RECV_SIZE
                )
                link.close()  # the link dies with the client's bytes in its buffers
                assert wait_until(lambda: all(publishers.errors), JOIN), publishers.errors
        finally:
            conn.collect()
    returned = {body.ljust(body_size, b".") for body in publishers.all_returned()}
    in_queue = set(queue_bodies(queue))
    published = {
        (b"%d-%d" % (i, n)).ljust(body_size, b".")
        for i, count in enumerate(publishers.counts())
        for n in range(count + 1)
    }
    return LinkLoss(
        mode=mode,
        returned=len(returned),
        lost=len(returned - in_queue),
        held=held,
        body_size=body_size,
        strangers=len(in_queue - published),
        errors=publishers.errors,
    )
