"""Drainer mode under an event loop (kombu's Hub, the Celery worker's loop): the loop's
thread reads the socket and runs the deliveries itself, as stock's does, and the drainer
thread reads only while another wait needs it (a reply, the close); a bad frame the
loop reads ends the connection for every waiter, and the loop stops watching the socket.
"""

from __future__ import annotations

import selectors
import threading
import time
from collections.abc import Iterator
from typing import Any

import kombu
import pytest
from kombu.asynchronous import Hub
from support.broker import BROKER_HOST, JOIN, unique_name, wait_until
from support.fake_broker import FakeBroker, fake_broker, frame
from support.publishing import connect

import drainer_amqp
from drainer_amqp import drainer, transport

N = 500  # deliveries
#: Before kombu 5.7 the Hub does not wake for callbacks other threads schedule (Celery's
#: threads pool acks that way), so its thread never reads: the drainer does, as before.
HUB_READS = tuple(kombu.VERSION[:2]) >= (5, 7)


@pytest.fixture
def hub() -> Iterator[Hub]:
    loop = Hub()
    yield loop
    loop.close()


@pytest.fixture
def kombu_conn() -> Iterator[kombu.Connection]:
    conn = kombu.Connection(
        f"amqp://guest:guest@{BROKER_HOST}//",
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": True},
    )
    conn.connect()
    yield conn
    conn.release()


def _dispatching_threads(
    conn: drainer_amqp.Connection, monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """The name of the thread that dispatched each Basic.Deliver frame."""
    seen: list[str] = []
    dispatch = conn.dispatch_frames

    def recorded(frames: list[Any]) -> None:
        deliver = bytes((0, 60, 0, 60))  # Basic.Deliver's class and method ids
        seen.extend(
            threading.current_thread().name
            for f in frames
            if f[0] == 1 and bytes(f[2][:4]) == deliver
        )
        dispatch(frames)

    monkeypatch.setattr(conn, "dispatch_frames", recorded)
    return seen


def _run_until(hub: Hub, done: Any) -> bool:
    deadline = time.monotonic() + JOIN
    while not done():
        if time.monotonic() > deadline:
            return False
        hub.run_once()
    return True


def test_the_loops_thread_reads_and_runs_the_deliveries(
    hub: Hub, kombu_conn: kombu.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(drainer, "DEFER_FOR", 10 * JOIN)  # however slow the machine
    name = unique_name("drainer-loop")
    channel = kombu_conn.channel()
    queue = kombu.Queue(name, channel=channel, auto_delete=False)
    queue.declare()
    try:
        producer = kombu.Producer(kombu_conn.channel())
        for i in range(N):
            producer.publish(str(i), routing_key=name)
        conn = kombu_conn.connection
        dispatchers = _dispatching_threads(conn, monkeypatch)
        kombu_conn.register_with_event_loop(hub)
        assert conn.loop_reads is HUB_READS
        ran_in: list[str] = []

        def on_message(body: Any, message: Any) -> None:
            ran_in.append(threading.current_thread().name)
            message.ack()

        with kombu.Consumer(channel, queues=[queue], callbacks=[on_message], prefetch_count=50):
            assert _run_until(hub, lambda: len(ran_in) == N), f"{len(ran_in)} of {N} delivered"
        assert set(ran_in) == {threading.current_thread().name}
        # The drainer thread reads what comes with a reply it reads (the ConsumeOk), and
        # until its next turn sees nobody waiting: a batch or two of 50 at most.
        mine = dispatchers.count(threading.current_thread().name)
        assert len(dispatchers) == N, set(dispatchers)
        assert (mine > N // 2) is HUB_READS, (mine, set(dispatchers))
        assert (conn.drainer_stats()["loop_reads"] > 0) is HUB_READS
        kombu_conn.transport.unregister_from_event_loop(conn, hub)
        assert not conn.loop_reads
    finally:
        queue.delete()


def test_a_reply_the_loops_thread_waits_for_is_read_by_the_drainer_thread(
    hub: Hub, kombu_conn: kombu.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's thread cannot read while it waits (nor may the main thread read for
    itself): the drainer thread must take the socket back at once, not at its next
    wake-up."""
    monkeypatch.setattr(drainer, "DEFER_FOR", 10 * JOIN)
    monkeypatch.setattr(drainer, "CHECK_CLOSED", 10 * JOIN)  # no other wake-up
    monkeypatch.setattr(transport, "_HUB_WAKES", True)  # nothing here schedules on the Hub
    name = unique_name("drainer-loop")
    channel = kombu_conn.channel()
    queue = kombu.Queue(name, channel=channel, auto_delete=False)
    queue.declare()
    try:
        kombu.Producer(kombu_conn.channel()).publish("first", routing_key=name)
        conn = kombu_conn.connection
        kombu_conn.register_with_event_loop(hub)
        got: list[str] = []
        with kombu.Consumer(channel, queues=[queue], callbacks=[lambda body, _m: got.append(body)]):
            assert _run_until(hub, lambda: got == ["first"]), got
            conn.reader.wake()  # its next turn, with nobody waiting, leaves the socket
            assert wait_until(lambda: conn.reader._deferring, JOIN)  # type: ignore[attr-defined]
            start = time.monotonic()
            _, ready, _ = channel.queue_declare(name, passive=True)  # in the loop's thread
            took = time.monotonic() - start
        assert ready == 0
        assert took < JOIN, f"the reply waited {took:.1f}s for the drainer to read again"
    finally:
        queue.delete()


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    with fake_broker() as fake:
        yield fake


def test_a_bad_frame_the_loop_reads_ends_the_connection(broker: FakeBroker) -> None:
    conn = connect("drainer", host=broker.hostport)
    try:
        inbox = conn.inbox_fileno()
        fd = conn.watch_in_event_loop(True)
        assert fd is not None
        assert wait_until(lambda: conn.reader._deferring, JOIN)  # type: ignore[attr-defined]
        broker.send(frame(1, 0, b"\x00\x0a", end=0x00))  # a bad frame-end byte
        with selectors.DefaultSelector() as loop:
            loop.register(fd, selectors.EVENT_READ)
            assert loop.select(JOIN), "the bad frame never came"
        assert conn.read_in_event_loop() is False  # the loop stops watching the socket
        with selectors.DefaultSelector() as loop:
            loop.register(inbox, selectors.EVENT_READ)
            assert loop.select(JOIN), "the loop was not told of the end"
        with pytest.raises(drainer_amqp.Transport.connection_errors):
            conn.run_pending_callbacks()
        assert isinstance(conn.reason, drainer_amqp.ConnectionLost), conn.reason
    finally:
        conn.collect()
