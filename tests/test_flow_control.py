"""Publishing while the broker blocks the connection (a memory alarm), both modes.

The alarm is raised on a node of our own (``own_broker``) with
``rabbitmqctl set_vm_memory_high_watermark 0.0001`` and always restored. RabbitMQ blocks
a connection only once it publishes during the alarm: the first publish is written and
the broker answers ``Connection.Blocked``. What users rely on after that:

* a publish waits at most ``min(timeout, blocked_timeout)``, then raises
  :class:`drainer_amqp.ConnectionBlocked`, a recoverable error;
* ``on_blocked`` / ``on_unblocked`` run in the thread that calls ``drain_events()``;
* ``close()`` while blocked returns within its deadline and wakes a waiting publish;
* once the alarm clears, publishing works again on the same connection.

The measured waits and close times are printed (``-s``), not asserted beyond hard bounds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import amqp
import pytest
from amqp.exceptions import RecoverableConnectionError
from kombu.transport import pyamqp
from support.broker import JOIN, unique_name, wait_until
from support.rabbit_nodes import RabbitNode
from support.threads import Drain, wait_until_blocked

import drainer_amqp
from drainer_amqp import ConnectionBlocked, ConnectionClosedIntentionally
from drainer_amqp.channel import CLOSE_TIMEOUT

MODES = ["drainer", "legacy"]
WAIT = 30.0  # seconds for the broker to raise or clear its alarm
SLACK = 5.0  # seconds of scheduling noise allowed on top of a documented bound


@contextmanager
def memory_alarm(node: RabbitNode) -> Iterator[None]:
    """Raise the node's memory alarm; restore its watermark afterwards, also on failure."""
    before = float(node.ctl("eval", "vm_memory_monitor:get_vm_memory_high_watermark().").strip())
    node.set_vm_memory_high_watermark(0.0001)
    try:
        assert wait_until(lambda: "memory" in node.ctl("eval", "rabbit_alarm:get_alarms()."), WAIT)
        yield
    finally:
        node.set_vm_memory_high_watermark(before)


class Client:
    """A connection to ``node`` with a drain thread (``flow-drain``) that runs its
    callbacks, and a record of which thread ran ``on_blocked`` / ``on_unblocked``."""

    def __init__(self, node: RabbitNode, mode: str, blocked_timeout: float) -> None:
        self.events: list[tuple[str, str]] = []  # (event, thread name)
        self.cond = threading.Condition()  # guards events
        self.conn = drainer_amqp.Connection(
            host=f"127.0.0.1:{node.port}",
            dedicated_drainer=(mode == "drainer"),
            blocked_timeout=blocked_timeout,
            on_blocked=lambda reason: self._event("blocked"),
            on_unblocked=lambda: self._event("unblocked"),
        )
        self.conn.connect()
        self.queue = unique_name("drainer-flow")
        self.channel = self.conn.channel()
        self.channel.queue_declare(self.queue, auto_delete=False)
        self.confirming = self.conn.channel()
        self.confirming.confirm_select()
        self.drain = Drain(self.conn, timeout=0.2, name="flow-drain").start()

    def _event(self, name: str) -> None:
        with self.cond:
            self.events.append((name, threading.current_thread().name))
            self.cond.notify_all()

    def wait_event(self, name: str) -> list[str]:
        """Wait until ``name`` happened; return the threads it ran in."""
        with self.cond:
            self.cond.wait_for(lambda: any(e == name for e, _ in self.events), WAIT)
            return [thread for e, thread in self.events if e == name]

    def publish(self, body: str, timeout: float | None = None) -> None:
        self.channel.basic_publish(amqp.Message(body), routing_key=self.queue, timeout=timeout)

    def set_off_block(self) -> int:
        """Publish during the alarm until the broker blocks us; return how many of these
        publishes were written (the broker's alarm reaches the connection a moment after
        ``rabbitmqctl`` returns, so the first ones may go through)."""
        written = 0
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            try:
                self.publish("sets off the block", timeout=0.5)
                written += 1
            except ConnectionBlocked:
                pass  # the notice came in just before this publish
            with self.cond:
                if self.cond.wait_for(lambda: any(e == "blocked" for e, _ in self.events), 0.5):
                    return written
        raise AssertionError(f"the broker did not block the connection within {WAIT:g}s")

    def close(self) -> None:
        try:
            self.conn.close()
        finally:
            self.drain.stop()

    def delete_queue(self, node: RabbitNode) -> None:
        with drainer_amqp.Connection(host=f"127.0.0.1:{node.port}") as admin:
            admin.channel().queue_delete(self.queue)


@pytest.fixture
def clients(own_broker: RabbitNode) -> Iterator[list[Client]]:
    """Clients opened by a test; closed, and their queues deleted, at teardown."""
    opened: list[Client] = []
    yield opened
    for client in opened:
        client.close()  # fails if the drain thread hangs
        client.delete_queue(own_broker)


def _timed_publish(client: Client, timeout: float | None) -> tuple[BaseException | None, float]:
    start = time.monotonic()
    try:
        client.publish("while blocked", timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.parametrize("mode", MODES)
def test_a_blocked_publish_waits_at_most_its_timeout_and_publishing_resumes(
    mode: str, own_broker: RabbitNode, clients: list[Client]
) -> None:
    blocked_timeout = 1.0
    client = Client(own_broker, mode, blocked_timeout)
    clients.append(client)
    client.publish("before the alarm")
    with memory_alarm(own_broker):
        written = client.set_off_block()
        assert client.wait_event("blocked") == ["flow-drain"], client.events

        for timeout, limit in ((None, blocked_timeout), (0.3, 0.3)):
            error, took = _timed_publish(client, timeout)
            print(f"\n{mode}: publish(timeout={timeout}) while blocked raised after {took:.3f}s")
            assert isinstance(error, ConnectionBlocked), error
            assert took <= limit + SLACK
            # recoverable: kombu's retry policy applies to it, with a fresh connection
            assert isinstance(error, RecoverableConnectionError)
            assert isinstance(error, pyamqp.Transport.recoverable_connection_errors)
    assert client.wait_event("unblocked") == ["flow-drain"], client.events

    # The same connection publishes again, and the broker confirms it.
    start = time.monotonic()
    client.confirming.basic_publish_confirm(
        amqp.Message("after the alarm"), routing_key=client.queue, confirm_timeout=WAIT
    )
    print(f"{mode}: confirmed publish after the alarm took {time.monotonic() - start:.3f}s")
    assert client.drain.error is None
    _, count, _ = client.channel.queue_declare(client.queue, passive=True)
    assert count == 2 + written  # none of those refused while blocked


@pytest.mark.parametrize("mode", MODES)
def test_close_while_blocked_returns_within_its_deadline_and_wakes_the_publisher(
    mode: str, own_broker: RabbitNode, clients: list[Client]
) -> None:
    client = Client(own_broker, mode, blocked_timeout=120.0)  # only close() can end its wait
    clients.append(client)
    client.publish("before the alarm")
    outcome: list[BaseException | None] = []
    with memory_alarm(own_broker):
        client.set_off_block()
        assert client.wait_event("blocked") == ["flow-drain"], client.events
        publisher = threading.Thread(
            target=lambda: outcome.append(_timed_publish(client, None)[0]),
            name="flow-blocked-publisher",
        )
        publisher.start()
        assert wait_until_blocked(publisher, {"wait_unblocked"}, WAIT)

        start = time.monotonic()
        client.conn.close()
        took = time.monotonic() - start
        publisher.join(JOIN)
        print(f"\n{mode}: close() while blocked took {took:.3f}s (deadline {CLOSE_TIMEOUT:g}s)")
        assert took <= CLOSE_TIMEOUT + SLACK
        assert not publisher.is_alive(), "the blocked publish did not wake on close()"
        assert len(outcome) == 1 and isinstance(outcome[0], ConnectionClosedIntentionally), outcome
        client.drain.thread.join(JOIN)
        assert not client.drain.thread.is_alive()
        assert isinstance(client.drain.error, ConnectionClosedIntentionally), client.drain.error


def test_stock_py_amqp_baseline_a_confirmed_publish_on_a_blocked_connection(
    own_broker: RabbitNode,
) -> None:
    """Baseline, not drainer-amqp: stock py-amqp writes the publish and waits for the
    confirm the blocked broker does not send, until its own ``confirm_timeout``. Bounded
    by that timeout and a thread join, so it cannot hang the test. (A publish the broker
    handled before its alarm reached the connection is confirmed: publish until one
    waits, at most ``WAIT`` seconds.)"""
    conn = amqp.Connection(host=f"127.0.0.1:{own_broker.port}", confirm_publish=True)
    conn.connect()
    queue = unique_name("drainer-flow-stock")
    outcome: list[Any] = []
    try:
        channel = conn.channel()
        channel.queue_declare(queue, auto_delete=False)
        channel.basic_publish(amqp.Message("before the alarm"), routing_key=queue)
        with memory_alarm(own_broker):

            def publish() -> None:
                deadline = time.monotonic() + WAIT
                while time.monotonic() < deadline:
                    start = time.monotonic()
                    try:
                        channel.basic_publish(
                            amqp.Message("while blocked"), routing_key=queue, confirm_timeout=3.0
                        )
                    except Exception as exc:  # noqa: BLE001 - reported
                        outcome.append((type(exc).__name__, time.monotonic() - start))
                        return

            thread = threading.Thread(target=publish, name="flow-stock-publisher")
            thread.start()
            thread.join(WAIT + JOIN)
            assert not thread.is_alive(), "stock publish did not end by its confirm_timeout"
        print(f"\nstock py-amqp confirmed publish while blocked: {outcome}")
        assert outcome and outcome[0][0] == "TimeoutError", outcome
    finally:
        try:
            conn.channel().queue_delete(queue)
        finally:
            conn.close()
