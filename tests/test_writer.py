"""The group-committing Writer on its own, with a fake socket: order, contiguity,
write-behind, the flusher's hand-over, the bounded queue and failure.

Every wait here has a deadline; the fake socket blocks only when a test holds it."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from functools import partial

import pytest

from drainer_amqp import writer as writer_module
from drainer_amqp.writer import LARGE, Writer

JOIN = 30.0


class FakeSocket:
    """Records what is written; ``hold()`` makes each ``sendall`` wait for a permit."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.calls: list[str] = []  # the name of the thread of each sendall
        self.entered = threading.Semaphore(0)  # released as each sendall starts
        self._permits: threading.Semaphore | None = None
        self.error: OSError | None = None

    def hold(self) -> None:
        self._permits = threading.Semaphore(0)

    def permit(self, n: int = 1) -> None:
        assert self._permits is not None
        for _ in range(n):
            self._permits.release()

    def release_all(self) -> None:
        permits, self._permits = self._permits, None
        if permits is not None:
            permits.release(1000)

    def sendall(self, payload: bytes) -> None:
        self.calls.append(threading.current_thread().name)
        self.entered.release()
        permits = self._permits
        if permits is not None:
            assert permits.acquire(timeout=JOIN), "the test never permitted this write"
        if self.error is not None:
            raise self.error
        self.data += payload


def make_writer(sock: FakeSocket, **kwargs: int) -> Writer:
    box: list[Writer] = []

    def on_error(exc: OSError) -> BaseException:
        error = ConnectionError(f"socket failed: {exc}")
        box[0].fail(lambda: ConnectionError(f"socket failed: {exc}"))
        return error

    writer = Writer(sock, threading.RLock(), on_error, **kwargs)  # type: ignore[arg-type]
    box.append(writer)
    return writer


def start(target: Callable[[], object], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def entered(sock: FakeSocket) -> None:
    assert sock.entered.acquire(timeout=JOIN), "no sendall started"


def busy_writer(first: bytes = b"A", **kwargs: int) -> tuple[FakeSocket, Writer, threading.Thread]:
    """A writer whose flusher (a thread sending ``first``) is held inside ``sendall``."""
    sock = FakeSocket()
    sock.hold()
    writer = make_writer(sock, **kwargs)
    flusher = start(lambda: writer.send([first]), "flusher")
    entered(sock)
    return sock, writer, flusher


def wait_for_offer(writer: Writer) -> None:
    deadline = time.monotonic() + JOIN
    while writer._successor is None:  # noqa: SLF001 - the offer is the point under test
        assert time.monotonic() < deadline, "nobody offered to take over"
        time.sleep(0.001)


def test_messages_of_many_threads_arrive_whole_and_in_each_threads_order() -> None:
    sock = FakeSocket()
    writer = make_writer(sock)
    threads, per_thread = 16, 2000
    errors: list[BaseException] = []

    def publisher(t: int) -> None:
        try:
            for i in range(per_thread):
                # three chunks, as a method, header and body frame
                writer.send([b"<%d:" % t, b"%d" % i, b">"])
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    workers = [start(partial(publisher, t), f"pub-{t}") for t in range(threads)]
    for w in workers:
        w.join(JOIN)
    assert not any(w.is_alive() for w in workers) and not errors
    messages = re.findall(rb"<(\d+):(\d+)>", bytes(sock.data))
    assert len(messages) == threads * per_thread, "a message was lost or torn"
    assert b"".join(b"<%s:%s>" % m for m in messages) == bytes(sock.data)
    for t in range(threads):
        seen = [int(i) for tt, i in messages if int(tt) == t]
        assert seen == list(range(per_thread)), f"thread {t}'s messages out of order"


def test_numbering_follows_the_write_order_when_the_caller_orders_its_sends() -> None:
    """As a channel does with its lock: delivery tags match the order on the wire."""
    sock = FakeSocket()
    writer = make_writer(sock)
    channel_lock = threading.Lock()
    tags: dict[bytes, int] = {}
    counter = [0]

    def publisher(t: int) -> None:
        for i in range(500):
            name = b"%d.%d" % (t, i)

            def number(name: bytes = name) -> None:
                counter[0] += 1
                tags[name] = counter[0]

            with channel_lock:
                writer.send([b"<" + name + b">"], number=number)

    workers = [start(partial(publisher, t), f"pub-{t}") for t in range(8)]
    for w in workers:
        w.join(JOIN)
    wire = re.findall(rb"<([\d.]+)>", bytes(sock.data))
    assert [tags[name] for name in wire] == list(range(1, 8 * 500 + 1))


def test_a_send_returns_while_another_thread_writes_and_its_bytes_follow() -> None:
    sock, writer, first = busy_writer(b"first")
    begun = time.monotonic()
    writer.send([b"second"], block=False)  # never waits: not even to take over
    assert time.monotonic() - begun < 1.0
    assert writer.busy and bytes(sock.data) == b""
    sock.release_all()
    first.join(JOIN)
    assert not first.is_alive()
    assert bytes(sock.data) == b"firstsecond"
    assert not writer.busy


def test_the_flusher_hands_over_after_its_batch_so_its_own_call_ends() -> None:
    sock, writer, flusher = busy_writer()  # A is being written
    successor = start(lambda: writer.send([b"B"]), "successor")  # offers to take over
    wait_for_offer(writer)
    writer.send([b"C"])  # an offer stands: this one returns at once
    sock.permit()  # A's write ends; B and C are queued
    flusher.join(JOIN)
    assert not flusher.is_alive(), "the flusher did not return after its batch"
    entered(sock)  # the successor writes B and C
    assert sock.calls == ["flusher", "successor"]
    sock.release_all()
    successor.join(JOIN)
    assert not successor.is_alive()
    assert bytes(sock.data) == b"ABC"


def test_an_offer_to_take_over_ends_when_the_write_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(writer_module, "TAKE_OVER_WAIT", 0.05)
    sock, writer, flusher = busy_writer()
    begun = time.monotonic()
    writer.send([b"B"])  # offers, waits 50 ms, leaves B to the flusher
    assert 0.04 <= time.monotonic() - begun < 5.0
    assert writer._successor is None  # noqa: SLF001
    sock.release_all()
    flusher.join(JOIN)
    assert bytes(sock.data) == b"AB"
    assert sock.calls == ["flusher", "flusher"]


def test_a_full_queue_makes_a_publisher_wait_within_its_timeout() -> None:
    sock, writer, flusher = busy_writer(b"0", limit=4)
    for i in range(1, 5):
        writer.send([b"%d" % i], block=False)
    begun = time.monotonic()
    with pytest.raises(TimeoutError, match="not draining"):
        writer.send([b"X"], timeout=0.2)
    assert 0.15 <= time.monotonic() - begun < 5.0
    assert len(writer._queue) == 4  # noqa: SLF001 - bounded, and X was not queued
    sock.release_all()
    flusher.join(JOIN)
    writer.send([b"5"])
    assert bytes(sock.data) == b"012345"


def test_a_large_message_is_in_the_socket_when_send_returns() -> None:
    sock, writer, flusher = busy_writer()
    body = b"x" * LARGE
    done = threading.Event()

    def send_large() -> None:
        writer.send([b"L", body])
        done.set()

    large = start(send_large, "large")
    assert not done.wait(0.2), "a large message returned before it was written"
    sock.release_all()
    large.join(JOIN)
    flusher.join(JOIN)
    assert done.is_set()
    assert bytes(sock.data) == b"AL" + body


def test_after_fail_every_send_raises_and_the_queue_is_dropped() -> None:
    sock, writer, flusher = busy_writer()
    writer.send([b"B"], block=False)
    writer.fail(lambda: ConnectionAbortedError("the connection ended"))
    with pytest.raises(ConnectionAbortedError, match="ended"):
        writer.send([b"C"])
    sock.release_all()
    flusher.join(JOIN)
    assert bytes(sock.data) == b"A"
    assert not writer.busy


def test_a_socket_error_fails_the_writer_for_every_thread() -> None:
    sock = FakeSocket()
    sock.error = BrokenPipeError(32, "Broken pipe")
    writer = make_writer(sock)
    with pytest.raises(ConnectionError, match="Broken pipe"):
        writer.send([b"A"])
    assert not writer.busy
    errors: list[BaseException] = []

    def publisher() -> None:
        try:
            writer.send([b"B"])
        except ConnectionError as exc:
            errors.append(exc)

    workers = [start(publisher, f"pub-{i}") for i in range(4)]
    for w in workers:
        w.join(JOIN)
    assert len(errors) == 4


def test_a_thread_waiting_to_take_over_gets_the_flushers_failure_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It must not wait out its offer: kombu would retry it late, after the others had
    reconnected, and its cleanup would hit their new connection."""
    monkeypatch.setattr(writer_module, "TAKE_OVER_WAIT", 10 * JOIN)
    sock = FakeSocket()
    sock.hold()
    writer = make_writer(sock)
    errors: list[BaseException] = []

    def send(data: bytes) -> None:
        try:
            writer.send([data])
        except ConnectionError as exc:
            errors.append(exc)

    flusher = start(partial(send, b"A"), "flusher")
    entered(sock)
    successor = start(partial(send, b"B"), "successor")
    wait_for_offer(writer)
    sock.error = BrokenPipeError(32, "Broken pipe")
    begun = time.monotonic()
    sock.release_all()
    flusher.join(JOIN)
    successor.join(JOIN)
    assert not successor.is_alive()
    assert time.monotonic() - begun < JOIN
    assert len(errors) == 2, errors
