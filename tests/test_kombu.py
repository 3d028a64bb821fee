"""kombu on ``drainer_amqp:Transport`` with ``dedicated_drainer=True``.

What users rely on: kombu's retry machinery (``Connection.ensure()``, ``autoretry``,
``Producer.publish(retry=True)``, ``ConsumerMixin``, failover URL lists) reconnects
after a real link failure, and never reconnects after a deliberate ``close()``.

Link failures are injected through a Toxiproxy-compatible proxy in front of the broker.
Open links are counted on the client side (this process's established TCP connections
to the proxy's port), which works with a real Toxiproxy too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import amqp
import kombu
import psutil
import pytest
from kombu import Consumer, Producer, Queue
from kombu.mixins import W_CONN_LOST, ConsumerMixin
from support.broker import BROKER_HOST, drainer_threads, unique_name, wait_until
from support.threads import wait_until_blocked
from support.toxiproxy.fixtures import ProxiedBroker
from toxiproxy import Toxiproxy

import drainer_amqp
from drainer_amqp import ConnectionClosedIntentionally, ConnectionLost

WAIT = 15.0  # seconds: upper bound for anything that should happen "soon"
HEARTBEAT = 10
RETRY_POLICY: dict[str, Any] = {
    "max_retries": 3,
    "interval_start": 0.1,
    "interval_step": 0.1,
    "interval_max": 0.5,
}


# -- helpers ----------------------------------------------------------------------------
def drainer_connection(url: str, heartbeat: float = HEARTBEAT, **options: Any) -> kombu.Connection:
    """A kombu connection on our transport, in drainer mode (not connected yet)."""
    return kombu.Connection(
        url,
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": True, **options},
        heartbeat=heartbeat,
    )


def open_links(port: int) -> int:
    """This process's established TCP connections to ``port`` (the proxy)."""
    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def drainer_thread_names() -> set[str]:
    return {t.name for t in drainer_threads()}


class Outcome:
    """Run ``target`` in a named thread; keep what it returned or raised."""

    def __init__(self, target: Callable[[], Any], name: str) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(target,), name=name)
        self.thread.start()

    def _run(self, target: Callable[[], Any]) -> None:
        try:
            self.result = target()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def join(self, timeout: float = WAIT) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.thread.name} still running after {timeout}s"


@pytest.fixture
def admin() -> Iterator[amqp.Connection]:
    """A plain py-amqp connection straight to the broker, to set up and check."""
    conn = amqp.Connection(host=BROKER_HOST, userid="guest", password="guest")
    conn.connect()
    yield conn
    conn.close()


@pytest.fixture
def queue(admin: amqp.Connection) -> Iterator[str]:
    """A unique queue, declared on the broker and deleted at teardown."""
    name = unique_name("kombu-test")
    channel = admin.channel()
    channel.queue_declare(name, auto_delete=False)
    yield name
    channel.queue_delete(name)
    channel.close()


def get_body(admin: amqp.Connection, queue: str, timeout: float = WAIT) -> str | None:
    """The body of the next message in ``queue`` (acked), or None after ``timeout``."""
    channel = admin.channel()
    got: list[Any] = []
    try:

        def poll() -> bool:
            message = channel.basic_get(queue, no_ack=True)
            if message is not None:
                got.append(message)
            return bool(got)

        if not wait_until(poll, timeout):
            return None
        body = got[0].body
        return body.decode() if isinstance(body, bytes) else body
    finally:
        channel.close()


def kombu_queue(name: str) -> Queue:
    """The kombu ``Queue`` matching the ``queue`` fixture's declaration."""
    return Queue(name, durable=False, auto_delete=False)


def message_count(admin: amqp.Connection, queue: str) -> int:
    channel = admin.channel()
    try:
        return channel.queue_declare(queue, passive=True).message_count
    finally:
        channel.close()


def reset_link(proxied: ProxiedBroker, raw: drainer_amqp.Connection) -> None:
    """Kill the open link (the proxy closes it and refuses new ones for a moment) and wait
    until the drainer has seen it, so the next call meets a failed connection."""
    proxied.proxy.disable()
    try:
        assert wait_until(lambda: raw.reason is not None, WAIT), "the drainer did not see the reset"
    finally:
        proxied.proxy.enable()


# -- publishers under test --------------------------------------------------------------
Publish = Callable[[str], None]
PublisherFactory = Callable[[kombu.Connection, str, list[BaseException]], Publish]


def ensure_publisher(conn: kombu.Connection, queue: str, errors: list[BaseException]) -> Publish:
    producer = Producer(conn)
    publish = conn.ensure(
        producer,
        producer.publish,
        errback=lambda exc, _interval: errors.append(exc),
        **RETRY_POLICY,
    )
    return lambda body: publish(body, routing_key=queue)


def autoretry_publisher(conn: kombu.Connection, queue: str, errors: list[BaseException]) -> Publish:
    def send(body: str, channel: Any) -> None:
        Producer(channel).publish(body, routing_key=queue)

    retrying = conn.autoretry(
        send,
        channel=conn.default_channel,
        errback=lambda exc, _interval: errors.append(exc),
        **RETRY_POLICY,
    )
    return lambda body: retrying(body)[0]


def retry_publisher(conn: kombu.Connection, queue: str, errors: list[BaseException]) -> Publish:
    producer = Producer(conn)
    policy = {**RETRY_POLICY, "errback": lambda exc, _interval: errors.append(exc)}
    return lambda body: producer.publish(body, routing_key=queue, retry=True, retry_policy=policy)


PUBLISHERS: dict[str, PublisherFactory] = {
    "ensure": ensure_publisher,
    "autoretry": autoretry_publisher,
    "publish_retry": retry_publisher,
}


# -- retries after a real failure ---------------------------------------------------------
@pytest.mark.parametrize("how", list(PUBLISHERS))
def test_retrying_publish_reconnects_after_the_link_was_reset(
    how: str, proxied_broker: ProxiedBroker, admin: amqp.Connection, queue: str, no_leaks: None
) -> None:
    conn = drainer_connection(proxied_broker.url, confirm_publish=True)
    errors: list[BaseException] = []
    try:
        publish = PUBLISHERS[how](conn, queue, errors)
        publish("before the reset")
        assert get_body(admin, queue) == "before the reset"
        raw = conn.connection
        assert raw.drainer_stats()["running"]

        reset_link(proxied_broker, raw)
        publish("after the reset")

        assert get_body(admin, queue) == "after the reset"
        assert message_count(admin, queue) == 0  # exactly once
        assert conn.connection is not raw  # a new link, with its own drainer
        assert conn.connection.drainer_stats()["running"]
        assert len(errors) == 1 and isinstance(errors[0], ConnectionLost), errors
        assert open_links(proxied_broker.port) == 1
    finally:
        conn.close()


# -- no retry after an intentional close ------------------------------------------------
@pytest.mark.parametrize("closer", ["kombu_close", "amqp_close"])
@pytest.mark.parametrize("how", ["ensure", "publish_retry"])
def test_close_while_a_retrying_publish_waits_for_its_confirm_does_not_reconnect(
    how: str,
    closer: str,
    proxied_broker: ProxiedBroker,
    queue: str,
    no_leaks: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``conn.close()`` (kombu) or ``conn.connection.close()`` (the py-amqp connection)
    from another thread wakes the publisher with ConnectionClosedIntentionally, which
    kombu's retry loop lets through: no reconnection."""
    # Nothing comes back from the broker (not the confirm, not CloseOk): each close
    # waits out its deadline, kept short here.
    monkeypatch.setattr(drainer_amqp.channel, "CLOSE_TIMEOUT", 1.0)
    monkeypatch.setattr(drainer_amqp.connection, "CLOSE_TIMEOUT", 1.0)
    conn = drainer_connection(proxied_broker.url, confirm_publish=True)
    errors: list[BaseException] = []
    try:
        publish = PUBLISHERS[how](conn, queue, errors)
        publish("warm-up")  # channel open and in confirm mode: the next wait is the confirm
        raw = conn.connection
        # The confirm never comes back, so the publisher waits until the close. (A delay
        # raced: kombu's close() closes the channel first, and a delayed ack arrives
        # before that channel's CloseOk.)
        proxied_broker.proxy.add_toxic(
            type="timeout", stream="downstream", attributes={"timeout": 0}, name="silent"
        )
        publisher = Outcome(lambda: publish("never confirmed"), name=f"publisher-{how}")
        assert wait_until(lambda: raw.drainer_stats()["waiting_threads"] >= 1, WAIT)

        if closer == "kombu_close":
            conn.close()
        else:
            raw.close()
        publisher.join()

        assert isinstance(publisher.error, ConnectionClosedIntentionally), publisher.error
        assert errors == []  # kombu never saw a recoverable error
        assert open_links(proxied_broker.port) == 0
        if closer == "kombu_close":
            assert conn._connection is None
        else:
            assert conn._connection is raw
        assert not raw.drainer_stats()["running"]
    finally:
        conn.close()


def test_close_while_an_autoretry_function_drains_does_not_reconnect(
    proxied_broker: ProxiedBroker, queue: str, no_leaks: None
) -> None:
    """``autoretry`` around a function that waits for a delivery: closing the py-amqp
    connection from another thread ends the wait with ConnectionClosedIntentionally."""
    conn = drainer_connection(proxied_broker.url)
    errors: list[BaseException] = []
    received: list[Any] = []

    def receive_one(channel: Any) -> Any:
        with Consumer(
            channel, queues=[kombu_queue(queue)], callbacks=[lambda b, m: received.append(b)]
        ):
            channel.connection.drain_events(timeout=WAIT * 2)
        return received[0]

    try:
        retrying = conn.autoretry(
            receive_one,
            channel=conn.default_channel,
            errback=lambda exc, _interval: errors.append(exc),
            **RETRY_POLICY,
        )
        raw = conn.connection
        receiver = Outcome(retrying, name="autoretry-receiver")
        assert wait_until_blocked(receiver.thread, {"drain_events"}, WAIT)

        raw.close()
        receiver.join()

        assert isinstance(receiver.error, ConnectionClosedIntentionally), receiver.error
        assert errors == [] and received == []
        assert conn._connection is raw
        assert open_links(proxied_broker.port) == 0
    finally:
        conn.close()


@pytest.mark.parametrize("closer", ["kombu_close", "amqp_close"])
@pytest.mark.parametrize("how", list(PUBLISHERS))
def test_a_retrying_publish_after_close_raises_and_does_not_reconnect(
    how: str, closer: str, proxied_broker: ProxiedBroker, queue: str, no_leaks: None
) -> None:
    """A publish that starts after the close (e.g. a shutdown hook closed the connection
    while request threads still publish) fails with ConnectionClosedIntentionally instead
    of opening a new link. (Stock kombu + py-amqp reconnects here.)"""
    conn = drainer_connection(proxied_broker.url, confirm_publish=True)
    errors: list[BaseException] = []
    try:
        publish = PUBLISHERS[how](conn, queue, errors)
        publish("before the close")
        raw = conn.connection
        if closer == "kombu_close":
            conn.close()
        else:
            raw.close()

        with pytest.raises(ConnectionClosedIntentionally):
            publish("after the close")

        assert errors == []
        assert conn._connection is (None if closer == "kombu_close" else raw)
        assert open_links(proxied_broker.port) == 0
    finally:
        conn.close()


# -- ConsumerMixin ----------------------------------------------------------------------
class Worker(ConsumerMixin):
    """Collects message bodies; records each connection it consumed on."""

    def __init__(self, connection: kombu.Connection, queue: str) -> None:
        self.connection = connection
        self.queue = kombu_queue(queue)
        self.cond = threading.Condition()
        self.bodies: list[str] = []
        self.live: list[kombu.Connection] = []  # the clone run() uses, once per (re)connection

    def get_consumers(self, Consumer: Any, channel: Any) -> list[Consumer]:  # noqa: N803
        return [Consumer(queues=[self.queue], callbacks=[self.on_message])]

    def on_consume_ready(self, connection: kombu.Connection, *args: Any, **kwargs: Any) -> None:
        with self.cond:
            self.live.append(connection)
            self.cond.notify_all()

    def on_message(self, body: str, message: Any) -> None:
        message.ack()
        with self.cond:
            self.bodies.append(body)
            self.consumer_channel = message.channel  # for a round trip behind the ack
            self.cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool]) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, WAIT)


def publish_direct(admin: amqp.Connection, queue: str, body: str) -> None:
    channel = admin.channel()
    try:
        channel.basic_publish(amqp.Message(body), routing_key=queue)
    finally:
        channel.close()


def lost_link_warnings(caplog: pytest.LogCaptureFixture) -> list[BaseException]:
    """The errors ConsumerMixin.run() logged as "Connection to broker lost"."""
    return [
        r.exc_info[1]
        for r in list(caplog.records)
        if r.name == "kombu.mixins" and r.msg == W_CONN_LOST and r.exc_info and r.exc_info[1]
    ]


@pytest.mark.parametrize("failure", ["link_closed", "silent_link"])
def test_consumer_mixin_reconnects_after_a_real_failure(
    failure: str,
    proxied_broker: ProxiedBroker,
    admin: amqp.Connection,
    queue: str,
    caplog: pytest.LogCaptureFixture,
    no_leaks: None,
) -> None:
    """``link_closed``: the proxy drops the link. ``silent_link``: nothing comes back from
    the broker any more, and the drainer's heartbeat check fails the link."""
    caplog.set_level(logging.INFO, logger="kombu")
    heartbeat = 1 if failure == "silent_link" else HEARTBEAT
    worker = Worker(drainer_connection(proxied_broker.url, heartbeat=heartbeat), queue)
    runner = Outcome(worker.run, name="consumer-mixin")
    try:
        assert worker.wait_for(lambda: len(worker.live) == 1)
        publish_direct(admin, queue, "one")
        assert worker.wait_for(lambda: worker.bodies == ["one"])
        # A round trip on the consumer's channel: the broker has applied the ack before
        # it, so the link failure below cannot lose the ack (as it may lose one still on
        # the way, and the broker then delivers "one" again: at least once).
        worker.consumer_channel.basic_qos(0, 0, False)
        first = worker.live[0].connection

        if failure == "link_closed":
            reset_link(proxied_broker, first)
            expected: type[BaseException] = ConnectionLost
        else:
            proxied_broker.proxy.add_toxic(
                type="timeout", stream="downstream", attributes={"timeout": 0}, name="silence"
            )
            expected = drainer_amqp.HeartbeatTimeout
            # Removing the toxic closes every link it held, including a reconnection
            # attempt made while the broker still looked silent.
            try:
                assert wait_until(lambda: bool(lost_link_warnings(caplog)), WAIT)
            finally:
                proxied_broker.proxy.destroy_toxic("silence")

        assert worker.wait_for(lambda: len(worker.live) == 2), "run() did not reconnect"
        seen = lost_link_warnings(caplog)
        assert len(seen) == 1 and isinstance(seen[0], expected), seen
        second = worker.live[1].connection
        assert second is not first and second.drainer_stats()["running"]
        publish_direct(admin, queue, "two")
        assert worker.wait_for(lambda: worker.bodies == ["one", "two"]), worker.bodies
        assert runner.thread.is_alive() and runner.error is None
    finally:
        worker.should_stop = True
        runner.join()  # run() notices should_stop within its 1 s drain timeout
    assert runner.error is None


@pytest.mark.parametrize("closer", ["kombu_close", "amqp_close"])
def test_consumer_mixin_ends_promptly_on_close_without_reconnecting(
    closer: str,
    proxied_broker: ProxiedBroker,
    admin: amqp.Connection,
    queue: str,
    caplog: pytest.LogCaptureFixture,
    no_leaks: None,
) -> None:
    """``should_stop = True`` plus closing the connection run() consumes on ends run() at
    once, by raising ConnectionClosedIntentionally (ConsumerMixin only catches
    connection and channel errors), with no reconnection and nothing logged by kombu."""
    worker = Worker(drainer_connection(proxied_broker.url), queue)
    # A long drain timeout: only the close, not the should_stop poll, can end run() soon.
    runner = Outcome(lambda: worker.run(safety_interval=3600), name="consumer-mixin")
    try:
        assert worker.wait_for(lambda: len(worker.live) == 1)
        publish_direct(admin, queue, "one")
        assert worker.wait_for(lambda: worker.bodies == ["one"])
        live = worker.live[0]
        raw = live.connection
        assert wait_until_blocked(runner.thread, {"drain_events"}, WAIT)
        caplog.clear()
        caplog.set_level(logging.INFO)

        worker.should_stop = True
        if closer == "kombu_close":
            live.close()
        else:
            raw.close()
    finally:
        worker.should_stop = True
        if runner.thread.is_alive() and worker.live:
            worker.live[-1].close()  # the test failed early: end run() anyway
        runner.join()

    assert isinstance(runner.error, ConnectionClosedIntentionally), runner.error
    assert len(worker.live) == 1, "run() reconnected after close()"
    assert open_links(proxied_broker.port) == 0
    noisy = [
        r for r in caplog.records if r.name.startswith("kombu") and r.levelno >= logging.WARNING
    ]
    assert noisy == [], [(r.name, r.levelname, r.getMessage()) for r in noisy]
    assert message_count(admin, queue) == 0


# -- failover ---------------------------------------------------------------------------
def test_failover_moves_publishing_and_consuming_to_the_second_url(
    toxiproxy: Toxiproxy,
    proxied_broker: ProxiedBroker,
    queue: str,
    no_leaks: None,
) -> None:
    second = toxiproxy.create(
        upstream="127.0.0.1:5672", name=unique_name("amqp_failover"), listen="127.0.0.1:0"
    )
    try:
        port1, port2 = proxied_broker.port, int(second.listen.rpartition(":")[2])
        conn = kombu.Connection(
            f"drainer-amqp://guest:guest@127.0.0.1:{port1}//;"
            f"drainer-amqp://guest:guest@127.0.0.1:{port2}//",
            failover_strategy="round-robin",
            transport_options={"dedicated_drainer": True, "confirm_publish": True},
            heartbeat=HEARTBEAT,
        )
        try:
            _check_failover(conn, proxied_broker, queue, port1, port2)
        finally:
            conn.close()
    finally:
        second.destroy()


def _check_failover(
    conn: kombu.Connection, first: ProxiedBroker, queue: str, port1: int, port2: int
) -> None:
    conn.ensure_connection(max_retries=1)
    raw1 = conn.connection
    assert isinstance(raw1, drainer_amqp.Connection) and raw1.host == f"127.0.0.1:{port1}"
    assert f"drainer-amqp-127.0.0.1:{port1}" in drainer_thread_names()
    errors: list[BaseException] = []
    producer = Producer(conn)
    policy = {**RETRY_POLICY, "errback": lambda exc, _interval: errors.append(exc)}
    producer.publish("via the first", routing_key=queue, retry=True, retry_policy=policy)

    first.proxy.disable()  # stays disabled: the first URL is gone for good
    assert wait_until(lambda: raw1.reason is not None, WAIT)
    producer.publish("via the second", routing_key=queue, retry=True, retry_policy=policy)

    raw2 = conn.connection
    assert isinstance(raw2, drainer_amqp.Connection) and raw2.host == f"127.0.0.1:{port2}"
    assert conn.port == port2
    assert isinstance(errors[0], ConnectionLost), errors
    # kombu 5.3 retries the first URL once (refused) before it moves to the second.
    refused = errors[1:] if kombu.VERSION < (5, 7) else []
    assert len(errors) == 1 + len(refused), errors
    assert all(isinstance(e, ConnectionRefusedError) for e in refused), errors
    assert wait_until(lambda: f"drainer-amqp-127.0.0.1:{port1}" not in drainer_thread_names(), WAIT)
    assert f"drainer-amqp-127.0.0.1:{port2}" in drainer_thread_names()
    assert open_links(port1) == 0 and open_links(port2) == 1

    # Consuming on the same kombu connection now goes through the second URL too.
    received: list[str] = []

    def on_message(body: str, message: Any) -> None:
        received.append(body)
        message.ack()

    with Consumer(conn, queues=[kombu_queue(queue)], callbacks=[on_message]):
        for _ in range(10):  # bounded: each call handles one delivery or times out
            if len(received) == 2:
                break
            conn.drain_events(timeout=WAIT)
    assert received == ["via the first", "via the second"]
    assert conn.connection is raw2


def test_a_connection_used_while_another_thread_releases_it_does_not_reconnect(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    """kombu's ``release()`` in one thread (its close handshake under way) while another
    thread calls kombu's ``drain_events()``: kombu's lazy ``connection`` there must not
    open a new connection, which nobody would close (its thread and socket leaked). The
    call raises ConnectionClosedIntentionally. Forced: the close waits for the test
    once its Connection.Close is written."""
    conn = drainer_connection(f"amqp://guest:guest@{BROKER_HOST}//")
    raw = conn.connection
    closing, go = threading.Event(), threading.Event()
    finish_close = raw._finish_close

    def paused(*args: Any) -> None:
        closing.set()
        assert go.wait(WAIT)
        finish_close(*args)

    monkeypatch.setattr(raw, "_finish_close", paused)
    releaser = threading.Thread(target=conn.release, name="releaser", daemon=True)
    releaser.start()
    try:
        assert closing.wait(WAIT)
        with pytest.raises(ConnectionClosedIntentionally):
            conn.drain_events(timeout=0.1)
        assert conn._connection is raw
    finally:
        go.set()
        releaser.join(WAIT)
    assert not releaser.is_alive()
    assert conn._connection is None
