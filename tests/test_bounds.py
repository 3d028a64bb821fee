"""Bounds: deliveries nobody drains stay bounded (the inbox cap), in drainer mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import amqp
import pytest
from support.broker import unique_name, wait_until

import drainer_amqp
from drainer_amqp.drainer import READ_SIZE

MESSAGES = 2000
LIMIT = 50
#: The cap is checked between socket reads: one read (READ_SIZE bytes) of 1-KiB bodies
#: may complete this many more deliveries.
SLACK = READ_SIZE // 1024


def test_undrained_deliveries_pause_reading_at_the_inbox_limit(
    connect: Callable[..., drainer_amqp.Connection],
) -> None:
    conn = connect("drainer", inbox_limit=LIMIT)
    channel = conn.channel()
    queue = channel.queue_declare(unique_name(), exclusive=True).queue
    publisher = conn.channel()
    publisher.confirm_select()
    for i in range(MESSAGES):
        publisher.basic_publish(amqp.Message(b"x" * 1024, message_id=str(i)), routing_key=queue)
    got: list[Any] = []
    channel.basic_consume(queue, callback=got.append, no_ack=True)  # no prefetch limit
    assert wait_until(lambda: bool(conn.drainer_stats()["reading_paused"]), 10)
    stats = conn.drainer_stats()
    assert LIMIT <= stats["pending_callbacks"] <= LIMIT + SLACK, stats
    # Writes still go out while reading is paused.
    publisher.basic_publish(amqp.Message(b"late"), routing_key=queue)
    while len(got) < MESSAGES + 1:
        conn.drain_events(timeout=10)
        assert conn.drainer_stats()["pending_callbacks"] <= LIMIT + SLACK
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
