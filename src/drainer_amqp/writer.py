"""The write side of a connection's socket, shared by every thread (group commit).

A thread with a complete message (all its frames, already encoded) calls
:meth:`Writer.send`. Messages go out whole, in the order they were queued, and:

* **Returned means written.** ``send`` returns once the message's bytes are in the
  socket (``sendall`` returned), never before. So anything a thread does after it (a
  ``close()``, an exit) comes after the message on the wire, and a link failure loses
  only what the kernel had accepted, as with stock py-amqp.
* **One writer at a time, in turns.** If nobody is writing, the caller becomes the
  *leader* and writes its own message. Otherwise it joins the queue and sleeps. When
  a leader's write is done, it hands the whole queue to the first waiter in it, who
  writes that queue as one batch (one ``sendall``), and so on; then it wakes every
  waiter whose message it wrote (the next write need not wait for those wake-ups).
  First come, first served: a call waits for at most the batch being written, then its
  own batch is written (by itself or by the leader ahead of it). Nobody waits behind a
  stream of newcomers, and a leader writes its own batch, then at most the replies
  nobody waits for, before it returns.
* **A failure reaches every waiter at once.** :meth:`fail` makes every queued message
  raise the connection's reason (none of them was written) and every later ``send``
  raise it; the leader's write of its batch either ends (written: those calls return)
  or fails (the socket was shut down: they raise).
* **A last message.** ``send(..., last=error)`` queues a message (``Connection.Close``)
  and refuses every later ``send`` with ``error()`` in the same step, so nothing can be
  written behind it and reported as sent.

``block=False`` (heartbeats, and the replies of the thread that reads) never sleeps:
the message is queued for the leader, or written at once when nobody is writing.

The queue holds at most one waiting message per thread, plus those replies, so it
needs no bound of its own.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Writer"]

_QUEUED, _WRITTEN, _FAILED, _LEAD = range(4)


class _Message:
    """One queued message and the wake-up of the thread that waits for it."""

    __slots__ = ("chunks", "state", "batch", "_signal")

    def __init__(self, chunks: list[bytes | memoryview], waits: bool) -> None:
        self.chunks = chunks
        self.state = _QUEUED  # written under the writer's lock, or by the leader
        self.batch: list[_Message] = []  # what to write, when handed the lead
        self._signal: threading.Lock | None = None
        if waits:
            self._signal = threading.Lock()
            self._signal.acquire()

    @property
    def waits(self) -> bool:
        return self._signal is not None

    def wake(self, state: int) -> None:
        self.state = state
        if self._signal is not None:
            self._signal.release()

    def wait(self, timeout: float | None) -> bool:
        assert self._signal is not None
        return self._signal.acquire(timeout=-1 if timeout is None else max(timeout, 0.0))


class Writer:
    """Writes whole messages to ``sock`` in order; safe from any thread.

    ``io_lock`` is held around each ``sendall``: in legacy mode it is the transport lock
    (a legacy reader changes the socket's timeout, so nobody may write meanwhile), in
    drainer mode a lock of its own that only TLS reads share (an ``SSLSocket`` may not
    be read and written at once). ``on_error`` turns a socket error into the
    connection's reason (ending the connection, which calls :meth:`fail`) and returns
    the error to raise.
    """

    def __init__(
        self,
        sock: socket.socket,
        io_lock: Any,
        on_error: Callable[[BaseException], BaseException],
    ) -> None:
        self.io_lock = io_lock
        self._sock = sock
        self._on_error = on_error
        # Guards _queue, _leading and _error. Held to queue a message or to hand the
        # lead over; never across a write or a wait. Taken by every sending thread.
        self._lock = threading.Lock()
        self._queue: list[_Message] = []
        self._leading = False  # a thread holds the lead: it writes, or is about to
        self._error: Callable[[], BaseException] | None = None  # set by fail() or a last send

    @property
    def busy(self) -> bool:
        """A leader is writing (so the connection is sending traffic)."""
        return self._leading

    def fail(self, error: Callable[[], BaseException]) -> None:
        """Refuse every later send with ``error()``; every queued message raises it."""
        with self._lock:
            self._error = error
            queued, self._queue = self._queue, []
        for message in queued:
            message.wake(_FAILED)

    def send(
        self,
        data: list[bytes | memoryview],
        *,
        number: Callable[[], Any] | None = None,
        timeout: float | None = None,
        block: bool = True,
        last: Callable[[], BaseException] | None = None,
    ) -> None:
        """Write ``data`` (the frames of one message) after everything queued before it;
        return once it is written.

        ``number`` is called as the message takes its place in the queue, so what it
        numbers (delivery tags) follows the write order. ``block=False``: return at once
        if another thread is writing (the message goes out with its batch). ``last``:
        refuse every later send with ``last()``. Raises the connection's reason when it
        failed before the message was written, ``TimeoutError`` when the message waited
        ``timeout`` without being written (it was not, unless the error says it may
        have been), or the socket's error when this thread's write failed.
        """
        message = _Message(data, block)
        with self._lock:
            if self._error is not None:
                raise self._error()
            if number is not None:
                number()
            if last is not None:
                self._error = last
            lead = not self._leading
            if lead:
                self._leading = True
            else:
                self._queue.append(message)  # from here on only the leaders touch it
        if lead:
            self._lead([message], message)
        elif block:
            self._await_turn(message, timeout)

    def _await_turn(self, message: _Message, timeout: float | None) -> None:
        """Sleep until ``message`` is written (return), failed (raise), or handed the
        lead (write its batch)."""
        if not message.wait(timeout):
            with self._lock:
                try:
                    self._queue.remove(message)
                except ValueError:
                    pass  # taken into a batch: being written, or handed to us to write
                else:
                    raise TimeoutError("write timed out: the socket is not draining")
            if message.state == _QUEUED:  # not yet written, failed or handed the lead
                raise TimeoutError(
                    "write timed out while its batch was being written: it may have been"
                )
        if message.state == _FAILED:
            assert self._error is not None  # on_error ends the connection: fail() ran
            raise self._error()
        if message.state == _LEAD:
            self._lead(message.batch, message)

    def _lead(self, batch: list[_Message], mine: _Message) -> None:
        """Write ``batch`` (which holds ``mine``), hand the queue to the first waiter in
        it (or write it too, if nobody in it waits; release the lead when nothing is
        queued), then wake the batch's waiters."""
        while True:
            try:
                self._write(batch)
            except BaseException:
                with self._lock:
                    self._leading = False
                    queued, self._queue = self._queue, []
                for message in batch + queued:
                    if message is not mine:
                        message.wake(_FAILED)
                raise
            written = batch
            with self._lock:
                batch, self._queue = self._queue, []
                successor = next((m for m in batch if m.waits), None)
                if successor is not None:
                    successor.batch = batch
                    successor.state = _LEAD
                elif not batch:
                    self._leading = False
            if successor is not None:
                successor.wake(_LEAD)
            for message in written:
                if message is not mine:
                    message.wake(_WRITTEN)
            if successor is not None or not batch:
                return

    def _write(self, batch: list[_Message]) -> None:
        chunks = [chunk for message in batch for chunk in message.chunks]
        payload = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        try:
            with self.io_lock:
                self._sock.sendall(payload)
        except OSError as exc:
            raise self._on_error(exc) from exc
        except BaseException as exc:  # interrupted mid-write: the stream may end mid-frame
            self._on_error(exc)
            raise
