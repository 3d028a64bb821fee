"""Who reads the socket: the mode of a connection, its one seam between the two.

A thread that needs something from the broker (a reply, a confirm, a queued callback)
registers an :class:`~drainer_amqp.sync.Awaitable` and calls ``reader.wait(it,
deadline)``. Legacy mode (:class:`LegacyReader`): the waiting thread reads frames itself,
under the transport lock, until its awaitable is ready, as stock py-amqp does; whoever
reads a frame dispatches it. Drainer mode: :class:`~drainer_amqp.drainer.Drainer`.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable
from time import monotonic
from typing import Any, Protocol

from amqp.exceptions import UnexpectedFrame

from .errors import CannotWaitInReadingThread
from .framing import FRAME_END, HEADER_SIZE, Frame, check_header
from .sending import readable
from .sync import Awaitable, FairRLock

__all__ = ["LegacyReader", "Reader", "refuse_wait_in_dispatch"]

#: How far past its deadline one socket read may wait in legacy mode (seconds).
TIMEOUT_SLACK = 0.001
#: How long the read before a legacy publish may wait for the rest of a frame that has
#: begun to arrive (seconds).
BEFORE_PUBLISH_WAIT = 0.001
#: A legacy publish looks at the socket at most this often (seconds): the look costs
#: a system call, and an end that came within it is one still on its way.
BEFORE_PUBLISH_EVERY = 0.0001


class Reader(Protocol):
    """A connection's mode: who reads its socket. ``Connection`` picks one when it is
    made and asks nothing else about the mode."""

    #: A thread of its own reads and sends heartbeats (kombu's Hub watches the inbox).
    owns_socket: bool
    inbox_limit: int  #: callbacks queued for drain_events() before reading pauses (0: none)

    @property
    def reading(self) -> bool:
        """A caller's thread is in a read only the socket's shutdown cuts short (legacy)."""

    def new_locks(self) -> tuple[Any, Any]:
        """New locks: the transport lock (py-amqp's reading state), the writer's io_lock."""

    def start(self, sock: socket.socket, *, name: str, frame_max: int, heartbeat: float) -> None:
        """The handshake is done: reading may begin."""

    def wait(self, awaitable: Awaitable, deadline: float | None, closing: bool = False) -> None:
        """Return once ``awaitable`` is ready; ``TimeoutError`` at ``deadline``. Raises
        the connection's reason if it ended (unless ``closing``: close() waits for
        CloseOk after the end)."""

    def before_publish(self) -> None:
        """A publish is about to be written: raise the connection's end if the broker
        has ended it meanwhile (legacy mode reads what is waiting to find out)."""

    def wake(self) -> None:
        """The inbox has room again."""

    def resume_reading(self) -> None:
        """Read the socket again now: the consumer has caught up, or a thread waits for a
        reply (safe from any thread)."""

    def stop_reading(self) -> None:
        """The connection failed: let the socket go now (a thread reading it wakes)."""

    def stop(self, timeout: float) -> bool:
        """Stop reading; whether that happened within ``timeout`` seconds."""

    def after_fork(self) -> None:
        """In a forked child: release what the parent's reader left here (its thread,
        and the locks that thread may have held, are not here)."""

    def stats(self) -> dict[str, float | int | bool]: ...


class LegacyConnection(Protocol):
    """What :class:`LegacyReader` uses of its :class:`drainer_amqp.Connection`."""

    _transport: Any  # py-amqp's, read under transport_lock; None once released
    transport_lock: Any
    dispatching_thread: int | None  # the thread dispatching now, under transport_lock
    is_closing: bool
    reason: BaseException | None  # why it ended, once it has
    frame_max: int
    on_inbound_frame: Callable[[Any], Any]

    def raise_if_ended(self) -> None: ...
    def end(self, reason: BaseException, release_by: float | None = None) -> None: ...
    def as_connection_error(self, error: BaseException) -> BaseException: ...
    def error_for_caller(self) -> BaseException: ...
    def _close_socket(self) -> None: ...


class LegacyReader:
    """Legacy mode: the thread that holds the transport lock reads."""

    owns_socket = False
    inbox_limit = 0

    def __init__(self, connection: LegacyConnection) -> None:
        self._conn = connection
        self._looked = 0.0  # when a publish last looked at the socket (monotonic)

    @property
    def reading(self) -> bool:
        return self._conn.dispatching_thread is not None  # only this reader dispatches in legacy

    def new_locks(self) -> tuple[Any, Any]:
        # The transport lock, handed over in turn, also guards writes: a reader changes
        # the socket's timeout, so nobody may write meanwhile.
        lock = FairRLock()
        return lock, lock

    def start(self, sock: socket.socket, *, name: str, frame_max: int, heartbeat: float) -> None:
        pass  # callers' threads read

    def wake(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def stop_reading(self) -> None:
        self._conn._close_socket()

    def stop(self, timeout: float) -> bool:
        return True

    def after_fork(self) -> None:
        pass

    def stats(self) -> dict[str, float | int | bool]:
        return {"running": False}

    def wait(self, awaitable: Awaitable, deadline: float | None, closing: bool = False) -> None:
        conn = self._conn
        lock = conn.transport_lock
        if not closing and not awaitable.ready():
            # A read here would run inside the dispatch that called it, and writes wait
            # for the lock that dispatch holds.
            refuse_wait_in_dispatch(conn.dispatching_thread)
        while not awaitable.ready():
            if not closing and conn.reason is not None and not awaitable.ready():
                raise conn.error_for_caller()  # a reply read before the end still counts
            if not lock.acquire(blocking=False):
                remaining = None if deadline is None else max(deadline - monotonic(), 0.0)
                if not lock.acquire(timeout=-1 if remaining is None else remaining):
                    raise TimeoutError()
            try:
                if awaitable.ready():
                    return  # another reader filled it while we waited for the lock
                stand_by = self._read(awaitable, deadline, closing)
            finally:
                lock.release()
            if stand_by:
                awaitable.wait(None if deadline is None else max(deadline - monotonic(), 0.0))
            if deadline is not None and not awaitable.ready() and monotonic() >= deadline:
                raise TimeoutError()

    def before_publish(self) -> None:
        """As stock py-amqp's ``drain_events(timeout=0)`` before each publish: when the
        socket has something to read and no thread reads or writes it now, read and
        dispatch what is there. An end of stream, or the broker's Connection.Close, then
        ends the connection, and the publish raises it (kombu republishes on a new
        connection) rather than being written into a link the broker has let go of,
        and lost. A thread that reads now sees the end itself. At most every
        ``BEFORE_PUBLISH_EVERY``: a burst of publishes looks once."""
        now = monotonic()
        if now - self._looked < BEFORE_PUBLISH_EVERY:
            return
        self._looked = now  # several threads at once: a look more, no harm
        conn = self._conn
        transport = conn._transport
        if transport is None or conn.reason is not None or conn.dispatching_thread is not None:
            return  # ended (the publish raises why), or a thread reads now
        sock = transport.sock
        if sock is None or not readable(sock):
            return
        lock = conn.transport_lock
        if not lock.acquire(blocking=False):
            return  # a reader or a writer has the socket
        try:
            if conn.reason is None:
                self._read(_NOTHING, now + BEFORE_PUBLISH_WAIT, False)
        except TimeoutError:
            pass  # a frame begun and not complete yet: the next read takes it
        finally:
            lock.release()

    def _read(self, awaitable: Awaitable, deadline: float | None, closing: bool) -> bool:
        """Under the transport lock: read frames (see :func:`read_frames`) and dispatch
        them. True when close() is under way and the caller should wait for it instead;
        a failed read ends the connection, and raises its reason (unless ``closing``)."""
        conn = self._conn
        try:
            if not closing and conn.reason is not None:
                raise conn.error_for_caller()
            conn.dispatching_thread = threading.get_ident()
            try:
                # close() sets is_closing, then asks whether we read: one of us sees
                # the other. It writes Connection.Close under this lock, then ends
                # the connection, which fills awaitable: wait for that, not the socket.
                if conn.is_closing and not closing:
                    return True
                read_frames(conn, awaitable, conn.transport_lock, deadline)
            finally:
                conn.dispatching_thread = None
        except TimeoutError:
            raise TimeoutError() from None
        except Exception as exc:  # noqa: BLE001 - any read failure ends the connection
            conn.end(conn.as_connection_error(exc))
            if closing:
                return False
            raise conn.error_for_caller() from exc
        return False


def refuse_wait_in_dispatch(dispatching_thread: int | None) -> None:
    """Both modes, before a wait for what the connection reads: in the thread that is
    dispatching what it read (a done callback of a deferred publish runs there), raise
    ``CannotWaitInReadingThread``; that wait would be for itself."""
    if dispatching_thread == threading.get_ident():
        raise CannotWaitInReadingThread(
            "this thread reads the connection (a done callback of a deferred publish): "
            "it cannot wait here for what only it would read"
        )


class _Nothing:
    """An awaitable that is never ready: read what is there, and stop."""

    def ready(self) -> bool:
        return False

    def wait(self, timeout: float | None) -> bool:
        return False


_NOTHING = _Nothing()


def read_frames(
    conn: LegacyConnection, awaitable: Awaitable, lock: FairRLock, deadline: float | None
) -> None:
    """Legacy, under the transport lock: read frames with py-amqp's transport and dispatch
    them; at least one (even at the deadline), then on while ``awaitable`` is not ready,
    nobody waits for ``lock`` and ``deadline`` is not reached (one turn per message, not
    per frame). The socket's timeout is the time left, as in py-amqp's ``having_timeout``,
    set again before each read of a frame's header and of its payload (only when it would
    run ``TIMEOUT_SLACK`` past the deadline: each setting is a system call), and is
    restored after."""
    transport = conn._transport  # not py-amqp's .transport, which connects when it is None
    if transport is None:
        raise conn.error_for_caller()
    sock = transport.sock
    previous = current = sock.gettimeout()

    def rearm() -> None:
        nonlocal current
        assert deadline is not None
        left = deadline - monotonic()
        if current is None or not current - TIMEOUT_SLACK < left <= current:
            current = max(left, 0.0)
            sock.settimeout(current)

    timed = None if deadline is None else rearm
    now = monotonic()
    try:
        while True:
            if deadline is not None:  # rearm(), inline: a call per frame costs more here
                left = deadline - now
                if current is None or not current - TIMEOUT_SLACK < left <= current:
                    current = max(left, 0.0)
                    sock.settimeout(current)
            conn.on_inbound_frame(read_frame(transport, conn.frame_max, timed))
            if awaitable.ready() or lock.contended:
                return
            if deadline is not None:
                now = monotonic()
                if now >= deadline:
                    return
    except (ssl.SSLWantReadError, BlockingIOError):  # a timeout of 0
        raise TimeoutError() from None
    finally:
        if current != previous:
            sock.settimeout(previous)


def read_frame(
    transport: Any, frame_max: int, before_payload: Callable[[], None] | None = None
) -> Frame:
    """Read one frame with py-amqp's ``transport``.

    As py-amqp's ``read_frame`` (exact reads, so nothing the frame does not hold is taken
    from the socket: a ``select`` on it still sees what follows), except that the header
    is checked (:func:`~drainer_amqp.framing.check_header`) before the payload is read, so
    a bogus size fails at once instead of waiting for (and buffering) that many bytes,
    and the payload and its frame-end byte are read together. ``before_payload`` is
    called between the two reads (it sets the socket's timeout to the time left).
    """
    header = transport._read(HEADER_SIZE, True)  # a timeout here keeps what it read
    frame_type, channel, size = check_header(header, frame_max)
    try:
        if before_payload is not None:
            before_payload()
        rest = transport._read(size + 1)
    except BaseException:  # a timeout, an interrupt: py-amqp's _read keeps what it read
        transport._read_buffer = header + transport._read_buffer  # read again next time
        raise
    if rest[size] != FRAME_END:
        raise UnexpectedFrame(f"Received frame_end {rest[size]:#04x} while expecting 0xce")
    return frame_type, channel, rest[:size]
