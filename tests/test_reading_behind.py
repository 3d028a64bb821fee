"""Drainer mode reads deliveries a batch at a time: while the consumer has deliveries
queued and nobody waits for anything else, the drainer leaves the socket unread (for at
most ``drainer.DEFER_FOR``) and reads what came meanwhile once the consumer has caught
up. What must not wait behind a consumer's backlog: a reply, a confirm, the close, and
the consumer's own next deliveries once it has caught up. Each of those tests stretches
``DEFER_FOR`` to a minute, so a missed wake-up shows as a call that takes a minute, not
as a few milliseconds lost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from amqp import Message
from support.broker import JOIN, unique_name, wait_until
from support.publishing import connect

import drainer_amqp
from drainer_amqp import ConnectionClosedIntentionally, drainer

BACKLOG = 20  # deliveries left queued for a consumer that does not drain yet
PROMPT = 2.0  # seconds a call may take that must not wait for the deferral


@pytest.fixture
def long_deferral(monkeypatch: pytest.MonkeyPatch) -> None:
    """The drainer would leave the socket unread for a minute, and an idle one looks at
    its socket once a minute: only the wake-ups under test end a deferral sooner."""
    monkeypatch.setattr(drainer, "DEFER_FOR", 60.0)
    monkeypatch.setattr(drainer, "CHECK_CLOSED", 60.0)


@pytest.fixture
def queue() -> Iterator[str]:
    name = unique_name("drainer-behind")
    conn = connect("drainer")
    try:
        conn.channel().queue_declare(name, auto_delete=False)
        yield name
        conn.channel().queue_delete(name)
    finally:
        conn.close()


def publish(queue: str, count: int, prefix: bytes = b"m") -> None:
    """``count`` messages, from a connection of their own."""
    conn = connect("drainer")
    try:
        channel = conn.channel()
        for i in range(count):
            channel.basic_publish(Message(b"%s-%d" % (prefix, i)), routing_key=queue)
    finally:
        conn.close()


def with_backlog(queue: str) -> tuple[drainer_amqp.Connection, list[bytes]]:
    """A drainer connection whose consumer has deliveries queued, undrained (the first
    ones of ``BACKLOG``; the rest may wait in the socket): from here on the drainer
    leaves the socket unread."""
    conn = connect("drainer")
    received: list[bytes] = []
    channel = conn.channel()
    channel.basic_consume(queue, callback=lambda m: received.append(m.body), no_ack=True)
    publish(queue, BACKLOG)
    assert wait_until(lambda: len(conn.inbox) > 0, JOIN)
    return conn, received


def timed(call: Callable[[], object]) -> float:
    begun = time.monotonic()
    call()
    return time.monotonic() - begun


@pytest.mark.usefixtures("long_deferral")
@pytest.mark.parametrize("thread", ["main", "other"])
def test_a_reply_does_not_wait_behind_a_consumers_backlog(queue: str, thread: str) -> None:
    """The main thread leaves the reading to the drainer; another thread may read its
    reply itself (borrowing) while the drainer leaves the socket unread."""
    conn, _ = with_backlog(queue)
    try:
        other = unique_name("drainer-behind-other")

        def declare() -> None:  # two replies: Channel.OpenOk, Queue.DeclareOk
            conn.channel().queue_declare(other, exclusive=True)

        if thread == "main":
            took = timed(declare)
        else:
            times: list[float] = []
            worker = threading.Thread(target=lambda: times.append(timed(declare)))
            worker.start()
            worker.join(JOIN * 5)
            assert times, "queue_declare did not return"
            took = times[0]
        assert took < PROMPT, f"queue_declare took {took:.1f} s behind the backlog"
        assert len(conn.inbox), "the backlog was drained: nothing was tested"
    finally:
        conn.close()


@pytest.mark.usefixtures("long_deferral")
@pytest.mark.parametrize("how", ["deferred", "sync"])
def test_a_confirm_does_not_wait_behind_a_consumers_backlog(queue: str, how: str) -> None:
    conn, _ = with_backlog(queue)
    try:

        def confirmed() -> None:  # with Channel.OpenOk and Confirm.SelectOk first
            channel = conn.channel()
            channel.confirm_select()
            if how == "deferred":
                future = channel.basic_publish_deferred(Message(b"c"), routing_key=queue)
                assert future.result(JOIN * 5) is True
            else:
                channel.basic_publish_confirm(Message(b"c"), routing_key=queue)

        took = timed(confirmed)
        assert took < PROMPT, f"the confirm took {took:.1f} s behind the backlog"
        assert len(conn.inbox), "the backlog was drained: nothing was tested"
    finally:
        conn.close()


@pytest.mark.usefixtures("long_deferral")
def test_close_does_not_wait_behind_a_consumers_backlog(queue: str) -> None:
    conn, _ = with_backlog(queue)
    took = timed(conn.close)
    assert took < PROMPT, f"close() took {took:.1f} s behind the backlog"
    with pytest.raises(ConnectionClosedIntentionally):
        conn.channel()


@pytest.mark.usefixtures("long_deferral")
def test_a_consumer_that_caught_up_gets_its_next_deliveries_at_once(queue: str) -> None:
    conn, received = with_backlog(queue)
    try:
        while len(received) < BACKLOG:
            conn.drain_events(timeout=JOIN)
        publish(queue, 5, b"next")
        begun = time.monotonic()
        while len(received) < BACKLOG + 5:
            conn.drain_events(timeout=JOIN * 5)
        took = time.monotonic() - begun
        assert took < PROMPT, f"the next deliveries took {took:.1f} s"
        assert received[BACKLOG:] == [b"next-%d" % i for i in range(5)]
    finally:
        conn.close()


def test_a_consumer_acking_each_delivery_is_read_a_batch_at_a_time(queue: str) -> None:
    """Each ack lets the broker send one more delivery: read as they come, that is a
    read and a hand-over per delivery or two; read once the consumer has caught up, one
    per batch."""
    count = 2_000
    publish(queue, count)
    conn = connect("drainer")
    try:
        channel = conn.channel()
        channel.basic_qos(0, 500, False)
        received: list[bytes] = []

        def on_message(message: Message) -> None:
            channel.basic_ack(message.delivery_tag)
            received.append(message.body)

        channel.basic_consume(queue, callback=on_message)
        reads_before = conn.drainer_stats()["reads"]
        while len(received) < count:
            conn.drain_events(timeout=JOIN)
        reads = conn.drainer_stats()["reads"] - reads_before
        assert sorted(received) == sorted(b"m-%d" % i for i in range(count))
        assert reads <= count // 50, f"{reads} reads for {count} deliveries"
    finally:
        conn.close()
