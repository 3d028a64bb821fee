"""The connection contract, against the real broker, in both modes where it applies."""

from __future__ import annotations

import gc
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable

import amqp
import kombu
import pytest
from amqp.exceptions import NotFound
from kombu.transport import pyamqp
from support.broker import (
    BROKER_HOST,
    JOIN,
    broker_connection_names,
    close_broker_connections,
    drainer_threads,
    run_threads,
    unique_name,
    wait_until,
)
from support.fake_broker import fake_broker, frame
from support.threads import drain_in_background, wait_until_blocked

import drainer_amqp
from drainer_amqp import ConnectionClosedIntentionally, ConnectionLost
from drainer_amqp.channel import CLOSE_TIMEOUT
from drainer_amqp.connection import DRAINER_HEARTBEAT

MODES = ["legacy", "drainer"]


def count_messages(conn: amqp.Connection, queue: str) -> int:
    return conn.channel().queue_declare(queue, passive=True).message_count


# -- options and lifecycle --------------------------------------------------------------


def test_dedicated_drainer_defaults_to_false_and_must_be_a_bool() -> None:
    assert drainer_amqp.Connection(host=BROKER_HOST).dedicated_drainer is False
    with pytest.raises(TypeError, match="dedicated_drainer must be True or False"):
        drainer_amqp.Connection(host=BROKER_HOST, dedicated_drainer="yes")  # type: ignore[arg-type]
    kconn = kombu.Connection(
        f"amqp://guest:guest@{BROKER_HOST}//",
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": 1},
    )
    with pytest.raises(TypeError):
        kconn.connect()
    kconn.release()


def test_public_names() -> None:
    assert issubclass(drainer_amqp.Connection, amqp.Connection)
    assert issubclass(drainer_amqp.Transport, pyamqp.Transport)
    assert issubclass(drainer_amqp.SSLTransport, pyamqp.SSLTransport) or issubclass(
        drainer_amqp.SSLTransport, drainer_amqp.Transport
    )
    assert drainer_amqp.Transport.Connection is drainer_amqp.Connection
    transport = drainer_amqp.Transport
    for errors in (
        transport.connection_errors,
        transport.recoverable_connection_errors,
        transport.channel_errors,
        transport.recoverable_channel_errors,
    ):
        assert not issubclass(ConnectionClosedIntentionally, errors)
    assert issubclass(ConnectionLost, transport.recoverable_connection_errors)


def test_drainer_starts_with_the_socket_and_kombu_connects_lazily(no_leaks: None) -> None:
    before = set(drainer_threads())
    with kombu.Connection(
        f"amqp://guest:guest@{BROKER_HOST}//",
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": True},
    ) as kconn:
        producer = kconn.Producer()  # no socket yet: kombu connects on first use
        assert set(drainer_threads()) == before
        producer.publish(b"x", routing_key=unique_name("nowhere"))
        started = set(drainer_threads()) - before
        assert [t.name for t in started] == [f"drainer-amqp-{kconn.connection.host}"]
        assert isinstance(kconn.connection, drainer_amqp.Connection)
        assert kconn.connection.drainer_stats()["running"] is True


def test_kombu_url_scheme_alias_selects_the_transport() -> None:
    kconn = kombu.Connection(f"drainer-amqp://guest:guest@{BROKER_HOST}//")
    assert kconn.transport_cls == "drainer-amqp"
    assert isinstance(kconn.transport, drainer_amqp.Transport)
    kconn.release()


# -- publishing and waiting -----------------------------------------------------------------


def test_publish_never_waits_for_a_read_in_drainer_mode(connect, queue) -> None:
    """While one thread sits in drain_events(), others publish and get their confirms:
    they finish while that very drain_events call is still blocked."""
    conn = connect("drainer")
    idle = conn.channel()
    idle_queue = idle.queue_declare("", exclusive=True).queue
    idle.basic_consume(idle_queue, callback=lambda m: None)
    drain_returned = threading.Event()

    def stuck_consumer() -> None:
        try:
            conn.drain_events(timeout=30)
        except BaseException:  # noqa: BLE001 - ends when the connection closes
            pass
        drain_returned.set()

    consumer = threading.Thread(target=stuck_consumer, name="stuck-consumer")
    consumer.start()
    assert wait_until_blocked(consumer, {"drain_events"}), "drain_events() did not block"

    def publisher() -> None:
        channel = conn.channel()
        channel.confirm_select()
        for i in range(20):
            channel.basic_publish_confirm(amqp.Message(str(i)), routing_key=queue)
        channel.close()

    assert run_threads([publisher] * 10, "publisher") == [None] * 10
    assert not drain_returned.is_set(), "publishers should not have needed the reader"
    assert wait_until(lambda: count_messages(conn, queue) == 200, 10)
    conn.close()
    consumer.join(JOIN)
    assert drain_returned.is_set()


@pytest.mark.parametrize("mode", MODES)
def test_many_threads_publish_while_another_drains(connect, queue, mode: str) -> None:
    conn = connect(mode)
    idle = conn.channel()
    idle.basic_consume(idle.queue_declare("", exclusive=True).queue, callback=lambda m: None)

    def publisher() -> None:
        channel = conn.channel()
        for i in range(3):  # legacy: each publish may wait for one read timeout
            channel.basic_publish(amqp.Message(str(i)), routing_key=queue)

    with drain_in_background(conn, timeout=1, name="consumer"):
        assert run_threads([publisher] * 8, "publisher") == [None] * 8
        assert wait_until(lambda: count_messages(conn, queue) == 24, 10)


@pytest.mark.parametrize("mode", MODES)
def test_synchronous_methods_from_20_threads_at_once(connect, mode: str) -> None:
    conn = connect(mode)
    barrier = threading.Barrier(20, timeout=JOIN)

    def worker() -> None:
        barrier.wait()
        channel = conn.channel()
        name = unique_name()
        ok = channel.queue_declare(name, auto_delete=False)
        assert ok.queue == name
        channel.basic_qos(0, 5, False)
        channel.confirm_select()
        channel.basic_publish_confirm(amqp.Message(name), routing_key=name)
        message = channel.basic_get(name, no_ack=True)
        assert message is not None and message.body == name
        assert channel.queue_delete(name) == 0
        channel.close()

    # A reader beside them: in legacy mode it reads other threads' replies, which must
    # still reach them (the wait is registered before the request is written).
    with drain_in_background(conn, timeout=0.05, name="reader"):
        assert run_threads([worker] * 20, "sync") == [None] * 20


def test_confirms_on_one_shared_channel_are_matched_by_delivery_tag(connect, queue) -> None:
    conn = connect("drainer")
    channel = conn.channel()
    channel.confirm_select()

    def publisher() -> None:
        for i in range(25):
            channel.basic_publish_confirm(amqp.Message(str(i)), routing_key=queue)

    assert run_threads([publisher] * 8, "shared") == [None] * 8
    assert len(channel.confirms) == 0
    assert conn.drainer_stats()["waiting_threads"] == 0
    assert wait_until(lambda: count_messages(conn, queue) == 200, 10)


@pytest.mark.parametrize("mode", MODES)
def test_drain_events_times_out_like_py_amqp(connect, mode: str) -> None:
    conn = connect(mode)
    with pytest.raises(socket.timeout):
        conn.drain_events(timeout=0.2)
    with pytest.raises(socket.timeout):
        conn.drain_events(timeout=0)


def test_callbacks_run_in_the_draining_thread_in_delivery_order(connect, queue) -> None:
    conn = connect("drainer")
    channel = conn.channel()
    seen: list[tuple[str, str]] = []

    def on_message(message: amqp.Message) -> None:
        seen.append((message.body, threading.current_thread().name))

    channel.basic_consume(queue, no_ack=True, callback=on_message)
    publisher = conn.channel()
    publisher.confirm_select()
    for i in range(100):
        publisher.basic_publish_confirm(amqp.Message(f"{i:03}"), routing_key=queue)
    results: list[str] = []

    def drain() -> None:
        while len(seen) < 100:
            conn.drain_events(timeout=5)
        results.extend(body for body, _ in seen)

    assert run_threads([drain], "drain-thread") == [None]
    assert results == [f"{i:03}" for i in range(100)]
    assert {name for _, name in seen} == {"drain-thread-0"}


def test_returned_message_reaches_the_draining_thread(connect) -> None:
    conn = connect("drainer")
    channel = conn.channel()
    returned: list[tuple[str, str]] = []
    channel.events["basic_return"].add(
        lambda exc, exchange, routing_key, message: returned.append(
            (routing_key, threading.current_thread().name)
        )
    )
    key = unique_name("unroutable")
    channel.basic_publish(amqp.Message(b"x"), routing_key=key, mandatory=True)
    conn.drain_events(timeout=5)
    assert returned == [(key, threading.current_thread().name)]


@pytest.mark.parametrize("mode", MODES)
def test_channel_error_is_raised_in_the_caller_and_the_channel_is_reopened(
    connect, queue, mode: str
) -> None:
    conn = connect(mode)
    channel = conn.channel()
    with pytest.raises(NotFound):
        channel.queue_declare(unique_name("missing"), passive=True)
    assert channel.queue_declare(queue, passive=True).queue == queue
    assert conn.connected


# -- heartbeats and broker-side close ---------------------------------------------------------


def test_heartbeats_keep_an_idle_publish_only_connection_alive(connect, queue) -> None:
    conn = connect("drainer", heartbeat=1)
    channel = conn.channel()
    channel.confirm_select()
    port = conn.sock.getsockname()[1]
    # Idle for 4 heartbeat intervals: idleness is what is being tested.
    threading.Event().wait(4)
    stats = conn.drainer_stats()
    assert stats["heartbeats_sent"] >= 4
    assert stats["heartbeats_received"] >= 2
    assert broker_connection_names(port), "the broker dropped the idle connection"
    channel.basic_publish_confirm(amqp.Message(b"after idle"), routing_key=queue)
    assert wait_until(lambda: count_messages(conn, queue) == 1, 5)


@pytest.mark.parametrize(
    ("mode", "asked", "negotiated"),
    [
        ("drainer", None, DRAINER_HEARTBEAT),  # nothing asked: the broker's suggestion
        ("drainer", 0, DRAINER_HEARTBEAT),  # kombu's default
        ("drainer", False, 0),  # turned off
        ("drainer", 7, 7),
        ("legacy", None, 0),  # stock's default
    ],
)
def test_a_drainer_connection_has_heartbeats_unless_turned_off(
    mode: str, asked: int | bool | None, negotiated: int
) -> None:
    options = {} if asked is None else {"heartbeat": asked}
    conn = drainer_amqp.Connection(host=BROKER_HOST, dedicated_drainer=mode == "drainer", **options)
    conn.connect()
    try:
        assert conn.heartbeat == negotiated
    finally:
        conn.close()
    with kombu.Connection(
        f"amqp://guest:guest@{BROKER_HOST}//",
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": mode == "drainer"},
        **options,
    ) as kconn:
        assert kconn.connection.heartbeat == negotiated


def test_broker_side_close_is_noticed_at_once(connect, queue) -> None:
    conn = connect("drainer")
    channel = conn.channel()
    port = conn.sock.getsockname()[1]
    woke: list[BaseException] = []

    def waiter() -> None:
        try:
            conn.drain_events(timeout=60)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            woke.append(exc)

    thread = threading.Thread(target=waiter, name="waiter")
    thread.start()
    assert wait_until_blocked(thread, {"drain_events"}), "drain_events() did not block"
    assert close_broker_connections(port, "test: broker-side close") == 1
    thread.join(JOIN)
    assert not thread.is_alive()
    recoverable = drainer_amqp.Transport.recoverable_connection_errors
    assert len(woke) == 1 and isinstance(woke[0], recoverable), woke
    assert "broker-side close" in str(woke[0])
    assert not conn.connected  # noticed without any publish
    assert not conn.drainer_stats()["running"]
    with pytest.raises(recoverable):
        channel.basic_publish(amqp.Message(b"x"), routing_key=queue)


def test_legacy_broker_close_while_a_publisher_waits_for_the_reader(connect, queue) -> None:
    """Legacy mode: thread R is blocked reading (it holds the transport lock) and thread
    P's publish waits for that lock to write. The broker closes the connection: R reads
    Connection.Close and py-amqp writes CloseOk from R. That reply must not wait for P's
    write, which waits for R: both threads get the broker's error."""
    conn = connect("legacy")
    channel = conn.channel()
    port = conn.sock.getsockname()[1]
    errors: dict[str, BaseException] = {}

    def record(name: str, call: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            try:
                call()
            except BaseException as exc:  # noqa: BLE001 - asserted below
                errors[name] = exc

        return run

    reader = threading.Thread(
        target=record("reader", lambda: conn.drain_events(timeout=60)), name="reader"
    )
    reader.start()
    assert wait_until(lambda: conn.reader.reading, JOIN), "the reader did not start reading"
    publish = record("publisher", lambda: channel.basic_publish(amqp.Message(b"x"), "", queue))
    publisher = threading.Thread(target=publish, name="publisher")
    publisher.start()
    assert conn.writer is not None
    assert wait_until(lambda: conn.writer.busy, JOIN), "the publish did not wait to write"
    assert close_broker_connections(port, "test: broker-side close") == 1
    reader.join(JOIN)
    publisher.join(JOIN)
    assert not reader.is_alive() and not publisher.is_alive(), "deadlock"
    recoverable = drainer_amqp.Transport.recoverable_connection_errors
    assert isinstance(errors.get("reader"), recoverable), errors
    # The publish may have been written before the close was read; if not, it knows.
    assert "publisher" not in errors or isinstance(errors["publisher"], recoverable), errors


# -- intentional close ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_close_wakes_every_waiter_with_closed_intentionally(connect, mode: str) -> None:
    conn = connect(mode)
    idle = conn.channel()
    idle.basic_consume(idle.queue_declare("", exclusive=True).queue, callback=lambda m: None)
    errors: list[BaseException | None] = [None] * 5

    def blocked(i: int) -> None:
        try:
            while True:
                try:
                    conn.drain_events(timeout=60)  # legacy: one reads, four wait for the lock
                except TimeoutError:
                    pass
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors[i] = exc

    threads = [
        threading.Thread(target=blocked, args=(i,), name=f"blocked-{i}", daemon=True)
        for i in range(5)
    ]
    for t in threads:
        t.start()
    for t in threads:
        assert wait_until_blocked(t, {"drain_events"}), f"{t.name} did not block"
    started = time.monotonic()
    conn.close()
    took = time.monotonic() - started
    for t in threads:
        t.join(JOIN)
        assert not t.is_alive(), f"{t.name} was not woken"
    assert all(isinstance(e, ConnectionClosedIntentionally) for e in errors), errors
    assert took < CLOSE_TIMEOUT, f"close() took {took:.1f}s, beyond its deadline"
    with pytest.raises(ConnectionClosedIntentionally):
        conn.drain_events(timeout=1)
    with pytest.raises(ConnectionClosedIntentionally):
        idle.basic_publish(amqp.Message(b"x"), routing_key="nowhere")


@pytest.mark.parametrize("mode", MODES)
def test_close_is_idempotent_and_safe_from_two_threads(connect, mode: str, no_leaks) -> None:
    conn = connect(mode)
    conn.channel()
    barrier = threading.Barrier(2, timeout=JOIN)

    def closer() -> None:
        barrier.wait()
        conn.close()

    assert run_threads([closer, closer], "closer") == [None, None]
    conn.close()
    conn.collect()
    assert not conn.connected


def close_under_load_once(conn: drainer_amqp.Connection, queue: str) -> list[BaseException]:
    """close() while a consumer thread drains and a publisher thread publishes."""
    consumer_channel = conn.channel()
    consumer_channel.basic_consume(queue, no_ack=True, callback=lambda m: None)
    publisher_channel = conn.channel()
    running = threading.Barrier(3, timeout=JOIN)
    outcomes: list[BaseException] = []

    def consume() -> None:
        running.wait()
        try:
            while True:
                try:
                    conn.drain_events(timeout=1)
                except TimeoutError:
                    pass
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            outcomes.append(exc)

    def publish() -> None:
        running.wait()
        try:
            while True:
                publisher_channel.basic_publish(amqp.Message(b"load"), routing_key=queue)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            outcomes.append(exc)

    threads = [
        threading.Thread(target=consume, name="load-consumer"),
        threading.Thread(target=publish, name="load-publisher"),
    ]
    for t in threads:
        t.start()
    running.wait()
    conn.close()
    for t in threads:
        t.join(JOIN)
        assert not t.is_alive(), f"{t.name} still running after close()"
    return outcomes


@pytest.mark.parametrize("mode", MODES)
def test_close_under_load_20_times_in_a_row(connect, queue, mode: str, no_leaks) -> None:
    for _ in range(20):
        outcomes = close_under_load_once(connect(mode), queue)
        assert len(outcomes) == 2
        assert all(isinstance(e, ConnectionClosedIntentionally) for e in outcomes), outcomes
    assert not drainer_threads()


@pytest.mark.parametrize("mode", MODES)
def test_200_connect_close_cycles_leave_no_thread_or_descriptor(mode: str, no_leaks) -> None:
    for _ in range(200):
        conn = drainer_amqp.Connection(host=BROKER_HOST, dedicated_drainer=(mode == "drainer"))
        conn.connect()
        conn.channel()
        conn.close()
    assert not drainer_threads()


def test_an_interrupted_drain_events_leaves_the_legacy_lock_to_the_others(
    connect, queue, sigint_raises: None
) -> None:
    """Legacy mode: Ctrl-C in the main thread's ``drain_events()`` while it waits for the
    transport lock (another thread is writing) must leave the connection to the other
    threads: their publishes go on, and so does the main thread."""
    conn = connect("legacy")
    channel = conn.channel()
    writing, written = threading.Event(), threading.Event()

    def write_meanwhile() -> None:
        with conn.transport_lock:  # a publisher mid-write
            writing.set()
            written.wait(JOIN)

    def interrupt_once_queued() -> None:
        if wait_until(lambda: len(conn.transport_lock._waiters) == 1, JOIN, interval=0.001):
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    writer = threading.Thread(target=write_meanwhile, daemon=True)
    writer.start()
    assert writing.wait(JOIN)
    interrupter = threading.Thread(target=interrupt_once_queued, daemon=True)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        conn.drain_events(timeout=JOIN)  # pytest runs tests in the main thread
    written.set()
    writer.join(JOIN)
    interrupter.join(JOIN)

    published: list[str] = []

    def publish() -> None:
        channel.basic_publish(amqp.Message("from another thread"), routing_key=queue)
        published.append("other")

    other = threading.Thread(target=publish, daemon=True)
    other.start()
    other.join(JOIN)
    assert published == ["other"], "the other thread's publish waits for a lock nobody holds"
    channel.basic_publish(amqp.Message("from the main thread"), routing_key=queue)
    assert wait_until(lambda: count_messages(conn, queue) == 2, JOIN)


def test_an_interrupt_between_a_frames_header_and_its_payload_keeps_the_stream_in_step(
    sigint_raises: None,
) -> None:
    """Legacy mode: Ctrl-C while the main thread, reading for itself, has read a frame's
    header and waits for the rest. The header is kept for the next read: the next call
    reads that frame whole, then its own reply (the header was lost, and the stream out of
    step: MalformedFrame, the connection ended)."""
    with fake_broker(answer_declare=True) as broker:
        conn = drainer_amqp.Connection(host=broker.hostport)
        conn.connect()
        try:
            channel = conn.channel()
            transport = conn.transport
            real_read = transport._read
            waits_for_payload = threading.Event()

            def _read(n: int, *args: object) -> bytes:  # named as py-amqp's: blocked_in
                if n == 1:  # a heartbeat's frame-end byte: the header is read
                    waits_for_payload.set()
                return real_read(n, *args)  # type: ignore[no-any-return]

            transport._read = _read
            main = threading.current_thread()

            def interrupt_in_payload() -> None:
                if waits_for_payload.wait(JOIN) and wait_until_blocked(main, ["_read"]):
                    signal.pthread_kill(main.ident or 0, signal.SIGINT)

            interrupter = threading.Thread(target=interrupt_in_payload, daemon=True)
            interrupter.start()
            heartbeat = frame(8, 0, b"")
            broker.send(heartbeat[:7])
            with pytest.raises(KeyboardInterrupt):
                conn.drain_events(timeout=JOIN)  # pytest runs tests in the main thread
            interrupter.join(JOIN)
            broker.send(heartbeat[7:])
            assert channel.queue_declare("q").queue == "q"
            assert conn.reason is None
        finally:
            conn.close()


def test_an_interrupted_legacy_publish_behind_a_reader_is_written_and_keeps_the_connection(
    connect, queue, sigint_raises: None
) -> None:
    """Legacy mode: Ctrl-C lands while the main thread's confirmed publish waits for the
    socket, which a thread in ``drain_events()`` holds. Nothing was written yet, and the
    message was numbered for its confirm: it is written once the reader lets go, then
    the interrupt propagates; the connection and the confirms' numbering go on."""
    conn = connect("legacy")
    channel = conn.channel()
    channel.confirm_select()
    pokes = channel.queue_declare("", exclusive=True).queue
    channel.basic_consume(pokes, no_ack=True, callback=lambda message: None)
    stop = threading.Event()
    failures: list[BaseException] = []

    def poke() -> None:  # a delivery: the reader's read returns, and it lets go
        with amqp.Connection(host=BROKER_HOST) as other:
            other.channel().basic_publish(amqp.Message("poke"), routing_key=pokes)

    def read() -> None:
        while not stop.is_set():
            try:
                conn.drain_events(timeout=JOIN)
            except BaseException as exc:  # noqa: BLE001 - asserted below
                failures.append(exc)
                return

    def interrupt_once_queued() -> None:
        if wait_until(lambda: len(conn.transport_lock._waiters) == 1, JOIN, interval=0.001):
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            poke()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert wait_until(lambda: conn.dispatching_thread == reader.ident, JOIN, interval=0.001)
    interrupter = threading.Thread(target=interrupt_once_queued, daemon=True)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            channel.basic_publish_confirm(amqp.Message("interrupted"), routing_key=queue)
        interrupter.join(JOIN)
        assert conn.reason is None, conn.reason
    finally:
        stop.set()
        poke()  # the reader's last read returns: it stops
        reader.join(JOIN)
    assert not failures, failures
    channel.basic_publish_confirm(amqp.Message("after"), routing_key=queue, timeout=JOIN)
    assert count_messages(conn, queue) == 2


@pytest.mark.parametrize("mode", MODES)
def test_a_connection_dropped_without_close_is_collected_with_its_thread(
    mode: str, no_leaks: None
) -> None:
    """A connection the program drops without ``close()`` (a forgotten one, a pool that
    lost a race and was replaced) is collected, as a stock py-amqp connection is, and
    its drainer thread and socket go with it; so is a ``kombu.Connection``, released or
    dropped."""
    drainer = mode == "drainer"

    def plain() -> object:
        conn = drainer_amqp.Connection(host=BROKER_HOST, dedicated_drainer=drainer)
        conn.connect()
        conn.channel().queue_declare("", exclusive=True)
        return conn

    def through_kombu(release: bool) -> Callable[[], object]:
        def make() -> object:
            conn = kombu.Connection(
                f"drainer-amqp://guest:guest@{BROKER_HOST}//",
                transport_options={"dedicated_drainer": drainer},
            )
            conn.ensure_connection(max_retries=1)
            conn.default_channel.queue_declare("", exclusive=True)
            if release:
                conn.release()
            return conn

        return make

    for make in (plain, through_kombu(release=False), through_kombu(release=True)):
        dropped = weakref.ref(make())
        gc.collect()
        assert dropped() is None, [type(r) for r in gc.get_referrers(dropped())]
        assert wait_until(lambda: not drainer_threads(), JOIN), drainer_threads()


def test_drainer_stats_are_plain_numbers(connect, queue) -> None:
    conn = connect("drainer")
    channel = conn.channel()
    channel.confirm_select()
    channel.basic_publish_confirm(amqp.Message(b"x"), routing_key=queue)
    stats = conn.drainer_stats()
    assert stats["running"] is True
    for key in ("frames_read", "bytes_read", "heartbeats_sent", "heartbeats_received"):
        assert isinstance(stats[key], int)
    assert stats["frames_read"] > 0 and stats["bytes_read"] > 0
    assert isinstance(stats["lock_held_seconds"], float) and stats["lock_held_seconds"] > 0
    assert stats["waiting_threads"] == 0


def test_a_drainer_thread_that_cannot_start_fails_connect_and_leaves_nothing_open(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    """The interpreter may start shutting down between the connection's check and its
    thread's start (Python 3.12 then refuses the thread): connect() raises Python's
    error, and leaves no socket, descriptor or thread behind."""
    conn = drainer_amqp.Connection(host=BROKER_HOST, dedicated_drainer=True)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="interpreter shutdown"):
        conn.connect()
    monkeypatch.undo()
    assert not conn.connected
    assert conn not in drainer_amqp.connection.open_connections()
