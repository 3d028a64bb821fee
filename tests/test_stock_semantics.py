"""Stock py-amqp and kombu behaviour that real programs rely on, in both modes."""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable, Iterator
from time import monotonic
from typing import Any

import amqp
import kombu
import pytest
from amqp import spec
from amqp.exceptions import AMQPError, AMQPNotImplementedError
from amqp.method_framing import frame_writer as amqp_frame_writer
from kombu.transport import pyamqp
from support.broker import (
    BROKER_HOST,
    JOIN,
    close_broker_connections,
    unique_name,
    wait_until,
)
from support.fake_broker import content, fake_broker, method
from support.threads import drain_in_background, wait_until_blocked

import drainer_amqp
from drainer_amqp import ConnectionClosedIntentionally, ConnectionLost

MODES = ["legacy", "drainer"]
#: How far past its deadline a call may return: the reading's slack and a busy machine
#: (less than a socket timeout restarted by a late piece would add).
LATE = 0.4


def _local_port(conn: drainer_amqp.Connection) -> int:
    return int(conn.sock.getsockname()[1])


# -- closing what has already ended is a no-op -----------------------------------------------
def _drain_until(conn: drainer_amqp.Connection, error: type[BaseException]) -> None:
    """Drain until the connection's end reaches this thread as ``error`` (within 30 s).
    The drainer fans it out at once; in legacy mode this thread reads it."""
    deadline = monotonic() + 30
    with pytest.raises(error):
        while monotonic() < deadline:
            try:
                conn.drain_events(timeout=1)
            except TimeoutError:
                continue


def _end_by_immediate(conn: drainer_amqp.Connection, channel: Any) -> None:
    """RabbitMQ answers ``immediate=True`` with Connection.Close 540 NOT_IMPLEMENTED."""
    channel.basic_publish(amqp.Message("x"), routing_key=unique_name(), immediate=True)
    _drain_until(conn, AMQPNotImplementedError)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["immediate", "close_connection"])
def test_close_after_the_connection_ended_is_quiet(mode: str, how: str, no_leaks: None) -> None:
    conn = drainer_amqp.Connection(host=BROKER_HOST, dedicated_drainer=(mode == "drainer"))
    conn.connect()
    channel = conn.channel()
    if how == "immediate":
        _end_by_immediate(conn, channel)
    else:
        close_broker_connections(_local_port(conn), "closed by test")
        _drain_until(conn, AMQPError)
    # A finally: or a with block closes both: quietly, more than once.
    channel.close()
    channel.close()
    conn.close()
    conn.close()
    assert not conn.connected


@pytest.mark.parametrize("mode", MODES)
def test_with_blocks_exit_quietly_after_a_broker_close(mode: str, no_leaks: None) -> None:
    seen: list[BaseException] = []
    with drainer_amqp.Connection(host=BROKER_HOST, dedicated_drainer=(mode == "drainer")) as conn:
        with conn.channel() as channel:
            try:
                _end_by_immediate(conn, channel)
            except BaseException as exc:  # noqa: BLE001 - recorded; the with blocks must not raise
                seen.append(exc)
    assert not seen


@pytest.mark.parametrize("mode", MODES)
def test_close_after_a_reset_is_quiet(proxied_broker: Any, mode: str, no_leaks: None) -> None:
    conn = drainer_amqp.Connection(
        host=proxied_broker.hostport, dedicated_drainer=(mode == "drainer")
    )
    conn.connect()
    channel = conn.channel()
    proxied_broker.proxy.add_toxic(type="reset_peer", attributes={"timeout": 0})
    with pytest.raises((ConnectionLost, OSError, AMQPError)):
        for _ in range(50):
            channel.queue_declare(unique_name(), exclusive=True)  # goes with the connection
    channel.close()
    conn.close()


@pytest.mark.parametrize("mode", MODES)
def test_collect_of_a_failed_connection_keeps_the_failure(mode: str, no_leaks: None) -> None:
    conn = drainer_amqp.Connection(host=BROKER_HOST, dedicated_drainer=(mode == "drainer"))
    conn.connect()
    channel = conn.channel()
    close_broker_connections(_local_port(conn), "closed by test")
    _drain_until(conn, AMQPError)
    conn.collect()  # what kombu's ensure() does after an error
    with pytest.raises(AMQPError) as raised:
        channel.basic_publish(amqp.Message("x"), routing_key="nowhere")
    assert not isinstance(raised.value, ConnectionClosedIntentionally)
    conn.close()  # what kombu's failover (Connection.switch()) does after an error
    with pytest.raises(AMQPError) as raised:
        channel.basic_publish(amqp.Message("x"), routing_key="nowhere")
    assert not isinstance(raised.value, ConnectionClosedIntentionally)


# -- a publish after the broker ended the connection raises --------------------------------
CONNECTION_FORCED = (320, "CONNECTION_FORCED - broker shutdown", 0, 0)


@pytest.mark.parametrize("mode", ["stock", *MODES])
@pytest.mark.parametrize("how", ["end_of_stream", "connection_close"])
def test_a_publish_after_the_broker_ended_an_idle_connection_raises(mode: str, how: str) -> None:
    """The broker ended an idle connection (an end of stream: a restart, a load balancer's
    idle timeout; or its Connection.Close) and nobody has read since. A publish then
    raises a connection error, which kombu's retry answers with a new connection,
    rather than returning written into a link the broker has let go of: the message
    would be lost without an error. Stock py-amqp reads before each publish (its
    ``drain_events(timeout=0)``), legacy mode reads what is waiting, the drainer has
    read it already."""
    with fake_broker() as broker:
        if mode == "stock":
            conn: Any = amqp.Connection(host=broker.hostport)
        else:
            conn = drainer_amqp.Connection(
                host=broker.hostport, dedicated_drainer=mode == "drainer"
            )
        conn.connect()
        try:
            channel = conn.channel()
            channel.basic_publish(amqp.Message(b"before"), routing_key="q")
            if how == "end_of_stream":
                broker.end_stream()
            else:
                broker.send(method(0, spec.Connection.Close, "BsBB", CONNECTION_FORCED))
            if mode == "drainer":  # its thread reads the end at once
                assert wait_until(lambda: conn.reason is not None, JOIN)
            else:  # nobody has read it: it waits in the socket
                assert select.select([conn.sock], [], [], JOIN)[0], "the end never came"
            with pytest.raises(pyamqp.Transport.connection_errors):
                channel.basic_publish(amqp.Message(b"after"), routing_key="q")
        finally:
            conn.collect()


@pytest.mark.parametrize("mode", MODES)
def test_a_publish_after_a_thread_saw_the_link_fail_raises_the_failure(mode: str) -> None:
    """A thread in drain_events() saw the link end (the socket is shut, the connection
    not released yet); a publish in another thread then raises the same ConnectionLost,
    which kombu retries, not an error of the socket's own (a TypeError on the shut
    socket would stop kombu's retry)."""
    with fake_broker() as broker:
        conn = drainer_amqp.Connection(host=broker.hostport, dedicated_drainer=mode == "drainer")
        conn.connect()
        try:
            channel = conn.channel()
            broker.end_stream()
            with pytest.raises(ConnectionLost):
                conn.drain_events(timeout=JOIN)
            for _ in range(2):
                with pytest.raises(ConnectionLost):
                    channel.basic_publish(amqp.Message(b"after"), routing_key="q")
        finally:
            conn.collect()


# -- deliveries sent before a cancel completed reach the consumer ---------------------------
@pytest.fixture
def kombu_conn(request: pytest.FixtureRequest) -> Iterator[kombu.Connection]:
    mode = request.param
    conn = kombu.Connection(
        f"amqp://guest:guest@{BROKER_HOST}//",
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": mode == "drainer"},
    )
    try:
        yield conn
    finally:
        conn.release()


@pytest.mark.parametrize("kombu_conn", MODES, indirect=True)
@pytest.mark.parametrize("kind", ["plain", "priority"])
def test_deliveries_before_a_cancel_reach_the_consumer(
    kombu_conn: kombu.Connection, kind: str
) -> None:
    arguments = {"x-max-priority": 10} if kind == "priority" else None
    queue = kombu.Queue(unique_name(), queue_arguments=arguments, auto_delete=False)
    got: list[Any] = []
    try:
        with kombu_conn.Producer() as producer:
            for i in range(3):
                producer.publish({"n": i}, routing_key=queue.name, declare=[queue], priority=i)

        def on_message(body: Any, message: Any) -> None:
            got.append(body)
            message.ack()

        with kombu.Consumer(kombu_conn, [queue], callbacks=[on_message]):
            kombu_conn.drain_events(timeout=1)
        # The with block's exit cancelled the consumer: all three reached it.
        expected = (
            [{"n": 2}, {"n": 1}, {"n": 0}] if kind == "priority" else [{"n": i} for i in range(3)]
        )
        assert got == expected
    finally:
        queue.bind(kombu_conn.default_channel).delete()


@pytest.mark.parametrize("kombu_conn", MODES, indirect=True)
def test_deliveries_requeued_before_a_cancel_come_back(kombu_conn: kombu.Connection) -> None:
    queue = kombu.Queue(unique_name(), auto_delete=False)
    got: list[tuple[Any, bool]] = []

    def on_message(body: Any, message: Any) -> None:
        got.append((body, message.delivery_info["redelivered"]))
        if not message.delivery_info["redelivered"]:
            message.requeue()
        else:
            message.ack()

    try:
        with kombu_conn.Producer() as producer:
            for i in range(3):
                producer.publish({"n": i}, routing_key=queue.name, declare=[queue])
        with kombu.Consumer(kombu_conn, [queue], callbacks=[on_message]):
            kombu_conn.drain_events(timeout=1)
        firsts = [b for b, redelivered in got if not redelivered]
        assert firsts[:1] == [{"n": 0}]
        with kombu.Consumer(kombu_conn, [queue], callbacks=[on_message]):
            assert wait_until(
                lambda: _drain_once(kombu_conn) or len({str(b) for b, r in got if r}) == 3, 10
            )
        assert sorted(str(b) for b, r in got if r) == sorted(str({"n": i}) for i in range(3))
    finally:
        queue.bind(kombu_conn.default_channel).delete()


def _drain_once(conn: kombu.Connection) -> bool:
    try:
        conn.drain_events(timeout=0.2)
    except TimeoutError:
        pass
    return False


# -- kombu and py-amqp interfaces ------------------------------------------------------------
def test_ssl_transport_is_kombus() -> None:
    assert issubclass(drainer_amqp.SSLTransport, pyamqp.SSLTransport)
    assert issubclass(drainer_amqp.Transport, pyamqp.Transport)
    assert drainer_amqp.SSLTransport.default_port == pyamqp.SSLTransport.default_port


@pytest.mark.parametrize("mode", MODES)
def test_basic_publish_confirm_keeps_py_amqps_signature(
    mode: str, connect: Callable[..., Any]
) -> None:
    conn = connect(mode)
    channel = conn.channel()
    queue = channel.queue_declare(unique_name(), exclusive=True).queue
    # msg, exchange, routing_key, mandatory, immediate, timeout, confirm_timeout, argsig
    result = channel.basic_publish_confirm(
        amqp.Message("x"), "", queue, False, False, 5, 5, "Bssbb"
    )
    stock = amqp.Connection(host=BROKER_HOST)
    stock.connect()
    try:
        stock_channel = stock.channel()
        stock_result = stock_channel.basic_publish_confirm(
            amqp.Message("x"), "", queue, False, False, 5, 5, "Bssbb"
        )
    finally:
        stock.close()
    assert type(result) is type(stock_result)
    assert channel.queue_declare(queue, passive=True).message_count == 2


@pytest.mark.parametrize("mode", MODES)
def test_a_callers_frame_writer_is_used(mode: str, connect: Callable[..., Any]) -> None:
    written: list[int] = []

    def counting_frame_writer(connection: Any, transport: Any) -> Callable[..., None]:
        write = amqp_frame_writer(connection, transport)

        def write_frame(type_: int, *args: Any) -> None:
            written.append(type_)
            write(type_, *args)

        return write_frame

    conn = connect(mode, frame_writer=counting_frame_writer)
    channel = conn.channel()
    queue = channel.queue_declare(unique_name(), exclusive=True).queue
    before = len(written)
    channel.basic_publish(amqp.Message("x"), routing_key=queue)
    assert len(written) > before
    assert wait_until(lambda: channel.queue_declare(queue, passive=True).message_count == 1, 5)


# -- fork: a legacy connection inherited by a child -------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_a_forked_child_gets_connection_lost_and_the_parent_keeps_its_link(
    mode: str, connect: Callable[..., Any]
) -> None:
    conn = connect(mode)
    channel = conn.channel()
    queue = channel.queue_declare(unique_name(), exclusive=True).queue
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what a publish raised, never touch the parent's socket
        code = 1
        try:
            channel.basic_publish(amqp.Message("from child"), routing_key=queue)
        except ConnectionLost:
            code = 0
        except BaseException:  # noqa: BLE001 - any other outcome is a failure
            code = 2
        os.write(write_end, bytes([code]))
        os._exit(0)
    os.close(write_end)
    try:
        assert os.read(read_end, 1) == b"\0", "the child did not get ConnectionLost"
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    channel.basic_publish(amqp.Message("from parent"), routing_key=queue)
    assert wait_until(lambda: channel.queue_declare(queue, passive=True).message_count == 1, 5)


@pytest.mark.parametrize("mode", MODES)
def test_a_new_consumers_first_deliveries_are_not_rejected(
    mode: str, connect: Callable[..., Any]
) -> None:
    """Another thread is in ``drain_events()`` while this one calls ``basic_consume`` on
    a queue that holds messages. The first deliveries may reach the draining thread before
    this one wakes from ``ConsumeOk``; they go to the new consumer, in order, and none is
    rejected and redelivered for want of a callback. Five rounds: the race is narrow."""
    for round_ in range(5):
        conn = connect(mode)
        channel = conn.channel()
        queue = unique_name()
        channel.queue_declare(queue, auto_delete=False)
        for i in range(COUNT):
            channel.basic_publish(amqp.Message(str(i)), "", queue)
        got: list[Any] = []
        all_in = threading.Event()

        def on_message(message: Any, got: list[Any] = got, done: Any = all_in) -> None:
            got.append(message)
            if len(got) == COUNT:
                done.set()

        try:
            with drain_in_background(conn, timeout=0.05, name="drain-while-consuming"):
                conn.channel().basic_consume(
                    queue, consumer_tag="first", no_ack=True, callback=on_message
                )
                assert all_in.wait(JOIN), f"round {round_}: {len(got)} of {COUNT} arrived"
        finally:
            channel.queue_delete(queue)
            conn.close()
        assert [m.body for m in got] == [str(i) for i in range(COUNT)]
        assert not [m for m in got if m.delivery_info["redelivered"]]


COUNT = 300


# -- a timeout mid-frame -----------------------------------------------------------------
def test_a_legacy_read_times_out_mid_frame_on_time_and_keeps_what_it_read(
    connect: Callable[..., Any],
) -> None:
    """A delivery that comes in pieces, one of them halfway through the call:
    ``drain_events(timeout=1)`` raises ``TimeoutError`` at its deadline, not a whole
    socket timeout after the last piece, and the next call delivers the whole message
    from what was read and what follows, as stock py-amqp does."""
    with fake_broker() as broker:
        conn = connect("legacy", host=broker.hostport)
        channel = conn.channel()
        got: list[bytes] = []
        channel.basic_consume("q", consumer_tag="c", callback=lambda m: got.append(m.body))
        assert broker.wait_for(spec.Basic.Consume)
        deliver = content(
            channel.channel_id, spec.Basic.Deliver, "sLbss", ("c", 1, False, "", "q"), b"body"
        )
        broker.send(deliver[:3])  # half a frame header
        reader = threading.current_thread()

        def late_piece() -> None:  # half the payload, once the reader waits for it
            assert wait_until_blocked(reader, ["read_frame"])
            threading.Event().wait(max(began + 0.5 - monotonic(), 0))
            broker.send(deliver[3:20])

        helper = threading.Thread(target=late_piece, daemon=True)
        began = monotonic()
        helper.start()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=1.0)
        took = monotonic() - began
        helper.join(JOIN)
        assert 1.0 <= took < 1.0 + LATE, took
        assert got == []
        broker.send(deliver[20:])
        conn.drain_events(timeout=JOIN)
        assert got == [b"body"]
