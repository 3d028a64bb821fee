"""The write side of a connection's socket, shared by every thread (group commit).

A thread with a complete message (all its frames, already encoded) calls
:meth:`Writer.send`. If no other thread is writing, it becomes the flusher: it writes
its bytes and everything other threads appended meanwhile, in one ``sendall`` per
batch, until nothing is pending. If a flusher is busy, the thread appends its bytes and
waits until the flusher has written them. So the frames of one message stay contiguous,
messages go out in the order they were appended, ``send`` returns once its bytes are in
the socket (as a plain ``sendall`` would), and a busy socket costs one system call per
batch instead of one per message.

The pending buffer is bounded: when it holds more than ``limit`` bytes, appending waits
(bounded by the caller's timeout) for the flusher to make room, instead of growing.
After :meth:`fail`, every ``send`` raises the connection's reason.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from time import monotonic
from typing import Any

__all__ = ["Writer"]

#: Default bound on bytes appended but not yet written.
PENDING_LIMIT = 4 * 1024 * 1024


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
        limit: int = PENDING_LIMIT,
    ) -> None:
        self.io_lock = io_lock
        self.bytes_written = 0  # flusher only
        self._sock = sock
        self._on_error = on_error
        self._limit = limit
        # guards _pending, _pending_bytes, _appended, _written, _flushing, _error
        self._mutex = threading.Lock()
        # notified when the flusher takes a batch (room) and when it wrote one (written)
        self._room = threading.Condition(self._mutex)
        self._pending: list[bytes | memoryview] = []
        self._pending_bytes = 0
        self._sleepers = 0  # threads in _room.wait: notify only when someone listens
        self._appended = 0  # messages appended so far
        self._written = 0  # messages handed to the socket so far
        self._flushing = False
        self._error: Callable[[], BaseException] | None = None

    @property
    def busy(self) -> bool:
        """A flusher is writing (so the connection is sending traffic)."""
        return self._flushing

    def fail(self, error: Callable[[], BaseException]) -> None:
        """Refuse every later send with ``error()`` and wake threads waiting for room."""
        with self._mutex:
            self._error = error
            self._pending.clear()
            self._notify()

    def send(
        self,
        data: list[bytes | memoryview],
        *,
        number: Callable[[], Any] | None = None,
        timeout: float | None = None,
        block: bool = True,
    ) -> None:
        """Write ``data`` (the frames of one message) after everything appended before.

        ``number`` is called under the writer's lock just before the append, so what it
        numbers (delivery tags) follows the write order. ``block=False`` appends even
        when the buffer is over its limit, and returns at once when another thread is
        flushing (heartbeats, and the replies of the thread that reads). Raises the
        connection's reason after :meth:`fail`, ``TimeoutError`` when no room came
        within ``timeout``, or the socket's error when this thread's write failed.
        """
        size = sum(len(d) for d in data)
        deadline = None if timeout is None else monotonic() + timeout
        with self._mutex:
            if block and self._flushing and self._pending_bytes + size > self._limit:
                while self._error is None and self._flushing and self._pending_bytes:
                    self._wait(deadline, "write buffer full: the socket is not draining")
            if self._error is not None:
                raise self._error()
            if number is not None:
                number()
            self._appended += 1
            mine = self._appended
            self._pending.extend(data)
            self._pending_bytes += size
            if self._flushing:
                if not block:
                    return  # a heartbeat: the flusher will write it
                while self._written < mine and self._error is None:
                    if not self._flushing:  # the last flusher failed before our batch
                        break
                    self._wait(deadline, "write timed out: the socket is not draining")
                if self._written >= mine:
                    return
                if self._error is not None:
                    raise self._error()
            self._flushing = True
        self._flush()

    def _wait(self, deadline: float | None, message: str) -> None:
        remaining = None if deadline is None else deadline - monotonic()
        if remaining is not None and remaining <= 0:
            raise TimeoutError(message)
        self._sleepers += 1
        try:
            self._room.wait(remaining)
        finally:
            self._sleepers -= 1

    def _notify(self) -> None:
        if self._sleepers:
            self._room.notify_all()

    def _flush(self) -> None:
        """Write batches until nothing is pending; the flusher's thread only."""
        with self._mutex:
            batch, last = self._take()
        while batch:
            payload = batch[0] if len(batch) == 1 else b"".join(batch)
            try:
                with self.io_lock:
                    self._sock.sendall(payload)
            except OSError as exc:
                with self._mutex:
                    self._flushing = False
                    self._notify()
                raise self._on_error(exc) from exc
            self.bytes_written += len(payload)
            with self._mutex:
                self._written = last
                batch, last = self._take()
                self._notify()

    def _take(self) -> tuple[list[bytes | memoryview], int]:
        """Under the mutex: the next batch (empty: the flusher's turn ends)."""
        batch, self._pending = self._pending, []
        self._pending_bytes = 0
        if not batch or self._error is not None:
            self._flushing = False
            return [], self._appended
        return batch, self._appended
