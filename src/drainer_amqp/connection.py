"""``Connection``: py-amqp's, made safe to share between threads.

Two modes, chosen per connection with ``dedicated_drainer``:

Legacy (``False``, the default)
    py-amqp's behaviour made thread-safe. One transport lock serialises the socket: a
    thread in ``drain_events()`` holds it for its whole blocking read, so other
    threads' publishes wait behind it. Heartbeats are the caller's job
    (``heartbeat_tick``), as with stock py-amqp.

Drainer (``True``)
    After the handshake, a :class:`~drainer_amqp.drainer.Drainer` thread owns the
    socket's reading side. It dispatches complete frames under the transport lock:
    replies and confirms wake the thread waiting for them; deliveries, returns,
    broker-side cancels, blocked/unblocked notices and ``basic_ack`` events are
    queued for the threads that call ``drain_events()``, which run those callbacks.

Threading contract (both modes)
    * Publishing and synchronous methods may be called from any thread, each thread
      on its own channel. Publisher confirms are matched by delivery tag, so several
      threads may wait for confirms on one shared channel; other synchronous methods
      on one channel must not be called by two threads at once (AMQP replies carry
      no correlation id).
    * User callbacks run in the thread that called ``drain_events()``, never in the
      drainer; with several draining threads they run one at a time, in arrival order.
    * ``close()`` and ``collect()`` are idempotent and safe from any thread. They wake
      every waiting thread with :class:`ConnectionClosedIntentionally`.
    * A failed link (reset, EOF, heartbeat timeout, malformed frame, broker close)
      wakes every waiting thread at once with the same error, and every later call
      raises it immediately.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import threading
import weakref
from collections import deque
from collections.abc import Callable
from time import monotonic, perf_counter
from typing import Any

import amqp
from amqp import spec
from amqp.abstract_channel import AbstractChannel
from amqp.exceptions import AMQPError, RecoverableConnectionError
from amqp.method_framing import frame_writer as amqp_frame_writer

from .channel import Channel, _Reply
from .drainer import Drainer
from .errors import ConnectionClosedIntentionally, ConnectionLost
from .framing import Frame
from .locks import FairRLock

__all__ = ["Connection"]

logger = logging.getLogger(__name__)

#: Upper bound on how long ``close()`` waits for the broker's ``Connection.CloseOk``
#: and for the transport lock, and on joining the drainer thread.
CLOSE_TIMEOUT = 5.0

#: Methods still handled after we sent ``Connection.Close``: everything else is
#: discarded, as AMQP 0-9-1 requires.
_HANDLED_WHILE_CLOSING = frozenset((spec.Connection.Close, spec.Connection.CloseOk))


class _Signal:
    """A self-pipe: readable after :meth:`set`, until :meth:`clear`. Thread-safe."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._is_set = False

    def fileno(self) -> int:
        return self._r.fileno()

    def set(self) -> None:
        if not self._is_set:
            self._is_set = True
            try:
                self._w.send(b"\0")
            except OSError:
                pass

    def clear(self) -> None:
        # Empty the pipe first, then reset the flag: the other way round, a set()
        # landing in between would have its byte read away while the flag stayed
        # set, and no later set() would ever write again.
        try:
            while self._r.recv(4096):
                pass
        except OSError:
            pass
        self._is_set = False

    def close(self) -> None:
        self._r.close()
        self._w.close()


def _locked_frame_writer(connection: Connection, transport: Any) -> Callable[..., None]:
    """py-amqp's frame writer behind the connection's transport lock.

    The lock keeps the frames of one message contiguous. A write to a connection that
    has ended raises its reason instead of touching the socket.
    """
    write_frame = amqp_frame_writer(connection, transport)

    def write_frame_locked(
        type_: int, channel: int, method_sig: Any, args: Any, content: Any
    ) -> None:
        with connection._transport_lock:
            if connection._reason is not None:
                raise connection._error_for_caller()
            try:
                write_frame(type_, channel, method_sig, args, content)
            except OSError as exc:
                raise connection._write_failed(exc) from exc

    return write_frame_locked


class Connection(amqp.Connection):
    """A py-amqp ``Connection`` that threads can share; see the module docstring.

    ``dedicated_drainer=True`` starts the drainer thread once the handshake is done.
    """

    Channel = Channel
    channels: dict[int, Any] | None  # type: ignore[assignment]
    _transport: Any

    def __init__(self, *args: Any, dedicated_drainer: bool = False, **kwargs: Any) -> None:
        if not isinstance(dedicated_drainer, bool):
            raise TypeError(f"dedicated_drainer must be True or False, not {dedicated_drainer!r}")
        self.dedicated_drainer = dedicated_drainer
        self._drainer: Drainer | None = None
        self._reason: BaseException | None = None
        self._waiters: set[_Reply] = set()
        self._inbox: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._inbox_signal: _Signal | None = None
        self._dispatched = 0
        self._lock_held = 0.0
        self._init_locks()
        super().__init__(*args, **kwargs)
        self.frame_writer_cls = _locked_frame_writer

    def _init_locks(self) -> None:
        # Legacy readers hold this lock across blocking reads, so waiters must get it
        # in turn; the drainer holds it only for dispatches and writes.
        self._transport_lock: threading.RLock | FairRLock = (
            threading.RLock() if self.dedicated_drainer else FairRLock()
        )
        self._state_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._channel_id_lock = threading.Lock()
        self._callback_lock = threading.RLock()
        self._inbox_ready = threading.Condition(threading.Lock())
        self._close_ok = threading.Event()

    # -- DrainerSink ---------------------------------------------------------------------
    @property
    def transport_lock(self) -> threading.RLock | FairRLock:
        return self._transport_lock

    def dispatch_frames(self, frames: list[Frame]) -> None:
        on_frame = self._on_inbound_frame
        with self._transport_lock:
            start = perf_counter()
            try:
                for frame in frames:
                    on_frame(frame)
            finally:
                self._lock_held += perf_counter() - start

    def try_send_heartbeat(self) -> bool:
        if not self._transport_lock.acquire(blocking=False):
            return False
        try:
            self.frame_writer(8, 0, None, None, None)
        finally:
            self._transport_lock.release()
        return True

    def drainer_exited(self, error: BaseException | None) -> None:
        if error is not None:
            self._end(self._as_connection_error(error))
        if not isinstance(self._reason, ConnectionClosedIntentionally):
            # Failed: release the socket and the wake-up pair now, not when kombu gets
            # round to collect() (it may just drop the connection).
            self._close_socket()
            if self._drainer is not None:
                self._drainer.close()
        self._close_ok.set()  # a close() in progress need not wait any longer

    # -- connecting ----------------------------------------------------------------------
    def connect(self, callback: Callable[[], Any] | None = None) -> Any:
        result = super().connect(callback)
        if self.dedicated_drainer and self._drainer is None and self.connected:
            self._start_drainer()
        return result

    def _start_drainer(self) -> None:
        transport = self._transport
        drainer = Drainer(
            self,
            transport.sock,
            name=f"drainer-amqp-{self.host}",
            frame_max=self.frame_max,
            heartbeat=self.heartbeat or 0,
        )
        self._drainer = drainer
        _drainer_connections.add(self)
        drainer.start()

    def _get_free_channel_id(self) -> int:
        with self._channel_id_lock:
            return super()._get_free_channel_id()

    def _claim_channel_id(self, channel_id: int) -> int:
        with self._channel_id_lock:
            return super()._claim_channel_id(channel_id)

    def channel(self, channel_id: int | None = None, callback: Any = None) -> Any:
        if self._reason is not None:
            raise self._error_for_caller()
        return super().channel(channel_id, callback)

    # -- ending: one path for every reason ----------------------------------------------
    def _end(self, reason: BaseException) -> bool:
        """Record why the connection ended and wake every waiting thread.

        The first failure wins; an intentional close replaces a failure for later calls
        (threads already woken keep the error they saw). Returns whether it recorded.
        """
        with self._state_lock:
            current = self._reason
            if current is not None and (
                isinstance(current, ConnectionClosedIntentionally)
                or not isinstance(reason, ConnectionClosedIntentionally)
            ):
                return False
            self._reason = reason
        if self._drainer is not None and not isinstance(reason, ConnectionClosedIntentionally):
            self._drainer.request_stop()  # on its way out it closes the socket
        for reply in list(self._waiters):
            reply.fail(None)
        with self._inbox_ready:
            self._inbox.clear()
            self._inbox_ready.notify_all()
        self._notify_inbox_listeners()
        return True

    def _error_for_caller(self) -> BaseException:
        """A fresh copy of the reason, so each thread gets its own traceback."""
        reason = self._reason
        if reason is None:
            return RecoverableConnectionError("connection already closed")
        error = copy.copy(reason)
        error.__cause__ = reason.__cause__
        return error

    def _raise_if_ended(self) -> None:
        if self._reason is not None:
            raise self._error_for_caller()

    def _as_connection_error(self, error: BaseException) -> BaseException:
        if isinstance(error, (AMQPError, ConnectionClosedIntentionally)):
            return error  # typed already: ours, or the broker's Connection.Close
        if isinstance(error, OSError):
            lost = ConnectionLost(f"connection to {self.host} lost: {error}")
        else:
            lost = ConnectionLost(f"connection to {self.host} failed: {error!r}")
        lost.__cause__ = error
        return lost

    def _write_failed(self, error: OSError) -> BaseException:
        if self._reason is None and self._drainer is None:
            return error  # legacy: py-amqp's own error
        self._end(self._as_connection_error(error))
        return self._error_for_caller()

    def _close_socket(self) -> None:
        """Shut the socket down (waking any blocked reader or writer), then close it.

        No TLS ``unwrap``: it would wait for the peer. Safe to call more than once.
        """
        transport = self._transport
        sock = getattr(transport, "sock", None)
        if transport is None or sock is None:
            return
        transport.connected = False
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        # Writers hold the lock while in sendall; after the shutdown they return at once.
        locked = self._transport_lock.acquire(timeout=CLOSE_TIMEOUT)
        try:
            sock.close()
        finally:
            if locked:
                self._transport_lock.release()

    @property
    def connected(self) -> bool:  # type: ignore[override]
        transport = self._transport
        return bool(transport and transport.connected and self._reason is None)

    def close(  # type: ignore[override]
        self,
        reply_code: int = 0,
        reply_text: str = "",
        method_sig: tuple[int, int] = (0, 0),
        argsig: str = "BsBB",
    ) -> None:
        """Close the connection: ``Connection.Close``, a bounded wait for ``CloseOk``,
        then stop the drainer and close the socket. Idempotent, safe from any thread;
        every waiting thread wakes with :class:`ConnectionClosedIntentionally`."""
        with self._close_lock:
            if self._transport is None:
                return
            if self._reason is None and self._transport.connected:
                args = (reply_code, reply_text, method_sig[0], method_sig[1])
                try:
                    self._close_handshake(args, argsig)
                except (OSError, AMQPError, ConnectionClosedIntentionally):
                    pass  # the link is going away either way
            self.collect()

    def _close_handshake(self, args: tuple[Any, ...], argsig: str) -> None:
        deadline = monotonic() + CLOSE_TIMEOUT
        self.is_closing = True
        intentional = ConnectionClosedIntentionally("connection closed by close()")
        if self._drainer is not None:
            AbstractChannel.send_method(self, spec.Connection.Close, argsig, args)
            self._end(intentional)
            self._close_ok.wait(CLOSE_TIMEOUT)  # the drainer delivers CloseOk
            return
        # Legacy: never wait for CloseOk while holding the lock, so that a thread in a
        # blocking read can deliver it; read it ourselves only when the lock is free.
        if not self._transport_lock.acquire(timeout=CLOSE_TIMEOUT):
            return  # a reader holds the socket for good; collect() shuts it down
        try:
            AbstractChannel.send_method(self, spec.Connection.Close, argsig, args)
        finally:
            self._transport_lock.release()
        self._end(intentional)
        while not self._close_ok.is_set():
            remaining = deadline - monotonic()
            if remaining <= 0 or not self._transport_lock.acquire(timeout=remaining):
                return
            try:
                if self._close_ok.is_set():
                    return
                with self._transport.having_timeout(max(remaining, 0.001)):
                    frame = self._transport.read_frame()
                self._on_inbound_frame(frame)
            except (OSError, AMQPError):
                return
            finally:
                self._transport_lock.release()

    def _on_close_ok(self) -> None:
        self._close_ok.set()  # close() tears down; the reader that got this does not

    def collect(self) -> None:
        """Tear down without the close handshake (kombu calls this after errors)."""
        self._end(ConnectionClosedIntentionally("connection collected"))
        drainer = self._drainer
        if drainer is not None and not drainer.stop(CLOSE_TIMEOUT):
            logger.warning("drainer thread %s did not stop in time", drainer.thread.name)
        self._close_socket()
        if drainer is not None and not drainer.is_alive():
            drainer.close()
        if self._inbox_signal is not None:
            self._inbox_signal.close()
        _drainer_connections.discard(self)
        for channel in list((self.channels or {}).values()):
            if channel is not self:
                channel.collect()
        self._transport = self.connection = self.channels = None  # type: ignore[assignment]

    # -- reading -------------------------------------------------------------------------
    def on_inbound_method(
        self, channel_id: int, method_sig: tuple[int, int], payload: bytes, content: Any
    ) -> Any:
        self._dispatched += 1
        if self._reason is not None and method_sig not in _HANDLED_WHILE_CLOSING:
            return None  # discarded after close, as the spec requires
        channels = self.channels
        if channels is not None and channel_id not in channels and self._drainer is not None:
            logger.debug("dropping %s for unknown channel %s", method_sig, channel_id)
            return None
        return super().on_inbound_method(channel_id, method_sig, payload, content)

    def drain_events(self, timeout: float | None = None) -> Any:
        """Handle one event, or raise ``socket.timeout`` after ``timeout`` seconds.

        Drainer mode: run the next queued delivery or callback in this thread.
        Legacy mode: read from the socket under the transport lock.
        """
        if self._drainer is not None:
            return self._run_next_callback(timeout)
        return self._read_events(timeout)

    def _read_events(self, timeout: float | None, until: Callable[[], bool] | None = None) -> Any:
        self._raise_if_ended()
        seen = self._dispatched
        deadline = None if timeout is None else monotonic() + timeout
        lock = self._transport_lock
        if not lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError()
        try:
            self._raise_if_ended()
            if self._dispatched != seen or (until is not None and until()):
                return True  # another reader handled a method while we waited: recheck
            remaining = None if deadline is None else max(deadline - monotonic(), 0.0)
            try:
                return super().drain_events(remaining)
            except (OSError, AMQPError) as exc:
                if self._reason is not None:
                    raise self._error_for_caller() from exc
                raise
        finally:
            self._transport_lock.release()

    def _run_next_callback(self, timeout: float | None) -> Any:
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            with self._inbox_ready:
                while not self._inbox and self._reason is None:
                    remaining = None if deadline is None else deadline - monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    self._inbox_ready.wait(remaining)
                ready = bool(self._inbox)
            self._raise_if_ended()  # outside the lock: the other woken threads need it
            if not ready:
                raise TimeoutError()
            remaining = None if deadline is None else max(deadline - monotonic(), 0.0)
            if not self._callback_lock.acquire(timeout=-1 if remaining is None else remaining):
                raise TimeoutError()
            try:
                with self._inbox_ready:
                    item = self._inbox.popleft() if self._inbox else None
                if item is not None:
                    function, args = item
                    return function(*args)
            finally:
                self._callback_lock.release()

    def _post(self, function: Callable[..., Any], *args: Any) -> None:
        """Queue a user callback for the next ``drain_events()`` caller (drainer thread)."""
        with self._inbox_ready:
            self._inbox.append((function, args))
            self._inbox_ready.notify()
        self._notify_inbox_listeners()

    def _notify_inbox_listeners(self) -> None:
        if self._inbox_signal is not None:
            self._inbox_signal.set()

    def inbox_fileno(self) -> int:
        """A descriptor that turns readable when callbacks are queued for
        ``drain_events()`` or the connection ends, for an event loop (kombu's Hub) to
        watch instead of the socket, which belongs to the drainer. After it fires,
        call :meth:`run_pending_callbacks`."""
        with self._state_lock:
            if self._inbox_signal is None:
                self._inbox_signal = _Signal()
            signal = self._inbox_signal
        if self._inbox or self._reason is not None:
            signal.set()
        return signal.fileno()

    def run_pending_callbacks(self) -> int:
        """Run every queued callback in this thread without waiting; return how many.
        Raises the connection's error if it has ended."""
        if self._inbox_signal is not None:
            self._inbox_signal.clear()
        done = 0
        while True:
            try:
                self._run_next_callback(0)
            except TimeoutError:
                return done
            done += 1

    def _on_blocked(self) -> Any:
        if self._drainer is None:
            return super()._on_blocked()
        self._post(super()._on_blocked)
        return None

    def _on_unblocked(self) -> Any:
        if self._drainer is None:
            return super()._on_unblocked()
        self._post(super()._on_unblocked)
        return None

    # -- heartbeats ----------------------------------------------------------------------
    def heartbeat_tick(self, rate: int = 2) -> None:
        """Legacy: py-amqp's. Drainer mode: the drainer owns heartbeats; this only
        raises the connection's failure, if any."""
        if self._drainer is None:
            return super().heartbeat_tick(rate)
        if self._reason is not None and not isinstance(self._reason, ConnectionClosedIntentionally):
            raise self._error_for_caller()

    # -- introspection -------------------------------------------------------------------
    def drainer_stats(self) -> dict[str, float | int | bool]:
        """Plain numbers to log: what the drainer read and sent, and who is waiting."""
        drainer = self._drainer
        stats: dict[str, float | int | bool] = {
            "dedicated_drainer": self.dedicated_drainer,
            "running": bool(drainer and drainer.is_alive()),
            "lock_held_seconds": self._lock_held,
            "waiting_threads": len(self._waiters),
            "pending_callbacks": len(self._inbox),
        }
        if drainer is not None:
            stats.update(drainer.stats.as_dict())
        return stats

    # -- fork ----------------------------------------------------------------------------
    def _after_fork_in_child(self) -> None:
        """The child has no drainer thread and shares the parent's socket: close this
        process's copy of the descriptor (no shutdown: that would end the parent's
        link too) and fail the connection, so kombu reconnects in the child."""
        self._init_locks()
        self._waiters.clear()
        self._inbox.clear()
        self._reason = ConnectionLost(
            f"connection to {self.host} was inherited by a forked process; reconnect in the child"
        )
        transport = self._transport
        if transport is not None:
            transport.connected = False
            if transport.sock is not None:
                transport.sock.close()
        if self._drainer is not None:
            self._drainer.close()


_drainer_connections: weakref.WeakSet[Connection] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for conn in list(_drainer_connections):
        conn._after_fork_in_child()
    _drainer_connections.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
