"""Many threads, one kombu connection, repeated faults: kombu's own retry paths.

A failure stays a failure for every thread that used the failed connection (kombu's
``collect()`` after an error must not turn it into ``ConnectionClosedIntentionally``),
concurrent reconnects converge on one live connection, and after ``release()`` nothing
is left running.
"""

from __future__ import annotations

import random
import socket
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import kombu
import pytest
from support.broker import (
    JOIN,
    drainer_threads,
    sockets_to,
    thread_stacks,
    unique_name,
    wait_until,
)

import drainer_amqp
from drainer_amqp import ConnectionClosedIntentionally
from drainer_amqp import transport as drainer_transport

THREADS = 8
FAULTS = 6
RETRY_POLICY = {
    "max_retries": 30,
    "interval_start": 0.05,
    "interval_step": 0.1,
    "interval_max": 0.5,
}


Publish = Callable[[str], None]


class Publishers:
    """``THREADS`` publisher threads, each publishing numbered bodies with the function
    ``make(n)`` gives it until stopped; what they confirmed and what they raised."""

    def __init__(self, make: Callable[[int], Publish]) -> None:
        self.confirmed: list[str] = []
        self.raised: Counter[str] = Counter()
        self.first: dict[str, str] = {}  # the first traceback of each type raised
        self._lock = threading.Lock()  # guards confirmed, raised and first
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(make, n), name=f"publisher-{n}")
            for n in range(THREADS)
        ]

    def _run(self, make: Callable[[int], Publish], n: int) -> None:
        publish = make(n)
        i = 0
        while not self._stop.is_set():
            body = f"{n}-{i}"
            i += 1
            try:
                publish(body)
            except Exception as exc:  # noqa: BLE001 - counted by type, asserted below
                with self._lock:
                    kind = type(exc).__name__
                    if not self.raised[kind]:
                        self.first[kind] = "".join(traceback.format_exception(exc))
                    self.raised[kind] += 1
                continue
            with self._lock:
                self.confirmed.append(body)

    def __enter__(self) -> Publishers:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(JOIN)
        if exc_type is None:  # else the failure in the block is the one to report
            assert not any(t.is_alive() for t in self._threads), (
                f"a publisher hung: {thread_stacks(self._threads)}"
            )

    def progressed(self) -> bool:
        """Whether 20 more publishes were confirmed within 30 s."""
        start = len(self.confirmed)
        return wait_until(lambda: len(self.confirmed) > start + 20, 30)

    def why_not(self) -> str:
        return f"raised so far: {self.raised} {self.first}"


def _assert_every_confirmed_message_arrived(queue: str, confirmed: list[str]) -> None:
    """Every confirmed body is in ``queue`` (more may be: at-least-once); deletes it."""
    with kombu.Connection("amqp://guest:guest@127.0.0.1:5672//") as direct:
        channel = direct.channel()
        got: set[str] = set()
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            body = message.body.decode() if isinstance(message.body, bytes) else message.body
            got.add(body.strip('"'))
        channel.queue_delete(queue)
    lost = set(confirmed) - got
    assert not lost, f"{len(lost)} confirmed messages lost, e.g. {sorted(lost)[:5]}"


def _assert_released(conn: kombu.Connection, drainers_before: set[Any], ports: list[int]) -> None:
    """After ``release()``, no drainer thread and no socket to the broker remain."""
    conn.release()
    assert wait_until(lambda: not (set(drainer_threads()) - drainers_before), 5), (
        f"drainer threads left after release(): {set(drainer_threads()) - drainers_before}"
    )
    assert wait_until(lambda: not any(sockets_to(port) for port in ports), 5), (
        f"sockets to the broker left after release(): {[sockets_to(p) for p in ports]}"
    )


@pytest.mark.parametrize("api", ["publish_retry", "ensure", "autoretry"])
def test_eight_threads_one_connection_repeated_resets(proxied_broker: Any, api: str) -> None:
    queue = kombu.Queue(unique_name(), auto_delete=False)
    conn = kombu.Connection(
        proxied_broker.url,
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": True, "confirm_publish": True},
    )
    drainers_before = set(drainer_threads())
    queue.bind(conn.default_channel).declare()

    def make(n: int) -> Publish:
        # A producer on a channel of its own, for autoretry; the others use the default
        # channel, where kombu's retry revives them (see the failover test below).
        producer = kombu.Producer(conn.channel() if api == "autoretry" else conn)
        if api == "ensure":
            ensured = conn.ensure(producer, producer.publish, **RETRY_POLICY)
            return lambda body: ensured(body, routing_key=queue.name)
        if api == "autoretry":

            def send(body: str, routing_key: str, channel: Any = None) -> None:
                kombu.Producer(channel).publish(body, routing_key=routing_key)

            # autoretry hands the function a revived channel after each reconnect.
            retried = conn.autoretry(send, channel=producer.channel, **RETRY_POLICY)
            return lambda body: retried(body, routing_key=queue.name)
        return lambda body: producer.publish(
            body, routing_key=queue.name, retry=True, retry_policy=RETRY_POLICY
        )

    rng = random.Random(11)
    with Publishers(make) as publishers:
        for i in range(FAULTS):
            assert publishers.progressed(), f"no progress; {publishers.why_not()}"
            if i % 2:
                proxied_broker.proxy.disable()
                threading.Event().wait(rng.uniform(0.05, 0.3))
                proxied_broker.proxy.enable()
            else:
                proxied_broker.proxy.add_toxic(
                    name="reset", type="reset_peer", attributes={"timeout": 0}
                )
                threading.Event().wait(0.05)
                proxied_broker.proxy.destroy_toxic("reset")
        assert publishers.progressed(), f"no progress; {publishers.why_not()}"
    assert "ConnectionClosedIntentionally" not in publishers.raised, publishers.raised
    _assert_every_confirmed_message_arrived(queue.name, publishers.confirmed)
    _assert_released(conn, drainers_before, [proxied_broker.port])


def test_release_is_intentional_for_every_thread(proxied_broker: Any) -> None:
    """After the user's release(), threads still on the connection are told it was closed
    on purpose, so kombu does not reconnect for them."""
    conn = kombu.Connection(
        proxied_broker.url,
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": True},
    )
    channel = conn.channel()
    name = channel.queue_declare(queue="", exclusive=True).queue
    channel.basic_consume(name, callback=lambda m: None)
    outcome: list[BaseException] = []

    def drain() -> None:
        try:
            conn.connection.drain_events(timeout=30)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome.append(exc)

    t = threading.Thread(target=drain, name="drainer-user")
    t.start()
    assert wait_until(lambda: conn.connection.drainer_stats()["running"], 5)
    conn.release()
    t.join(JOIN)
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ConnectionClosedIntentionally), outcome


def test_failover_to_the_next_url_keeps_every_thread_retrying(toxiproxy: Any) -> None:
    """kombu's failover (``Connection.switch()``) closes the failed connection; threads
    still on it must get a recoverable error and follow to the next URL, not be told the
    connection was closed on purpose."""
    proxies = [
        toxiproxy.create(
            upstream="127.0.0.1:5672", name=unique_name("failover"), listen="127.0.0.1:0"
        )
        for _ in range(2)
    ]
    ports = [int(p.listen.rsplit(":", 1)[1]) for p in proxies]
    # The scheme names the transport: kombu's switch() takes it from the next URL.
    urls = ";".join(f"drainer-amqp://guest:guest@127.0.0.1:{port}//" for port in ports)
    queue = kombu.Queue(unique_name(), auto_delete=False)
    conn = kombu.Connection(
        urls,
        transport_options={"dedicated_drainer": True, "confirm_publish": True},
    )
    drainers_before = set(drainer_threads())
    queue.bind(conn.default_channel).declare()

    def make(n: int) -> Publish:
        # kombu's retry revives a producer on the connection's default channel; one made
        # on a channel of its own loses it to another thread's collect() (channel.connection
        # becomes None and Producer.connection raises AttributeError), as with stock kombu.
        producer = kombu.Producer(conn)
        return lambda body: producer.publish(
            body, routing_key=queue.name, retry=True, retry_policy=RETRY_POLICY
        )

    with Publishers(make) as publishers:
        assert publishers.progressed(), f"no progress; {publishers.why_not()}"
        for down, up in ((0, 1), (1, 0)):
            proxies[up].enable()
            proxies[down].disable()  # closes the live link and refuses new ones
            assert publishers.progressed(), (
                f"no progress after losing {ports[down]}; {publishers.why_not()}"
            )
    assert "ConnectionClosedIntentionally" not in publishers.raised, publishers.raised
    _assert_every_confirmed_message_arrived(queue.name, publishers.confirmed)
    _assert_released(conn, drainers_before, ports)


def test_a_reconnect_racing_another_threads_collect_is_recoverable() -> None:
    """Thread A is inside kombu's reconnect with ``conn.transport`` when thread B's
    ``ensure()`` calls ``conn.collect()``, which detaches that transport. A's reconnect
    raises an error kombu's retry loop retries (with a fresh transport), not an
    AttributeError that reaches the caller."""
    conn = kombu.Connection(
        "amqp://guest:guest@127.0.0.1:5672//",
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": True},
    )
    try:
        conn.ensure_connection(max_retries=3)
        transport = conn.transport  # thread A, inside kombu's _establish_connection
        conn.collect()  # thread B
        with pytest.raises(tuple(conn.recoverable_connection_errors)):
            transport.establish_connection()
        conn.ensure_connection(max_retries=3)  # kombu's retry: a fresh transport connects
        assert conn.connected
    finally:
        conn.release()


def test_a_failover_after_a_failed_reconnect_leaves_another_threads_new_connection() -> None:
    """Thread B's reconnect to the first URL fails; before kombu's failover ``switch()``
    runs in B, thread A (also failing over) connects to the second URL and opens the
    default channel. B's ``switch()`` then closes "the connection" and its default
    channel: both are A's live ones. They must stay open, and B must end up on them."""
    refusing = socket.socket()  # bound, never listening: connections are refused
    refusing.bind(("127.0.0.1", 0))
    dead_port = refusing.getsockname()[1]
    conn = kombu.Connection(
        f"drainer-amqp://guest:guest@127.0.0.1:{dead_port}//;"
        "drainer-amqp://guest:guest@127.0.0.1:5672//",
        transport_options={"dedicated_drainer": True},
    )
    drainers_before = set(drainer_threads())
    b_failed, b_may_switch = threading.Event(), threading.Event()
    b_errors: list[BaseException] = []

    def hold(exc: BaseException, interval: float) -> None:  # kombu calls it before switch()
        b_failed.set()
        b_may_switch.wait(JOIN)

    def thread_b() -> None:
        try:
            conn.ensure_connection(errback=hold, max_retries=4, interval_start=0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            b_errors.append(exc)

    b = threading.Thread(target=thread_b, name="failover-b")
    b.start()
    try:
        assert b_failed.wait(JOIN), "thread B's first reconnect did not fail"
        conn.ensure_connection(max_retries=4, interval_start=0)  # thread A
        live = conn.connection
        channel: Any = conn.default_channel
        b_may_switch.set()
        b.join(JOIN)
        assert not b.is_alive(), "thread B hung"
        assert not b_errors, b_errors
        assert live.reason is None, f"B's failover closed A's connection: {live.reason!r}"
        assert channel.is_open, "B's failover closed A's default channel"
        assert conn.connection is live, "B opened a second connection"
        queue = kombu.Queue(unique_name(), auto_delete=False, channel=channel)
        queue.declare()
        try:
            kombu.Producer(channel).publish("after the failover", routing_key=queue.name)
            assert queue.get(no_ack=True).body == "after the failover"
        finally:
            queue.delete()
    finally:
        b_may_switch.set()
        b.join(JOIN)
        conn.release()
        refusing.close()
    assert wait_until(lambda: not set(drainer_threads()) - drainers_before, JOIN)


def test_collect_while_handling_an_error_of_the_live_connection_is_not_intentional() -> None:
    """kombu's ``ensure()`` collects the connection while it handles a recoverable error
    of that connection (a closed channel, a timeout). The other threads on it must see a
    recoverable failure and retry, not ``ConnectionClosedIntentionally``; a collect with
    no error in hand (a pool's teardown) stays intentional."""
    conn = kombu.Connection(
        "drainer-amqp://guest:guest@127.0.0.1:5672//",
        transport_options={"dedicated_drainer": True},
    )
    try:
        conn.ensure_connection(max_retries=3)
        first = conn.connection
        try:
            raise TimeoutError("a wait on the live connection timed out")
        except TimeoutError:
            conn.collect()  # as kombu's ensure() does
        assert isinstance(first.reason, tuple(conn.recoverable_connection_errors))
        assert not isinstance(first.reason, ConnectionClosedIntentionally)
        conn.ensure_connection(max_retries=3)
        second = conn.connection
        assert second is not first
        conn.collect()
        assert isinstance(second.reason, ConnectionClosedIntentionally)
    finally:
        conn.release()


def test_a_reconnect_waiting_for_another_threads_reconnect_survives_a_collect() -> None:
    """Thread A's reconnect waits for thread B's (they take turns); meanwhile thread C's
    ``ensure()`` calls ``collect()``, which detaches A's transport. A then gets B's live
    connection or an error kombu retries, never an AttributeError from the detached
    transport."""
    conn = kombu.Connection(
        "amqp://guest:guest@127.0.0.1:5672//",
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": True},
    )
    outcome: list[object] = []

    def reconnect_a() -> None:
        try:
            outcome.append(transport.establish_connection())
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome.append(exc)

    try:
        conn.ensure_connection(max_retries=3)
        transport = conn.transport
        turns = drainer_transport._reconnect_locks[conn]
        waiting = drainer_transport.Transport.establish_connection.__code__
        with turns:  # thread B is reconnecting
            a = threading.Thread(target=reconnect_a, name="reconnect-a")
            a.start()
            assert wait_until(
                lambda: getattr(sys._current_frames().get(a.ident or 0), "f_code", None) is waiting,
                JOIN,
            ), "thread A does not wait for B's turn"
            conn.collect()  # thread C
        a.join(JOIN)
        assert not a.is_alive(), "thread A hung"
        got = outcome[0]
        if isinstance(got, drainer_amqp.Connection):
            got.close()
        else:
            assert isinstance(got, tuple(conn.recoverable_connection_errors)), repr(got)
    finally:
        conn.release()


def test_a_reconnect_keeps_its_kombu_connection_when_a_collect_detaches_it_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kombu's ``establish_connection`` copies ``transport.client`` onto the new
    connection when the connect is done; another thread's ``collect()`` may have cleared
    it meanwhile. Consumers and producers find their kombu connection through
    ``channel.connection.client`` (``Consumer.__exit__`` raised AttributeError in the
    cluster failover test), so the new connection keeps the kombu connection."""
    from kombu.transport import pyamqp

    connect = pyamqp.Transport.establish_connection

    def detached_meanwhile(transport: Any) -> Any:
        connection = connect(transport)
        connection.client = None  # what kombu copies after a collect() detached it
        return connection

    monkeypatch.setattr(pyamqp.Transport, "establish_connection", detached_meanwhile)
    conn = kombu.Connection(
        "drainer-amqp://guest:guest@127.0.0.1:5672//",
        transport_options={"dedicated_drainer": True},
    )
    try:
        conn.ensure_connection(max_retries=3)
        assert conn.connection.client is conn
        with kombu.Consumer(conn.channel(), queues=[]) as consumer:
            assert consumer.connection is conn
    finally:
        conn.release()


def test_a_failover_for_a_stale_publish_error_leaves_the_new_connection() -> None:
    """Thread A's publish fails on the first connection; thread B has reconnected and
    consumes on the new one when A's ``ensure()`` runs kombu's failover ``switch()``,
    which closes "the connection" and its default channel: B's. They must stay open for
    B, and A's retry must publish on them. A failover while kombu handles an error of the
    live connection itself (a timeout) ends that connection as failed: B gets a
    recoverable error and retries, not ``ConnectionClosedIntentionally``."""
    url = "drainer-amqp://guest:guest@127.0.0.1:5672//"
    conn = kombu.Connection(f"{url};{url}", transport_options={"dedicated_drainer": True})
    name = unique_name()
    drainers_before = set(drainer_threads())
    received: list[str] = []
    ended: list[BaseException] = []
    try:
        conn.ensure_connection(max_retries=3)
        old = conn.connection
        producer = kombu.Producer(old.channel(), routing_key=name)  # thread A's
        b_producer = kombu.Producer(old.channel(), routing_key=name)
        old.transport.sock.shutdown(socket.SHUT_RDWR)  # the first link fails
        assert wait_until(lambda: old.reason is not None, JOIN)

        # Thread B's publish fails first: its ensure() reconnects (a failover too).
        conn.ensure(b_producer, b_producer.publish, max_retries=3, interval_start=0)(
            "B's, before its queue"
        )
        new = conn.connection
        assert new is not old
        channel: Any = conn.default_channel
        channel.queue_declare(name, auto_delete=False)
        channel.basic_consume(name, no_ack=True, callback=lambda m: received.append(m.body))

        def consume() -> None:  # thread B
            try:
                while True:
                    new.drain_events(timeout=JOIN)
            except BaseException as exc:  # noqa: BLE001 - asserted below
                ended.append(exc)

        b = threading.Thread(target=consume, name="failover-consumer")
        b.start()

        # Thread A (here): its publish raises the first connection's error, and kombu's
        # ensure() switches to the next URL, reconnects and publishes again.
        conn.ensure(producer, producer.publish, max_retries=3, interval_start=0)(
            "after the failover"
        )
        assert wait_until(lambda: received == ["after the failover"] or bool(ended), JOIN)
        assert not ended, f"A's failover ended B's connection: {ended!r}"
        assert new.reason is None and channel.is_open
        assert conn.connection is new, "A opened another connection"

        timed_out = iter([True])

        def publish_or_time_out(body: str) -> None:  # a timeout on the live connection
            if next(timed_out, False):
                raise TimeoutError("a wait on the live connection timed out")
            producer.publish(body)

        conn.ensure(producer, publish_or_time_out, max_retries=3, interval_start=0)(
            "after the second failover"
        )
        b.join(JOIN)
        assert not b.is_alive(), "B still waits on the connection A's failover ended"
        assert len(ended) == 1 and isinstance(ended[0], drainer_amqp.ConnectionLost), ended
        assert conn.connection is not new
    finally:
        conn.release()
        with kombu.Connection(url) as other, other.channel() as cleanup:
            cleanup.queue_delete(name)
    assert received == ["after the failover"]
    assert wait_until(lambda: not set(drainer_threads()) - drainers_before, JOIN)
