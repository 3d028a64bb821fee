"""Bounds: deliveries nobody drains stay bounded (the inbox cap), in drainer mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import amqp
import pytest
from support.broker import unique_name, wait_until

import drainer_amqp
from drainer_amqp.drainer import READ_SIZE

MESSAGES = 400
LIMIT = 50
BODY = 16 * 1024  # one body frame (frame_max is 128 KiB)


def delivery_size(consumer_tag: str, queue: str) -> int:
    """The fewest bytes one delivery of a ``BODY``-byte message takes on the wire: three
    frames of 8 bytes' framing each (type, channel, size, frame-end); Basic.Deliver's
    class and method ids, consumer tag, delivery tag, redelivered bit, exchange ("") and
    routing key; the content header's class id, weight, body size and property flags
    (properties only add to it); the body."""
    deliver = 4 + (1 + len(consumer_tag)) + 8 + 1 + 1 + (1 + len(queue))
    header = 2 + 2 + 8 + 2
    return 3 * 8 + deliver + header + BODY


def inbox_bound(consumer_tag: str, queue: str) -> int:
    """The most deliveries the inbox can hold. The drainer reads only while fewer than
    ``LIMIT`` wait (at most ``LIMIT - 1``), and one read of at most ``READ_SIZE`` bytes
    completes the delivery it began in an earlier read plus the ones wholly inside it."""
    return LIMIT - 1 + 1 + (READ_SIZE - 1) // delivery_size(consumer_tag, queue)


def test_undrained_deliveries_pause_reading_at_the_inbox_limit(
    connect: Callable[..., drainer_amqp.Connection],
) -> None:
    conn = connect("drainer", inbox_limit=LIMIT)
    channel = conn.channel()
    queue = channel.queue_declare(unique_name(), exclusive=True).queue
    publisher = conn.channel()
    publisher.confirm_select()
    for i in range(MESSAGES):
        publisher.basic_publish(amqp.Message(b"x" * BODY, message_id=str(i)), routing_key=queue)
    got: list[Any] = []
    tag = channel.basic_consume(queue, callback=got.append, no_ack=True)  # no prefetch limit
    bound = inbox_bound(tag, queue)
    assert bound < MESSAGES // 2, "the test must be able to tell a bound inbox"
    assert wait_until(lambda: bool(conn.drainer_stats()["reading_paused"]), 10)
    stats = conn.drainer_stats()
    assert LIMIT <= stats["pending_callbacks"] <= bound, (bound, stats)
    # Writes still go out while reading is paused.
    publisher.basic_publish(amqp.Message(b"late"), routing_key=queue)
    while len(got) < MESSAGES + 1:
        conn.drain_events(timeout=10)
        assert conn.drainer_stats()["pending_callbacks"] <= bound
    assert [m.message_id for m in got[:MESSAGES]] == [str(i) for i in range(MESSAGES)]
    assert got[-1].body == b"late"
    assert not conn.drainer_stats()["reading_paused"]


@pytest.mark.parametrize("value", [-1, 1.5, "10"])
def test_a_wrong_inbox_limit_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="inbox_limit"):
        drainer_amqp.Connection(dedicated_drainer=True, inbox_limit=value)


@pytest.mark.parametrize("value", [-1, "10"])
def test_a_wrong_blocked_timeout_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="blocked_timeout"):
        drainer_amqp.Connection(dedicated_drainer=True, blocked_timeout=value)
