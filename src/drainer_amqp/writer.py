"""The write side of a connection's socket, shared by every thread (group commit).

A thread with a complete message (all its frames, already encoded) calls
:meth:`Writer.send`, which appends the message to one queue; messages go out whole, in
the order they were appended. Then:

* If no thread is writing, this thread becomes the *flusher*: it writes everything
  queued in one ``sendall``, and again while more was appended meanwhile.
* If a flusher is busy, the message is left to it and ``send`` returns at once
  (write-behind): a busy socket costs one system call per batch, not per message.
* To bound how long a flusher's own call lasts, one other thread at a time offers to
  take over. The flusher hands the socket to it after the batch it is writing, so a
  flusher writes one batch, or two, and returns.

No lock is held per message: appending to a ``deque`` and trying the flusher's lock
without blocking are atomic. That is the point. Under the GIL, a thread switched out
while it holds a lock every publisher needs makes each of them block on it in turn,
and the switches, not the bytes, become the cost.

``send`` returns once the message is in the socket or queued for the flusher that is
writing, as a plain ``sendall`` returns once the bytes are in the kernel's buffer:
neither means the broker has them (publisher confirms do). If the connection fails
first, what is still queued is dropped with it, and every later ``send`` raises the
connection's reason (:meth:`fail`).

The queue is bounded: a thread that finds ``limit`` messages queued waits (bounded by
its timeout) to write them itself, instead of letting the queue grow.
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Writer"]

#: Default bound on messages queued but not yet written.
QUEUE_LIMIT = 1024
#: Messages at least this large are written by their own thread, so a full queue holds
#: at most QUEUE_LIMIT small messages (bytes).
LARGE = 64 * 1024
#: How long a thread offering to take over waits for the flusher's batch to end before
#: it leaves its message to the flusher and returns (seconds).
TAKE_OVER_WAIT = 0.1


class Writer:
    """Writes whole messages to ``sock`` in order; safe from any thread.

    ``io_lock`` is held around each ``sendall``: in legacy mode it is the transport lock
    (a legacy reader changes the socket's timeout, so nobody may write meanwhile), in
    drainer mode a lock of its own that only TLS reads share (an ``SSLSocket`` may not
    be read and written at once). ``on_error`` turns a socket error into the
    connection's reason (ending the connection) and returns the error to raise.
    """

    def __init__(
        self,
        sock: socket.socket,
        io_lock: Any,
        on_error: Callable[[OSError], BaseException],
        limit: int = QUEUE_LIMIT,
    ) -> None:
        self.io_lock = io_lock
        self._sock = sock
        self._on_error = on_error
        self._limit = limit
        self._queue: deque[list[bytes | memoryview]] = deque()  # thread-safe on its own
        # Held by the flusher, from taking the first batch to its last write: whoever
        # holds it is the only thread that takes from the queue and writes the socket.
        self._flushing = threading.Lock()
        # guards _successor; taken once per batch at most, never per message
        self._handover = threading.Lock()
        # The thread that takes over next waits on this (a held lock), until the
        # flusher releases it: then that thread holds the flusher's role.
        self._successor: threading.Lock | None = None
        self._error: Callable[[], BaseException] | None = None  # set once, by fail()

    @property
    def busy(self) -> bool:
        """A flusher is writing (so the connection is sending traffic)."""
        return self._flushing.locked()

    @property
    def queued(self) -> bool:
        """Something is appended and not yet taken by a flusher."""
        return bool(self._queue)

    def flush(self, timeout: float | None) -> None:
        """Return once everything queued before the call is written: take the flusher's
        role (waiting at most ``timeout``, else ``TimeoutError``) and write the queue.
        A legacy reader calls it before it reads, as a reply cannot come before its
        request is written."""
        if not self._queue and not self._flushing.locked():
            return
        self._take_role(timeout)
        self._flush()

    def fail(self, error: Callable[[], BaseException]) -> None:
        """Refuse every later send with ``error()`` and drop what is queued."""
        self._error = error
        self._queue.clear()

    def send(
        self,
        data: list[bytes | memoryview],
        *,
        number: Callable[[], Any] | None = None,
        timeout: float | None = None,
        block: bool = True,
    ) -> None:
        """Queue ``data`` (the frames of one message) after everything appended before,
        and write it unless a busy flusher will.

        ``number`` is called just before the append, so what it numbers (delivery
        tags) follows the write order, provided the caller orders its own sends (a
        channel does, with its lock). ``block=False`` (heartbeats, and the replies of
        the thread that reads) never waits: not for room, not to take over. Raises the
        connection's reason after :meth:`fail`, ``TimeoutError`` when the queue stayed
        full for ``timeout``, or the socket's error when this thread's write failed.
        """
        if self._error is not None:
            raise self._error()
        queue = self._queue
        if block and (len(queue) >= self._limit or sum(map(len, data)) >= LARGE):
            self._take_role(timeout)  # write it ourselves
            if self._error is not None:
                self._flushing.release()
                raise self._error()
            if number is not None:
                number()
            queue.append(data)
            self._flush()
            if self._error is not None:
                raise self._error()  # it may not have been written
            return
        if number is not None:
            number()
        queue.append(data)
        if self._flushing.acquire(False):
            self._flush()
        elif block and self._successor is None:
            self._offer_to_take_over()

    def _take_role(self, timeout: float | None) -> None:
        """Wait at most ``timeout`` to become the flusher, else ``TimeoutError``."""
        if not self._flushing.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError("write timed out: the socket is not draining")

    def _offer_to_take_over(self) -> None:
        """Another thread is flushing: wait (at most ``TAKE_OVER_WAIT``) to flush after
        it, unless a thread already offered."""
        if not self._handover.acquire(False):
            return  # the flusher is handing over right now: to someone else
        try:
            if self._successor is not None:
                return
            turn = self._successor = threading.Lock()
            turn.acquire()
        finally:
            self._handover.release()
        if not turn.acquire(timeout=TAKE_OVER_WAIT):
            with self._handover:
                handed = self._successor is not turn
                if not handed:
                    self._successor = None
            if not handed:
                # The flusher writes our message; but it may have finished just now.
                if self._queue and self._flushing.acquire(False):
                    self._flush()
                return
        # We hold the flusher's role now.
        if self._error is not None:
            self._flushing.release()
            raise self._error()  # what we queued was dropped with the connection
        self._flush()

    def _flush(self) -> None:
        """Write batches until nothing is queued or a successor takes over; called
        holding ``_flushing``, which it releases or hands over."""
        queue = self._queue
        while True:
            try:
                while queue and self._error is None:
                    self._write_batch(queue)
                    if self._successor is not None and queue and self._hand_over():
                        return  # the successor holds _flushing from here on
            except BaseException:
                if not self._hand_over():  # a successor learns of the failure at once
                    self._flushing.release()
                raise
            if self._successor is not None and self._hand_over():
                return  # nothing left, or the connection failed: the successor sees which
            self._flushing.release()
            # A thread that found us busy may have appended after our last look.
            if not queue or self._error is not None or not self._flushing.acquire(False):
                return

    def _write_batch(self, queue: deque[list[bytes | memoryview]]) -> None:
        chunks: list[bytes | memoryview] = []
        for _ in range(len(queue)):  # what is there now; later appends go in the next
            try:
                chunks += queue.popleft()
            except IndexError:  # fail() dropped the queue meanwhile
                break
        if not chunks or self._error is not None:
            return
        payload = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        try:
            with self.io_lock:
                self._sock.sendall(payload)
        except OSError as exc:
            raise self._on_error(exc) from exc

    def _hand_over(self) -> bool:
        """Pass the flusher's role (``_flushing``, still held) to the thread that
        offered to take over; False if it gave up meanwhile."""
        with self._handover:
            turn, self._successor = self._successor, None
        if turn is None:
            return False
        turn.release()
        return True
