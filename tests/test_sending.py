"""A small write that keeps the interpreter lock (``send_at_once``), on real sockets: what
it takes arrives whole and in order, it never blocks, it leaves whatever it cannot do to
the socket's own calls; the writer completes a write it took only part of, and lets go of
the lock while a thread waits for a reply."""

from __future__ import annotations

import select
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from drainer_amqp.sending import MAX_AT_ONCE, readable, send_at_once
from drainer_amqp.writer import Writer

JOIN = 30.0

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or sys.implementation.name != "cpython",
    reason="send_at_once is for CPython on Linux; elsewhere it is None (tested below)",
)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected TCP pair on loopback: (the sender, the receiver)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    sender.settimeout(JOIN)
    receiver.settimeout(JOIN)
    try:
        yield sender, receiver
    finally:
        sender.close()
        receiver.close()


def receive(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(size)
        assert chunk, "the link ended early"
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def at_once(sock: socket.socket) -> Callable[[bytes | memoryview], int]:
    """``send_at_once(sock)``, which a plain socket here always has."""
    send = send_at_once(sock)
    assert send is not None
    return send


def test_a_small_write_is_taken_whole_and_arrives_in_order(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    send = at_once(sender)
    assert send(b"first ") == 6
    assert send(memoryview(b"xsecondx")[1:-1]) == 6
    assert receive(receiver, 12) == b"first second"


def test_a_write_larger_than_its_limit_is_left_to_sendall(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    send = at_once(sender)
    assert send(b"x" * (MAX_AT_ONCE + 1)) == 0
    sender.sendall(b"end")
    assert receive(receiver, 3) == b"end"  # nothing of the large write went out


def test_it_never_blocks_and_takes_nothing_once_the_socket_is_full(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    send = at_once(sender)
    chunk = bytes(range(256)) * 16
    taken = 0
    while (n := send(chunk)) == len(chunk):  # the receiver does not read: it fills up
        taken += n
    taken += n  # the last call took part of it, or nothing
    assert send(chunk) == 0
    rest = chunk[n:]
    reader = threading.Thread(target=lambda: received.append(receive(receiver, taken + len(rest))))
    received: list[bytes] = []
    reader.start()
    sender.sendall(rest)  # the socket's own call writes the rest once the reader reads
    reader.join(JOIN)
    assert received == [chunk * (taken // len(chunk)) + chunk]


def test_a_failed_send_takes_nothing_and_the_sockets_own_call_raises_the_error(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, _ = pair
    send = at_once(sender)
    sender.shutdown(socket.SHUT_WR)
    assert send(b"late") == 0
    with pytest.raises(BrokenPipeError):
        sender.sendall(b"late")
    sender.close()
    assert send(b"closed") == 0  # no descriptor: nothing written anywhere


def test_readable_tells_bytes_and_an_end_apart_from_nothing_yet_and_takes_nothing(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """What a legacy publish asks before it writes: nothing yet, bytes (left in the
    socket for a read), the peer's end of stream; a closed socket is not readable."""
    sender, receiver = pair
    assert not readable(receiver)
    sender.sendall(b"x")
    assert select.select([receiver], [], [], JOIN)[0]
    assert readable(receiver)
    assert readable(receiver)  # looked at, not taken
    assert receiver.recv(10) == b"x"
    assert not readable(receiver)
    sender.shutdown(socket.SHUT_WR)
    assert select.select([receiver], [], [], JOIN)[0]
    assert readable(receiver)
    assert receiver.recv(10) == b""
    receiver.close()
    assert not readable(receiver)


def test_only_a_plain_socket_gets_one() -> None:
    assert send_at_once(object()) is None
    context = ssl.create_default_context()
    with (
        socket.socket() as plain,
        context.wrap_socket(plain, server_hostname="x", do_handshake_on_connect=False) as tls,
    ):
        assert send_at_once(tls) is None


def real_writer(
    sock: socket.socket, waiters: list[object] | None = None
) -> tuple[Writer, list[BaseException | None]]:
    """A writer on ``sock``; the list gets every error it reports."""
    errors: list[BaseException | None] = []

    def on_error(exc: BaseException) -> BaseException:
        errors.append(exc)
        return exc

    return Writer(sock, threading.Lock(), on_error, [] if waiters is None else waiters), errors


def half_at_once(writer: Writer) -> list[int]:
    """Make ``writer``'s sends at once take at most half of each payload; the list gets
    what each took."""
    real = writer._send_at_once
    assert real is not None
    taken: list[int] = []

    def half(payload: bytes | memoryview) -> int:
        taken.append(real(bytes(payload)[: max(len(payload) // 2, 1)]))
        return taken[-1]

    writer._send_at_once = half
    return taken


def test_the_writer_writes_what_was_not_taken_at_once_with_sendall(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    writer, errors = real_writer(sender)
    taken = half_at_once(writer)
    message = bytes(range(256)) * 8
    writer.send([message[:100], message[100:]])
    writer.send([b"next"])
    assert receive(receiver, len(message) + 4) == message + b"next"
    assert taken == [len(message) // 2, 2] and not errors


def test_the_flusher_writes_what_was_not_taken_at_once_in_its_next_turns(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    writer, errors = real_writer(sender)
    writer.flusher_wake = lambda: None
    taken = half_at_once(writer)
    writer.send([b"A" * 100], behind=errors.append)
    writer.send([b"B" * 100], behind=errors.append)
    turns = 1
    while writer.flush():
        turns += 1
        assert turns < 20, "the flusher never finished"
    assert receive(receiver, 200) == b"A" * 100 + b"B" * 100
    assert taken[:2] == [100, 50] and not errors


def test_while_a_thread_waits_for_its_turn_to_write_writes_let_go_of_the_lock(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A leads and is inside its send at once when B comes and waits for its turn: B's
    batch is written letting go of the lock (A, or B leading, writes it); once B is
    back, C's write keeps it again."""
    sender, receiver = pair
    writer, errors = real_writer(sender)
    real = writer._send_at_once
    assert real is not None
    inside, go = threading.Event(), threading.Event()
    calls: list[bytes] = []

    def held_once(payload: bytes | memoryview) -> int:
        calls.append(bytes(payload))
        if len(calls) == 1:
            inside.set()
            assert go.wait(JOIN)
        return real(payload)

    writer._send_at_once = held_once
    a = threading.Thread(target=writer.send, args=([b"A"],), name="test-A")
    a.start()
    assert inside.wait(JOIN)
    b = threading.Thread(target=writer.send, args=([b"B"],), name="test-B")
    b.start()
    queued(writer, 1)
    assert len(writer._turn_waiters) == 1
    go.set()
    for thread in (a, b):
        thread.join(JOIN)
    assert not writer._turn_waiters
    writer.send([b"C"])
    assert receive(receiver, 3) == b"ABC"
    assert calls == [b"A", b"C"] and not errors


def queued(writer: Writer, n: int) -> None:
    """Until ``n`` messages wait in the writer's queue."""
    deadline = time.monotonic() + JOIN
    while len(writer._queue) < n:
        assert time.monotonic() < deadline, f"{len(writer._queue)} queued, not {n}"
        time.sleep(0.001)


def test_while_a_thread_waits_for_a_reply_every_write_lets_go_of_the_lock(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """The thread that reads the reply then gets the interpreter lock within a write."""
    sender, receiver = pair
    waiters: list[object] = []
    writer, errors = real_writer(sender, waiters)
    taken = half_at_once(writer)
    writer.send([b"kept "])
    waiters.append(object())  # a thread waits for a reply
    writer.send([b"let go "])
    waiters.clear()
    writer.send([b"kept"])
    assert receive(receiver, 16) == b"kept let go kept"
    assert taken == [2, 2] and not errors  # only the two writes without a waiter
