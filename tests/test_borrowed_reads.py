"""Drainer mode: a thread that waits for its reply reads it itself while the drainer
thread sleeps (``drainer.BORROW_FOR``), and gives the socket back after: its reply
arrives without a second thread's wake-up, and nothing else changes (the drainer reads
again, a bad frame fails the connection in every waiter, close() does not hang).

The fake broker (``support.fake_broker``) answers a ``Queue.Declare`` only when the test
sends the reply, so a wait can be made to last.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from amqp import Message, spec
from support.broker import JOIN, unique_name, wait_until
from support.fake_broker import FakeBroker, fake_broker, frame, method
from support.publishing import connect
from support.threads import run_in_thread, wait_until_blocked

import drainer_amqp
from drainer_amqp import drainer

DECLARE_OK = (spec.Queue.DeclareOk, "sLL", ("q", 0, 0))


def record_dispatching_threads(
    conn: drainer_amqp.Connection, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str, list[tuple[int, int]]]]:
    """(thread name, method signatures) of every batch of frames dispatched."""
    seen: list[tuple[str, list[tuple[int, int]]]] = []
    dispatch = conn.dispatch_frames

    def recorded(frames: list[Any]) -> None:
        sigs = [(f[2][0] << 8 | f[2][1], f[2][2] << 8 | f[2][3]) for f in frames if f[0] == 1]
        seen.append((threading.current_thread().name, sigs))
        dispatch(frames)

    monkeypatch.setattr(conn, "dispatch_frames", recorded)
    return seen


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    with fake_broker() as fake:
        yield fake


def test_a_thread_reads_its_own_confirms_and_the_main_thread_never_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Who reads, not how fast the broker answers: a broker slowed by other load may take
    # longer than BORROW_FOR for every ack, which the drainer thread then reads.
    monkeypatch.setattr(drainer, "BORROW_FOR", JOIN)
    conn = connect("drainer")
    queue = unique_name("drainer-borrow")
    try:
        seen = record_dispatching_threads(conn, monkeypatch)
        channel = conn.channel()
        channel.queue_declare(queue, auto_delete=True)

        def publish() -> None:
            for n in range(50):
                channel.basic_publish_confirm(Message(b"%d" % n), routing_key=queue)

        thread, result = run_in_thread(publish, "borrowing-publisher")
        thread.join(JOIN)
        assert not thread.is_alive() and result == [None], result
        by_publisher = [sigs for name, sigs in seen if name == "borrowing-publisher"]
        assert any(spec.Basic.Ack in sigs for sigs in by_publisher), seen
        seen.clear()
        for n in range(20):  # the main thread: read by the drainer thread
            channel.basic_publish_confirm(Message(b"main-%d" % n), routing_key=queue)
        assert seen and all(name.startswith("drainer-amqp-") for name, _ in seen), seen
    finally:
        conn.channel().queue_delete(queue)
        conn.close()


def test_a_reply_that_takes_longer_is_read_by_the_drainer_thread(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = connect("drainer", host=broker.hostport)
    try:
        seen = record_dispatching_threads(conn, monkeypatch)
        channel = conn.channel()
        thread, result = run_in_thread(lambda: channel.queue_declare("q"), "declaring")
        assert broker.wait_for(spec.Queue.Declare)
        # The reply comes once the borrower gave the socket back and sleeps.
        assert wait_until_blocked(thread, {"queue_declare"})
        assert not conn.reader._lent  # type: ignore[attr-defined]
        broker.send(method(channel.channel_id, *DECLARE_OK))
        thread.join(JOIN)
        assert not thread.is_alive() and result and result[0].queue == "q", result
        readers = [name for name, sigs in seen if spec.Queue.DeclareOk in sigs]
        assert readers and readers[0].startswith("drainer-amqp-"), seen
        assert conn.reader.stats()["running"]
    finally:
        conn.close()


def test_a_waiter_leaves_the_reading_to_the_drainer_while_another_thread_waits(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a lone waiter borrows the socket. A borrower keeps the right to read while it
    waits for the interpreter lock after each system call; among many threads that want
    that lock the wait can last tens of milliseconds, and every other waiter's reply
    waits with it. So a thread that starts to wait while another waits already sleeps,
    and the drainer thread reads both replies."""
    conn = connect("drainer", host=broker.hostport)
    try:
        seen = record_dispatching_threads(conn, monkeypatch)
        first, second = conn.channel(), conn.channel()
        thread_a, result_a = run_in_thread(lambda: first.queue_declare("a"), "first")
        assert broker.wait_for(spec.Queue.Declare)
        assert wait_until_blocked(thread_a, {"queue_declare"})  # it borrowed, then slept
        assert conn.reader._borrows == 1  # type: ignore[attr-defined]
        thread_b, result_b = run_in_thread(lambda: second.queue_declare("b"), "second")
        assert broker.wait_for(spec.Queue.Declare, 2)
        assert wait_until_blocked(thread_b, {"queue_declare"})
        assert conn.reader._borrows == 1, "a second waiter borrowed the socket"  # type: ignore[attr-defined]
        broker.send(method(second.channel_id, spec.Queue.DeclareOk, "sLL", ("b", 0, 0)))
        broker.send(method(first.channel_id, *DECLARE_OK[:2], ("a", 0, 0)))
        for thread in (thread_a, thread_b):
            thread.join(JOIN)
            assert not thread.is_alive()
        assert result_a and result_a[0].queue == "a", result_a
        assert result_b and result_b[0].queue == "b", result_b
        readers = {name for name, sigs in seen if spec.Queue.DeclareOk in sigs}
        assert readers and all(name.startswith("drainer-amqp-") for name in readers), seen
    finally:
        conn.close()


def test_a_bad_frame_a_borrower_reads_fails_every_waiter(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(drainer, "BORROW_FOR", JOIN)  # the declaring thread reads it
    conn = connect("drainer", host=broker.hostport)
    try:
        first, second = conn.channel(), conn.channel()
        borrower, borrowed = run_in_thread(lambda: first.queue_declare("a"), "borrower")
        assert broker.wait_for(spec.Queue.Declare)
        assert wait_for_lent(conn)  # before another waits: only a lone waiter borrows
        sleeper, slept = run_in_thread(lambda: second.queue_declare("b"), "sleeper")
        assert broker.wait_for(spec.Queue.Declare, 2)
        assert conn.reader._lent  # type: ignore[attr-defined]
        sent = broker.send(frame(1, 0, b"\x00\x0a", end=0x00))  # a bad frame-end byte
        for thread in (borrower, sleeper):
            thread.join(JOIN)
            assert not thread.is_alive()
        took = time.monotonic() - sent
        for outcome in (borrowed, slept):
            assert outcome and isinstance(outcome[0], drainer_amqp.Transport.connection_errors)
        assert took < 1.0, f"the waiters learned of the bad frame after {took:.2f}s"
        assert isinstance(conn.reason, drainer_amqp.ConnectionLost), conn.reason
    finally:
        conn.collect()


class RaisedIntoThread(BaseException):
    """As ``PyThreadState_SetAsyncExc`` raises into a thread (a job timeout, a killer
    thread): not an ``Exception``, and it may land between any two calls."""


def test_an_exception_raised_into_a_borrower_mid_read_ends_the_connection_for_everyone(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A borrower has read bytes (here: its reply and another channel's) when an exception
    is raised into it, before they are dispatched. They are lost: the other channel's
    waiter would wait forever, and the stream may be out of step. The borrower raises
    its exception; the connection ends with ConnectionLost, which every other waiter
    gets at once."""
    monkeypatch.setattr(drainer, "BORROW_FOR", JOIN)
    conn = connect("drainer", host=broker.hostport)
    try:
        first, second = conn.channel(), conn.channel()
        borrower, borrowed = run_in_thread(lambda: first.queue_declare("a"), "borrower")
        assert broker.wait_for(spec.Queue.Declare)
        assert wait_for_lent(conn)
        sleeper, slept = run_in_thread(lambda: second.queue_declare("b"), "sleeper")
        assert broker.wait_for(spec.Queue.Declare, 2)
        assembler = conn.reader._assembler  # type: ignore[attr-defined]
        feed = assembler.feed

        def raised_into(data: bytes) -> Any:
            if threading.current_thread().name == "borrower":
                raise RaisedIntoThread
            return feed(data)

        monkeypatch.setattr(assembler, "feed", raised_into)
        sent = broker.send(method(1, *DECLARE_OK) + method(2, *DECLARE_OK))
        for thread in (borrower, sleeper):
            thread.join(JOIN)
            assert not thread.is_alive()
        took = time.monotonic() - sent
        assert borrowed and isinstance(borrowed[0], RaisedIntoThread), borrowed
        assert slept and isinstance(slept[0], drainer_amqp.ConnectionLost), slept
        assert took < 1.0, f"the other waiter learned of it after {took:.2f}s"
        assert isinstance(conn.reason, drainer_amqp.ConnectionLost), conn.reason
    finally:
        conn.collect()


def test_close_while_a_thread_reads_its_reply_does_not_wait_for_it(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(drainer, "BORROW_FOR", JOIN)
    conn = connect("drainer", host=broker.hostport)
    channel = conn.channel()
    thread, result = run_in_thread(lambda: channel.queue_declare("q"), "borrower")
    assert broker.wait_for(spec.Queue.Declare)
    assert wait_for_lent(conn)
    start = time.monotonic()
    conn.close()
    took = time.monotonic() - start
    thread.join(JOIN)
    assert not thread.is_alive()
    assert result and isinstance(result[0], drainer_amqp.ConnectionClosedIntentionally), result
    assert took < 2.0, f"close() took {took:.2f}s"
    assert not conn.reader.stats()["running"]


def test_a_link_that_ends_without_close_ok_mid_close_is_a_failure(broker: FakeBroker) -> None:
    """close() has begun (it writes Connection.Close) when the link ends with no CloseOk
    (a node that stops mid-close): a thread waiting on the connection gets a failure,
    which kombu retries, not ConnectionClosedIntentionally, which it does not."""
    conn = connect("drainer", host=broker.hostport)
    channel = conn.channel()
    thread, result = run_in_thread(lambda: channel.queue_declare("q"), "waiter")
    assert broker.wait_for(spec.Queue.Declare)
    send_frames = conn.send_frames

    def link_ends_as_close_is_written(*args: Any, **kwargs: Any) -> None:
        if args[1] != spec.Connection.Close:
            return send_frames(*args, **kwargs)
        broker.end_stream()  # read while close() is under way, before any CloseOk
        assert wait_until(lambda: conn.reason is not None, JOIN)
        raise BrokenPipeError("the link is gone")

    conn.send_frames = link_ends_as_close_is_written  # type: ignore[method-assign]
    conn.close()
    thread.join(JOIN)
    assert not thread.is_alive()
    assert result and isinstance(result[0], drainer_amqp.ConnectionLost), result


def wait_for_lent(conn: drainer_amqp.Connection) -> bool:
    """Whether a caller's thread took the socket's reading within JOIN."""
    deadline = time.monotonic() + JOIN
    while time.monotonic() < deadline:
        if conn.reader._lent:  # type: ignore[attr-defined]
            return True
        time.sleep(0.001)
    return False


def test_the_drainer_never_blocks_on_what_a_borrower_read(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drainer's select sees the socket readable; before it reads, a waiting thread
    borrows the socket and reads those bytes. The drainer must not then block in a read
    (collect() would wait for it to stop until its deadline)."""
    saw_readable, go_on = threading.Event(), threading.Event()
    armed, back_in_select = threading.Event(), threading.Event()

    class GatedSelector(selectors.DefaultSelector):  # type: ignore[misc, valid-type]
        def select(self, timeout: float | None = None) -> list[Any]:
            if go_on.is_set():
                back_in_select.set()
            ready = super().select(timeout)
            socket_ready = any(
                isinstance(key.fileobj, socket.socket) and events & selectors.EVENT_READ
                for key, events in ready
            )
            if armed.is_set() and socket_ready and not saw_readable.is_set():
                saw_readable.set()
                assert go_on.wait(JOIN)
            return ready

    monkeypatch.setattr(drainer.selectors, "DefaultSelector", GatedSelector)
    conn = connect("drainer", host=broker.hostport)
    try:
        channel = conn.channel()
        armed.set()
        broker.send(frame(8, 0, b""))  # a heartbeat: the drainer's select sees it
        assert saw_readable.wait(JOIN)
        thread, result = run_in_thread(lambda: channel.queue_declare("q"), "borrower")
        assert wait_until_blocked(thread, {"queue_declare"})  # it borrowed, then slept
        assert conn.reader._borrows == 1  # type: ignore[attr-defined]
        go_on.set()
        assert back_in_select.wait(JOIN), "the drainer blocked reading what a borrower took"
        start = time.monotonic()
        conn.collect()
        took = time.monotonic() - start
        thread.join(JOIN)
        assert not thread.is_alive()
        assert took < 2.0, f"collect() waited {took:.2f}s for the drainer to stop"
        assert not conn.reader.stats()["running"]
    finally:
        go_on.set()
        conn.collect()


def test_a_borrower_at_its_deadline_gives_the_socket_back_and_times_out(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A confirm that never comes (the fake broker confirms nothing): the waiting thread
    borrows the socket, and at its confirm_timeout gives it back and raises, well before
    the borrow window ends; the drainer reads again."""
    monkeypatch.setattr(drainer, "BORROW_FOR", JOIN)
    conn = connect("drainer", host=broker.hostport)
    try:
        channel = conn.channel()
        channel.confirm_select()

        def publish() -> float:
            start = time.monotonic()
            try:
                channel.basic_publish_confirm(Message(b"x"), routing_key="q", confirm_timeout=0.2)
            except Exception:  # noqa: BLE001 - the timeout, whatever its type
                return time.monotonic() - start
            raise AssertionError("a confirm the broker never sent was reported")

        thread, result = run_in_thread(publish, "borrower")
        thread.join(JOIN)
        assert not thread.is_alive()
        assert result and isinstance(result[0], float), result
        assert result[0] < 2.0, f"the publish timed out after {result[0]:.2f}s"
        assert conn.reader._borrows >= 1  # type: ignore[attr-defined]
        assert not conn.reader._lent  # type: ignore[attr-defined]
        second = conn.channel()
        thread, result = run_in_thread(lambda: second.queue_declare("q"), "declaring")
        assert broker.wait_for(spec.Queue.Declare)
        broker.send(method(second.channel_id, *DECLARE_OK))
        thread.join(JOIN)
        assert not thread.is_alive() and result and result[0].queue == "q", result
    finally:
        conn.collect()
