"""``Connection``: py-amqp's, made safe to share between threads.

The mode is the connection's :class:`~drainer_amqp.reading.Reader`, chosen once with
``dedicated_drainer``: legacy (the default) or a :class:`~drainer_amqp.drainer.Drainer`.
Shared by both: waits registered before their request is written (:mod:`.waits`), one
group-committing :class:`~.writer.Writer`, an :class:`~.waits.Inbox` of user callbacks
for ``drain_events()``, and :meth:`Connection.end`, the one shutdown. The threading
contract: docs/threading.md.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import socket
import ssl
import threading
import weakref
from collections.abc import Callable
from time import monotonic, perf_counter
from types import SimpleNamespace
from typing import Any

import amqp
from amqp import spec
from amqp.exceptions import AMQPError, ConnectionForced, RecoverableConnectionError
from amqp.method_framing import frame_writer as amqp_frame_writer
from amqp.serialization import dumps

from .channel import CLOSE_TIMEOUT, Channel, first_short_string
from .deferred import Window
from .drainer import Drainer
from .encoding import PublishEncoder
from .errors import ConnectionBlocked, ConnectionClosedIntentionally, ConnectionLost, tag
from .framing import Frame
from .reading import LegacyReader, Reader
from .sync import Waiter, deadline_after
from .waits import Inbox, Waiters
from .writer import Writer

__all__ = ["CLOSE_TIMEOUT", "Connection"]

logger = logging.getLogger(__name__)

#: How long a publish waits while the broker has blocked the connection.
BLOCKED_TIMEOUT = 10.0
#: The heartbeat a drainer connection asks for when none is given (0 or None, kombu's
#: and py-amqp's default): RabbitMQ's own suggestion. The drainer makes heartbeats free,
#: and without them a publish-only connection dies unnoticed. ``heartbeat=False`` turns
#: them off; legacy mode keeps stock's default (none).
DRAINER_HEARTBEAT = 60
#: How many callbacks may wait for ``drain_events()`` before the drainer stops reading
#: (checked between socket reads, so one read's deliveries may go past it).
INBOX_LIMIT = 10_000
#: How many deferred publishes may await their confirm per connection before the next
#: ``basic_publish_deferred`` waits (first come, first served, up to its timeout).
MAX_UNCONFIRMED = 10_000

#: Methods still handled after we sent ``Connection.Close``: everything else is
#: discarded, as AMQP 0-9-1 requires.
_HANDLED_WHILE_CLOSING = frozenset((spec.Connection.Close, spec.Connection.CloseOk))


class Connection(amqp.Connection):
    """A py-amqp ``Connection`` that threads can share; see the module docstring.

    Extra keyword arguments (also kombu transport options): ``dedicated_drainer``,
    ``blocked_timeout`` (seconds a publish waits on a blocked connection, default 10),
    ``inbox_limit`` (callbacks queued before the drainer stops reading, 10000) and
    ``max_unconfirmed`` (deferred confirms outstanding, 10000); ``confirm_publish`` may
    be ``"deferred"`` (``basic_publish`` is then ``basic_publish_deferred``). With
    ``dedicated_drainer``, ``heartbeat`` defaults to :data:`DRAINER_HEARTBEAT` seconds
    (``heartbeat=False``: none). A connection made where Python refuses new threads (3.12,
    while the interpreter shuts down: an atexit handler) is in legacy mode, with a warning.
    """

    Channel = Channel
    channels: dict[int, Any] | None  # type: ignore[assignment]
    #: Called in the publishing thread with the seconds a confirmed publish took until
    #: the broker's answer and whether it was an ack (not a nack); quick, never raising.
    on_confirm: Callable[[float, bool], None] | None = None
    _transport: Any
    client_heartbeat: Any  # py-amqp's: the heartbeat asked for

    def __init__(
        self,
        *args: Any,
        dedicated_drainer: bool = False,
        blocked_timeout: float = BLOCKED_TIMEOUT,
        inbox_limit: int = INBOX_LIMIT,
        max_unconfirmed: int = MAX_UNCONFIRMED,
        **kwargs: Any,
    ) -> None:
        if not isinstance(dedicated_drainer, bool):
            raise TypeError(f"dedicated_drainer must be True or False, not {dedicated_drainer!r}")
        if not isinstance(blocked_timeout, (int, float)) or blocked_timeout < 0:
            raise ValueError(f"blocked_timeout must be seconds >= 0, not {blocked_timeout!r}")
        if not isinstance(inbox_limit, int) or inbox_limit < 0:
            raise ValueError(f"inbox_limit must be an int >= 0, not {inbox_limit!r}")
        if not isinstance(max_unconfirmed, int) or max_unconfirmed < 1:
            raise ValueError(f"max_unconfirmed must be an int >= 1, not {max_unconfirmed!r}")
        if dedicated_drainer and not _threads_can_start():
            logger.warning(
                "Python refuses new threads at interpreter shutdown: this connection reads "
                "in its callers' threads (legacy mode), as stock py-amqp does"
            )
            dedicated_drainer = False
        self.dedicated_drainer = dedicated_drainer
        self.blocked_timeout = float(blocked_timeout)
        # Deferred confirms outstanding, and how those settled ended (counted by the
        # thread that settles them: a read may be a confirm stale).
        self.unconfirmed = Window(max_unconfirmed)
        self.confirm_counts = {"acked": 0, "nacked": 0, "returned": 0, "failed": 0}
        self.reason: BaseException | None = None  # why it ended; written once by end()
        self._reported = False  # a caller was raised the reason (see connected); set once
        self.waiters = Waiters(on_add=self.reading_needed)
        # The mode: the one place that asks dedicated_drainer.
        self.reader: Reader = (
            Drainer(self, inbox_limit) if dedicated_drainer else LegacyReader(self)
        )
        self.inbox = Inbox(self.reader.inbox_limit, self.reader.wake, self.reader.resume_reading)
        # An event loop's thread reads the socket (see watch_in_event_loop); set by it.
        self.loop_reads = False
        self.writer: Writer | None = None
        # Encodes Basic.Publish as py-amqp's frame writer would, faster; None while not
        # connected or when the caller gave a frame_writer of its own.
        self.publish_encoder: PublishEncoder | None = None
        self._closed_ok: Waiter | None = None  # set by close() while it waits for CloseOk
        self._released = False  # reader, socket and channels let go; set once by _release
        self._lock_held = 0.0  # seconds the drainer held the transport lock (stats)
        self.messages_sent = 0  # publishes queued to the writer, under its lock (stats)
        # The thread dispatching frames now, under the transport lock. Its replies never
        # wait in the writer: in legacy mode the leader may be waiting for that lock.
        self.dispatching_thread: int | None = None
        self._init_locks()
        super().__init__(*args, **kwargs)
        if dedicated_drainer and self.client_heartbeat is not False and not self.client_heartbeat:
            self.client_heartbeat = DRAINER_HEARTBEAT
        # A caller's own frame_writer is kept: it encodes, the Writer sends.
        self._frame_writer_cls: Callable[..., Any] = self.frame_writer_cls  # type: ignore[has-type]
        self.frame_writer_cls = self._writer_for
        with _connections_lock:
            _connections.add(self)

    def _init_locks(self) -> None:
        # transport_lock guards py-amqp's reading state (held by whoever dispatches);
        # io_lock is held around each socket write. See the readers' new_locks().
        self.transport_lock, self.io_lock = self.reader.new_locks()
        self._state_lock = threading.Lock()  # guards reason: any thread, in end()
        self._channel_id_lock = threading.Lock()  # guards _used_channel_ids: channel openers
        self._encode_lock = threading.Lock()  # guards the encoder: each sender, per method
        self._close_lock = threading.Lock()  # one close() at a time: closing threads
        self._release_lock = threading.Lock()  # guards _released: releasing threads
        self._unblocked = threading.Event()  # clear while the broker blocks publishes
        self._unblocked.set()
        self._blocked_reason = ""

    # -- connecting ------------------------------------------------------------------------
    def _writer_for(self, connection: Connection, transport: Any) -> Callable[..., None]:
        """py-amqp's frame-writer hook, called at connect: frames are encoded by py-amqp's
        writer (or the caller's own ``frame_writer``) and sent whole by the Writer."""
        self._encoded: list[bytes | memoryview] = []  # what it wrote; under _encode_lock
        # A stand-in transport that keeps a copy (py-amqp's writer reuses its buffer).
        out = SimpleNamespace(write=lambda data: self._encoded.append(bytes(data)))
        self._encode = self._frame_writer_cls(connection, out)
        self.writer = Writer(transport.sock, self.io_lock, self._write_failed, self.waiters)
        return self._write_frame

    def _write_frame(
        self, type_: int, channel: int, method_sig: Any, args: Any, content: Any
    ) -> None:
        self.send_frames(channel, method_sig, args, content, type_=type_, block=type_ != 8)

    def send_frames(
        self,
        channel: int,
        method_sig: Any,
        args: Any,
        content: Any,
        *,
        take: Callable[[], Any] | None = None,
        timeout: float | None = None,
        type_: int = 1,
        block: bool = True,
        last: Callable[[], BaseException] | None = None,
        encoded: list[bytes | memoryview] | None = None,
        behind: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        """Encode one method (with its content, if any) and send its frames whole, after
        everything sent before; ``encoded``: its frames, encoded already (by
        ``publish_encoder``). See :meth:`Writer.send` for ``take``, ``block``, ``last``,
        ``behind``.

        The thread that dispatches what it read (the reader's replies, a done callback)
        never waits for another thread's write: that write may wait for this thread (the
        drainer's lead on a write behind, the legacy reader's transport lock), so its
        message goes out with the batch being written, or at once if there is none."""
        writer = self.writer
        if writer is None:
            raise self.error_for_caller()
        if block and self.dispatching_thread == threading.get_ident():
            block = False
        if encoded is None:
            with self._encode_lock:
                self._encode(type_, channel, method_sig, args, content)
                encoded, self._encoded = self._encoded, []
        else:
            self.bytes_sent += 1  # as py-amqp's frame writer: heartbeats watch it change
        writer.send(encoded, take=take, timeout=timeout, block=block, last=last, behind=behind)

    def connect(self, callback: Callable[[], Any] | None = None) -> Any:
        try:
            result = super().connect(callback)
        except AMQPError:
            self.collect()  # a refused login: py-amqp releases the socket only on OSError
            raise
        if self._frame_writer_cls is amqp_frame_writer and self.connected:
            self.publish_encoder = PublishEncoder(self.frame_max)  # frame_max as tuned
        if self.connected:
            try:
                self.reader.start(
                    self._transport.sock,
                    name=f"drainer-amqp-{self.host}",
                    frame_max=self.frame_max,
                    heartbeat=self.heartbeat or 0,
                )
            except BaseException:  # no thread (shutdown began meanwhile): no half-open socket
                self.collect()
                raise
            if self.reader.owns_socket and not isinstance(self._transport.sock, ssl.SSLSocket):
                # The drainer writes what is written behind (an SSLSocket cannot be
                # written without blocking and resumed safely).
                self.writer.flusher_wake = self.reader.wake  # type: ignore[union-attr]
        return result

    def _get_free_channel_id(self) -> int:
        with self._channel_id_lock:
            return super()._get_free_channel_id()

    def _claim_channel_id(self, channel_id: int) -> int:
        with self._channel_id_lock:
            return super()._claim_channel_id(channel_id)

    def channel(self, channel_id: int | None = None, callback: Any = None) -> Any:
        self.raise_if_ended()
        try:
            return super().channel(channel_id, callback)
        except (TypeError, AttributeError):
            if self.channels is None:  # released by another thread meanwhile
                raise self.error_for_caller() from None
            raise

    @property
    def connected(self) -> bool:  # type: ignore[override]
        """As py-amqp's: a failed connection reads as connected until a thread has been
        told of the failure (the next call raises it, so kombu's ``ensure()`` can revive
        its consumers instead of reconnecting silently); one being closed, until it is
        released (py-amqp's until its CloseOk: kombu's lazy ``connection`` in another
        thread then gives this one, whose calls raise ``ConnectionClosedIntentionally``,
        rather than open a new one that nobody closes); False once ``close()`` or
        ``collect()`` is done, and after a fork."""
        transport = self._transport
        if transport is None:
            return False
        if self.reason is None:
            return bool(transport.connected)
        return isinstance(self.reason, ConnectionClosedIntentionally) or not self._reported

    # -- the interface channels use ------------------------------------------------------
    def raise_if_ended(self) -> None:
        if self.reason is not None:
            raise self.error_for_caller()

    def error_for_caller(self, report: bool = True) -> BaseException:
        """A fresh copy of the reason, so each thread gets its own traceback. It names
        this connection (``drainer_connection``), so the kombu transport can tell
        which connection an error came from. ``report=False``: for a future that nobody
        may look at, so the failure is not counted as told (see ``connected``)."""
        reason = self.reason
        if reason is None:
            return RecoverableConnectionError("connection already closed")
        self._reported = self._reported or report
        error = copy.copy(reason)
        error.__cause__ = reason.__cause__
        tag(error, self)
        return error

    def wait_unblocked(self, timeout: float | None) -> None:
        """Before a publish: wait while the broker blocks this connection, at most
        ``min(timeout, blocked_timeout)``, then raise :class:`ConnectionBlocked`."""
        if self._unblocked.is_set():
            return
        limit = self.blocked_timeout if timeout is None else min(timeout, self.blocked_timeout)
        if not self._unblocked.wait(None if deadline_after(limit) is None else limit):
            raise ConnectionBlocked(
                f"the broker has blocked publishing on this connection "
                f"({self._blocked_reason or 'no reason given'}); waited {limit:g}s"
            )
        self.raise_if_ended()

    # -- ending: one path for every reason -------------------------------------------------
    def end(self, reason: BaseException, release_by: float | None = None) -> None:
        """The one shutdown, for every cause: a read, write or heartbeat failure, the
        broker's close, ``close()``, ``collect()``, a fork, a refused login. Records
        ``reason``, fails the writer, wakes every waiter; on a failure the reader stops
        and the socket goes; then the deferred publishes' futures fail (their done
        callbacks run in this thread); ``release_by``: reader, socket, channels
        released by then.

        The first reason wins: a failure stays the reason through a later ``close()`` or
        ``collect()`` (kombu's ``ensure()`` and ``switch()``), so other threads still see
        a recoverable error."""
        with self._state_lock:
            first = self.reason is None
            if first:
                self.reason = reason
        if first:
            if self.writer is not None:
                self.writer.fail(self.error_for_caller)
            self.waiters.end()
            self.unconfirmed.end()
            self.inbox.end()
            self._unblocked.set()
            if not isinstance(reason, ConnectionClosedIntentionally):
                # Now, not when kombu gets round to collect() (it may just drop the
                # connection): a thread blocked reading the socket wakes.
                self.reader.stop_reading()
            # Last: the futures' done callbacks run here, and may take their time; every
            # thread has been told already.
            self.waiters.fail_confirms()
        if release_by is not None:
            self._release(release_by)

    def as_connection_error(self, error: BaseException) -> BaseException:
        if isinstance(error, (AMQPError, ConnectionClosedIntentionally)):
            return error  # typed already: ours, or the broker's Connection.Close
        if isinstance(error, OSError):
            lost = ConnectionLost(f"connection to {self.host} lost: {error}")
        else:
            lost = ConnectionLost(f"connection to {self.host} failed: {error!r}")
        lost.__cause__ = error
        return lost

    def _write_failed(self, error: BaseException) -> BaseException:
        self.end(self.as_connection_error(error))
        return self.error_for_caller()

    def _close_socket(self, deadline: float | None = None, shutdown: bool = True) -> None:
        """Shut the socket down (waking a blocked reader or writer), then close it; no
        TLS ``unwrap`` (it would wait for the peer). Safe to call more than once."""
        transport = self._transport
        sock = getattr(transport, "sock", None)
        if transport is None or sock is None:
            return
        transport.connected = False
        if shutdown:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        # A legacy reader or a writer may be inside a socket call; after the shutdown it
        # returns at once, and then the descriptor can go.
        timeout = CLOSE_TIMEOUT if deadline is None else max(deadline - monotonic(), 0.0)
        locked = self.io_lock.acquire(timeout=timeout)
        try:
            transport.sock = None  # as py-amqp's close(): its repr() fails on a closed socket
            sock.close()
        finally:
            if locked:
                self.io_lock.release()

    def close(  # type: ignore[override]
        self,
        reply_code: int = 0,
        reply_text: str = "",
        method_sig: tuple[int, int] = (0, 0),
        argsig: str = "BsBB",
        *,
        timeout: float = CLOSE_TIMEOUT,
    ) -> None:
        """``Connection.Close``, then wait for ``CloseOk``, stop the reader and close the
        socket, all within ``timeout`` seconds (a tenth of it is kept for the last two);
        on a connection that ended already, only the release. From any thread,
        idempotent: docs/threading.md."""
        timeout = min(timeout, threading.TIMEOUT_MAX)
        deadline = monotonic() + timeout
        by = deadline - timeout / 10
        args = dumps(argsig, (reply_code, reply_text, method_sig[0], method_sig[1]))
        if self._send_close(args, timeout, by):
            self._finish_close(by, deadline)

    def _send_close(self, args: bytes, lock_timeout: float, write_by: float) -> bool:
        """close()'s first step: take the close lock (within ``lock_timeout``; False if
        another thread is closing, within its own bound, or the connection is released)
        and write ``Connection.Close`` (by ``write_by``) if the link is up. On True the
        caller owes :meth:`_finish_close`."""
        if not self._close_lock.acquire(timeout=max(lock_timeout, 0.0)):
            return False
        try:
            transport = self._transport
            if transport is None:
                self._close_lock.release()
                return False  # released already
            # A legacy reader blocked in a read holds the transport lock until the read
            # returns (maybe never): Connection.Close would wait for it; the shutdown in
            # end() cuts it short. Set first, is_closing keeps the others from reading.
            if self.reason is None and transport.connected:
                self._await_deferred_confirms(write_by)  # legacy: this thread reads them
                self.is_closing = True
                self.reading_needed()  # the CloseOk may come behind deliveries
            if self.is_closing and self.reason is None and not self.reader.reading:
                self._closed_ok = Waiter()
                try:
                    # After everything that returned before it; nothing can follow it.
                    sig, last = spec.Connection.Close, _closed_by_close
                    self.send_frames(0, sig, args, None, timeout=write_by - monotonic(), last=last)
                    self.end(_closed_by_close())
                except (OSError, AMQPError, TimeoutError, ConnectionClosedIntentionally):
                    self._closed_ok = None  # the link is going away either way
        except BaseException:
            self._close_lock.release()
            raise
        return True

    def _await_deferred_confirms(self, write_by: float) -> None:
        """Before the Close: give outstanding deferred confirms half the time left to
        arrive; those still out then fail with the close's reason."""
        if self.unconfirmed.used:
            try:
                self.reader.wait(self.unconfirmed, monotonic() + (write_by - monotonic()) / 2)
            except Exception:  # noqa: BLE001, S110 - a timeout or an end: close anyway
                pass

    def _finish_close(self, ok_by: float, deadline: float) -> None:
        """close()'s second step: wait for ``CloseOk`` until ``ok_by``, then release
        everything by ``deadline``, and the close lock."""
        try:
            closed_ok = self._closed_ok
            if closed_ok is not None:
                try:
                    self.reader.wait(closed_ok, ok_by, closing=True)
                except (OSError, AMQPError, TimeoutError, ConnectionClosedIntentionally):
                    pass  # the link is going away either way
            self.end(_closed_by_close(), deadline)
        finally:
            self._close_lock.release()

    def _on_close_ok(self) -> None:
        # CloseOk (the broker's, or ours to its Close): close() or end() tears down.
        closed_ok = self._closed_ok
        if closed_ok is not None:
            closed_ok(spec.Connection.CloseOk)

    def collect(self) -> None:
        """Tear down without the close handshake (kombu calls this after errors); a
        failure stays the reason, so kombu keeps retrying."""
        self.end(ConnectionClosedIntentionally("connection collected"), monotonic() + CLOSE_TIMEOUT)

    def _release(self, deadline: float) -> None:
        """Stop the reader, close the socket and channels; once per connection, whichever
        thread comes first (close(), collect(), the exit hook); a second waits for it."""
        if not self._release_lock.acquire(timeout=max(deadline - monotonic(), 0.0)):
            return  # another thread is releasing it, within its own bound
        try:
            if self._released:
                return
            self._released = True
            if not self.reader.stop(max(deadline - monotonic(), 0.0)):
                logger.warning("the drainer thread of %r did not stop in time", self)
            self._close_socket(deadline)
            self.inbox.close()
            with _connections_lock:
                _connections.discard(self)
            for channel in list((self.channels or {}).values()):
                if channel is not self:
                    channel.collect()
            with self._channel_id_lock:  # against a Channel.collect() in another thread
                self._transport = self.connection = self.channels = None  # type: ignore[assignment]
        finally:
            self._release_lock.release()

    # -- the drainer's sink ----------------------------------------------------------------
    def dispatch_frames(self, frames: list[Frame]) -> None:
        on_frame = self.on_inbound_frame
        with self.transport_lock:
            start = perf_counter()
            self.dispatching_thread = threading.get_ident()
            try:
                for frame in frames:
                    on_frame(frame)
            finally:
                self.dispatching_thread = None
                self._lock_held += perf_counter() - start

    def flush_writes(self) -> bool:
        writer = self.writer
        return writer is not None and writer.flush()

    def try_send_heartbeat(self) -> bool:
        if self.reason is not None or self.writer is None or self.writer.busy:
            return False  # a write is in progress: that is traffic too
        self.send_heartbeat()
        return True

    def reading_paused(self) -> bool:
        return self.inbox.full

    def consumer_behind(self) -> bool:
        """The consumer has callbacks queued, or an event loop reads the socket, and
        nobody waits for anything else the socket may hold (a reply, a confirm, the
        close): the drainer may leave it unread (``Drainer._defer_reading``)."""
        return bool(
            (self.loop_reads or len(self.inbox))
            and not len(self.waiters)
            and not self.unconfirmed.used
            and not self.is_closing
            and self.reason is None
        )

    def watch_inbox_empty(self, watch: bool) -> None:
        """Whether the inbox calls ``reader.resume_reading`` when it empties (not while
        an event loop reads the socket: its inbox empties after each read)."""
        self.inbox.wake_when_empty = watch and not self.loop_reads

    def reading_needed(self) -> None:
        """Something ``consumer_behind`` counts has begun (a waiter, a deferred confirm,
        the close): the drainer reads the socket again if it was leaving it unread."""
        if self.inbox.wake_when_empty or self.loop_reads:  # else it is not leaving it
            self.reader.resume_reading()

    def drainer_exited(self, error: BaseException | None) -> None:
        if error is not None:
            # The end of stream after the broker's CloseOk to close() (which may come
            # before close() records its reason) is the close's. Without that CloseOk it
            # is a failure, close() or not: a node that stops mid-close sends none, and
            # kombu retries only on a failure.
            closed_ok = self._closed_ok
            if self.is_closing and closed_ok is not None and closed_ok.ready():
                self.end(_closed_by_close())
            else:
                self.end(self.as_connection_error(error))
        if not isinstance(self.reason, ConnectionClosedIntentionally):
            self._close_socket()  # failed: let the socket go now (as end() does, by its reader)
        closed_ok = self._closed_ok
        if closed_ok is not None:
            closed_ok.fail()  # a close() in progress need not wait any longer

    # -- reading ---------------------------------------------------------------------------
    def on_inbound_method(
        self, channel_id: int, method_sig: tuple[int, int], payload: bytes, content: Any
    ) -> Any:
        if self.reason is not None and method_sig not in _HANDLED_WHILE_CLOSING:
            return None  # discarded after close, as the spec requires
        channels = self.channels  # one read: _release sets it to None
        channel = channels.get(channel_id) if channels is not None else None
        if channel is None:
            logger.debug("dropping %s for unknown channel %s", method_sig, channel_id)
            return None
        return channel.dispatch_method(method_sig, payload, content)

    def dispatch_method(self, method_sig: tuple[int, int], payload: bytes, content: Any) -> None:
        if method_sig == spec.Connection.Blocked:
            self._blocked_reason = first_short_string(payload)
            self._unblocked.clear()
            if self.reason is not None:  # end() set it meanwhile: nobody waits for Unblocked
                self._unblocked.set()
        elif method_sig == spec.Connection.Unblocked:
            self._unblocked.set()
        else:
            return super().dispatch_method(method_sig, payload, content)
        # on_blocked / on_unblocked are user code: they run in drain_events().
        self.inbox.post(None, super().dispatch_method, method_sig, payload, content)

    def drain_events(self, timeout: float | None = None) -> Any:
        """Run the next queued callback (a delivery, a return, ...) in this thread, or
        raise ``TimeoutError`` after ``timeout`` seconds. Legacy mode reads the socket
        while it waits; drainer mode sleeps until the drainer queues something."""
        if not self._handshake_complete:
            return super().drain_events(timeout)  # connect(): py-amqp's own handshake
        deadline = deadline_after(timeout)
        while True:
            self.reader.wait(self.inbox, deadline)
            self.raise_if_ended()
            if self.inbox.run_one(deadline):
                return True
            if deadline is not None and monotonic() >= deadline:
                raise TimeoutError()

    def inbox_fileno(self) -> int:
        """A descriptor that turns readable when callbacks are queued for
        ``drain_events()`` or the connection ends, for an event loop (kombu's Hub) to
        watch, beside the socket where :meth:`watch_in_event_loop` allows. After it
        fires, call :meth:`run_pending_callbacks`."""
        return self.inbox.signal().fileno()

    def watch_in_event_loop(self, watch: bool) -> int | None:
        """An event loop (kombu's Hub) starts (``watch``) or stops watching this
        connection. Drainer mode, not TLS: the socket's descriptor for the loop to watch
        beside :meth:`inbox_fileno`, calling :meth:`read_in_event_loop` when it is
        readable. The loop's thread reads the socket then, as stock py-amqp's loop does,
        and the drainer thread only while another thread waits for a reply, a confirm
        or the close (or for a moment every ``DEFER_FOR`` seconds); else None."""
        drainer, sock = self.reader, getattr(self._transport, "sock", None)
        if not watch and self.loop_reads:
            self.loop_reads = False
            drainer.resume_reading()
        if not isinstance(drainer, Drainer) or not drainer.may_lend_to_loop() or sock is None:
            return None
        if watch and not self.loop_reads:
            self.loop_reads = True
            drainer.wake()  # its next turn leaves the socket to the loop
        return sock.fileno()

    def read_in_event_loop(self) -> bool:
        """Read what the socket holds in this thread, an event loop's (see
        :meth:`watch_in_event_loop`), then run the queued callbacks. False when the
        read failed: the drainer thread ends the connection with its error, and the loop
        stops watching the socket (:meth:`inbox_fileno` tells it the end)."""
        if not isinstance(self.reader, Drainer) or not self.reader.read_for_loop():
            return False
        self.run_pending_callbacks()
        return True

    def run_pending_callbacks(self) -> int:
        """Run every queued callback in this thread without waiting; return how many.
        Raises the connection's error if it has ended."""
        self.inbox.signal().clear()
        done = 0
        while True:
            self.raise_if_ended()
            if not self.inbox.run_one(monotonic()):
                return done
            done += 1

    # -- heartbeats ------------------------------------------------------------------------
    def heartbeat_tick(self, rate: int = 2) -> None:
        """Legacy: py-amqp's. Drainer mode: the drainer owns heartbeats; this only
        raises the connection's failure, if any."""
        if not self.reader.owns_socket:
            try:
                return super().heartbeat_tick(rate)
            except ConnectionForced as exc:  # heartbeats missed
                self.end(exc)
                raise
        if self.reason is not None and not isinstance(self.reason, ConnectionClosedIntentionally):
            raise self.error_for_caller()

    # -- introspection ---------------------------------------------------------------------
    def drainer_stats(self) -> dict[str, float | int | bool]:
        """Plain numbers to log: what the drainer read and sent, and who is waiting."""
        return {
            "dedicated_drainer": self.dedicated_drainer,
            "lock_held_seconds": self._lock_held,
            "waiting_threads": len(self.waiters),
            "messages_sent": self.messages_sent,
            "pending_callbacks": len(self.inbox),
            "reading_paused": self.inbox.full,
            "blocked": not self._unblocked.is_set(),
            "confirms_outstanding": self.unconfirmed.used,
            **{f"confirms_{outcome}": n for outcome, n in self.confirm_counts.items()},
            **self.reader.stats(),
        }

    def __repr__(self) -> str:
        mode = "drainer" if self.dedicated_drainer else "legacy"
        state = "ended" if self.reason is not None else "open" if self.connected else "new"
        return f"<drainer_amqp.Connection {self.host} {mode} {state} at {id(self):#x}>"

    # -- fork ------------------------------------------------------------------------------
    def _after_fork_in_child(self) -> None:
        """The child has no drainer thread and shares the parent's socket: fail the
        connection through the one end path, and close this process's copy of the
        descriptor without a shutdown (that would end the parent's link too)."""
        self._init_locks()
        channels = [c for c in (self.channels or {}).values() if isinstance(c, Channel)]
        for channel in channels:
            channel.after_fork()
        self.waiters.reset()  # and every channel's confirms
        self.inbox.reset()
        self.unconfirmed = Window(self.unconfirmed.size)  # its lock may be held by a parent thread
        self.reader.after_fork()  # a drainer's thread does not exist here; its pipe does
        self.writer = None  # its lock may be held by a parent thread that is gone
        self._close_socket(monotonic(), shutdown=False)  # before end(), which shuts it down
        inherited = f"connection to {self.host} was inherited by a forked process; reconnect"
        self.end(ConnectionLost(f"{inherited} in the child"), monotonic())
        for channel in channels:  # deferred publishes the dropped writer still held
            for future in list(channel._deferred):
                future.fail()


#: Every open connection, for the fork and exit hooks and the metrics. Guarded by
#: _connections_lock (connections open and close in any thread); a collected one leaves
#: by itself (WeakSet defers that while it is iterated).
_connections: weakref.WeakSet[Connection] = weakref.WeakSet()
_connections_lock = threading.Lock()


def _threads_can_start() -> bool:
    """Whether this process may start a thread: not while the interpreter shuts down on
    Python 3.12, which refuses new threads then (an atexit handler that connects). Tried
    only once the main thread has ended, with a thread that returns at once."""
    if threading.main_thread().is_alive():
        return True
    probe = threading.Thread(target=int, name="drainer-amqp-probe", daemon=True)
    try:
        probe.start()
    except RuntimeError:
        return False
    probe.join(CLOSE_TIMEOUT)
    return True


def open_connections() -> list[Connection]:
    """A snapshot of every open connection (safe from any thread)."""
    with _connections_lock:
        return list(_connections)


def _closed_by_close() -> ConnectionClosedIntentionally:
    return ConnectionClosedIntentionally("connection closed by close()")


@atexit.register
def _close_at_exit() -> None:
    """An exit without ``close()`` closes what is open, all within ``CLOSE_TIMEOUT``: a
    broker whose connection drops may lose publishes it has read but not yet routed.

    Every connection's ``Connection.Close`` is written first, each write bounded by its
    share of the time left, then every ``CloseOk`` is awaited (they arrive together), so
    one stalled broker costs the others nothing; connections opened meanwhile are
    closed in the same way while time is left. A connection whose close fails is logged
    and left: the others are closed still. No thread is started (Python 3.12 refuses one
    at exit)."""
    deadline = monotonic() + CLOSE_TIMEOUT
    ok_by = deadline - CLOSE_TIMEOUT / 10  # as close(): a tenth to release
    args = dumps("BsBB", (0, "", 0, 0))
    seen: set[Connection] = set()
    while monotonic() < deadline and (opened := [c for c in open_connections() if c not in seen]):
        closing = []
        for i, conn in enumerate(opened):
            seen.add(conn)
            share = max(ok_by - monotonic(), 0.0) / (len(opened) - i)
            try:
                if conn._send_close(args, share, monotonic() + share):
                    closing.append(conn)
            except Exception:
                logger.warning("closing %r at exit failed", conn, exc_info=True)
        for conn in closing:
            try:
                conn._finish_close(ok_by, deadline)
            except Exception:
                logger.warning("closing %r at exit failed", conn, exc_info=True)


def _after_fork_in_child() -> None:
    global _connections_lock
    _connections_lock = threading.Lock()  # a parent thread may have held it
    for conn in open_connections():
        conn._after_fork_in_child()
    _connections.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
