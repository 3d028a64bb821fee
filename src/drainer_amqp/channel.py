"""``Channel``: kombu's py-amqp channel, with waits served by the drainer.

Threading contract: a thread that needs a reply (a synchronous method, a publisher
confirm) registers its wait *before* it writes the request, then sleeps until the
drainer fills it, so a fast reply cannot slip past it (py-amqp issue 90). Confirms are
matched by delivery tag, so several threads may wait for confirms on one channel; other
synchronous methods on one channel must not be called by two threads at once. Listeners
that would run user code (deliveries, returns, cancels, ack events) are queued for the
threads that call ``drain_events()``.

Legacy mode uses the same registration, but the waiting thread reads the socket itself
(under the transport lock) until some reader, perhaps another thread, has filled its
wait; callbacks run in whichever thread read the frame, as in py-amqp. A channel closed
by the broker is recorded and raised in the thread that uses that channel, in both modes.
"""

from __future__ import annotations

import copy
import threading
from time import monotonic
from typing import TYPE_CHECKING, Any

from amqp import spec
from amqp.abstract_channel import AbstractChannel
from amqp.exceptions import ChannelError, MessageNacked, RecoverableConnectionError, error_for_code
from kombu.transport import pyamqp

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["Channel"]


class _Reply:
    """One thread's wait for a reply: filled by the drainer, waited on by its owner.

    The signal is a bare lock, held until the reply (or the end) arrives: waking a
    thread from ``Lock.acquire`` costs less than from ``Event.wait``, which matters
    when one failure wakes dozens of waiters at once.
    """

    __slots__ = ("channel", "methods", "done", "value", "error", "_signal")

    def __init__(self, channel: Channel, methods: list[tuple[int, int]]) -> None:
        self.channel = channel
        self.methods = methods
        self.done = False
        self.value: tuple[tuple[int, int], tuple[Any, ...]] | None = None
        self.error: BaseException | None = None
        self._signal = threading.Lock()
        self._signal.acquire()

    def __call__(self, method_sig: tuple[int, int], *args: Any) -> None:
        """Called by py-amqp's ``dispatch_method`` (drainer thread) with the reply."""
        self.value = (method_sig, args)
        self._wake()

    def fail(self, error: BaseException | None) -> None:
        """Wake the owner without a reply: with ``error``, or with the connection's end."""
        if self.value is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        if not self.done:
            self.done = True
            try:
                self._signal.release()
            except RuntimeError:  # a reply and a failure raced: already woken
                pass

    def wait(self, timeout: float | None) -> bool:
        """Block until woken or ``timeout``; the owner's thread only, once."""
        return self.done or self._signal.acquire(timeout=-1 if timeout is None else timeout)

    def is_done(self) -> bool:
        return self.done


class Channel(pyamqp.Channel):
    """kombu's py-amqp channel; see the module docstring for the threading contract."""

    connection: Connection
    _confirm_selected: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._unconfirmed: dict[int, _Reply] = {}
        self._publish_seq = 0
        self._confirm_mode = False
        self._close_error: BaseException | None = None
        self._prepared: dict[int, _Reply] = {}  # thread id -> wait registered before writing
        self._ended_connection: Connection | None = None
        super().__init__(*args, **kwargs)

    def _live_conn(self) -> Connection | None:
        """The connection, or None once this channel was closed.

        On a channel whose connection was closed or failed, raises that reason: a
        publish after ``close()`` must say ``ConnectionClosedIntentionally`` (so kombu
        does not reconnect), not py-amqp's generic "connection closed"."""
        conn = self.connection
        if conn is None:
            ended = self._ended_connection
            if ended is not None and ended._reason is not None:
                raise ended._error_for_caller()
        return conn

    def _drainer_conn(self) -> Connection | None:
        """The connection if it runs in drainer mode, else None (legacy or closed)."""
        conn = self._live_conn()
        return conn if conn is not None and conn._drainer is not None else None

    def collect(self) -> None:
        self._ended_connection = self.connection or self._ended_connection
        super().collect()

    # -- waiting for replies ---------------------------------------------------------
    def _expect(self, conn: Connection, methods: Any) -> _Reply:
        """Register a wait *before* the request is written (py-amqp issue 90)."""
        methods = methods if isinstance(methods, list) else [methods]
        reply = _Reply(self, methods)
        for method in methods:
            self._pending[method] = reply
        conn._waiters.add(reply)
        if conn._reason is not None or self._close_error is not None:
            reply.fail(self._close_error)
        return reply

    def _forget(self, conn: Connection, reply: _Reply) -> None:
        for method in reply.methods:
            if self._pending.get(method) is reply:
                del self._pending[method]
        conn._waiters.discard(reply)

    def _await(self, reply: _Reply, conn: Connection, timeout: float | None) -> tuple[Any, ...]:
        """Sleep until the drainer fills ``reply`` (drainer mode), or read the socket
        until some reader has (legacy mode)."""
        if conn._drainer is not None:
            if not reply.wait(timeout):
                raise TimeoutError()
        else:
            deadline = None if timeout is None else monotonic() + timeout
            while not reply.done:
                remaining = None if deadline is None else deadline - monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError()
                conn._read_events(remaining, until=reply.is_done)
        if reply.value is not None:
            return reply.value
        error = reply.error or self._close_error
        if error is not None:
            self._raise_channel_error(conn, error)
        raise conn._error_for_caller()

    def _raise_channel_error(self, conn: Connection, error: BaseException) -> None:
        """Reopen the channel the broker closed (once, in this thread) and raise why."""
        with conn._state_lock:
            mine = self._close_error is error
            if mine:
                self._close_error = None
        if mine and conn._reason is None:
            self._do_revive()
        raise copy.copy(error)

    def send_method(  # type: ignore[override]
        self,
        sig: tuple[int, int],
        format: str | None = None,
        args: Any = None,
        content: Any = None,
        wait: Any = None,
        callback: Any = None,
        returns_tuple: bool = False,
    ) -> Any:
        conn = self._live_conn()
        if conn is None:
            return super().send_method(sig, format, args, content, wait, callback, returns_tuple)
        if self._close_error is not None and sig not in (spec.Channel.CloseOk, spec.Channel.Close):
            self._raise_channel_error(conn, self._close_error)
        if sig == spec.Basic.Publish and self._confirm_mode:
            with conn._transport_lock:  # the delivery tag is the write order on this channel
                self._publish_seq += 1
                return super().send_method(sig, format, args, content, None, callback)
        if not wait:
            return super().send_method(sig, format, args, content, None, callback)
        reply = self._expect(conn, wait)
        try:
            super().send_method(sig, format, args, content, None, callback)
            return self._finish_wait(reply, conn, None, None, returns_tuple)
        finally:
            self._forget(conn, reply)

    def wait(  # type: ignore[override]
        self,
        method: Any,
        callback: Any = None,
        timeout: float | None = None,
        returns_tuple: bool = False,
    ) -> Any:
        conn = self._live_conn()
        if conn is None:
            return super().wait(method, callback, timeout, returns_tuple)
        reply = self._prepared.pop(threading.get_ident(), None) or self._expect(conn, method)
        try:
            return self._finish_wait(reply, conn, callback, timeout, returns_tuple)
        finally:
            self._forget(conn, reply)

    def _finish_wait(
        self,
        reply: _Reply,
        conn: Connection,
        callback: Any,
        timeout: float | None,
        returns_tuple: bool,
    ) -> Any:
        method_sig, args = self._await(reply, conn, timeout)
        if callback is not None:
            callback(method_sig, *args)  # the caller's own thread, as py-amqp does
        return args if returns_tuple else (args and args[0])

    def queue_declare(self, *args: Any, **kwargs: Any) -> Any:
        # py-amqp writes Queue.Declare and only then waits for DeclareOk: register first.
        conn = self._live_conn()
        if conn is None or kwargs.get("nowait") or (len(args) > 5 and args[5]):
            return super().queue_declare(*args, **kwargs)
        reply = self._expect(conn, spec.Queue.DeclareOk)
        self._prepared[threading.get_ident()] = reply  # claimed by wait() below
        try:
            return super().queue_declare(*args, **kwargs)
        finally:
            self._prepared.pop(threading.get_ident(), None)
            self._forget(conn, reply)

    # -- publishing --------------------------------------------------------------------
    def confirm_select(self, nowait: bool = False) -> Any:
        conn = self._live_conn()
        if conn is None:
            return super().confirm_select(nowait)
        reply = None if nowait else self._expect(conn, spec.Confirm.SelectOk)
        try:
            with conn._transport_lock:  # publishes are numbered from here on
                self._publish_seq = 0
                self._confirm_mode = True
                AbstractChannel.send_method(self, spec.Confirm.Select, "b", (nowait,))
            if reply is not None:
                self._await(reply, conn, None)
        finally:
            if reply is not None:
                self._forget(conn, reply)

    def _basic_publish(
        self,
        msg: Any,
        exchange: str = "",
        routing_key: str = "",
        mandatory: bool = False,
        immediate: bool = False,
        timeout: float | None = None,
        confirm_timeout: float | None = None,
        argsig: str = "Bssbb",
    ) -> Any:
        if self._drainer_conn() is None:
            return super()._basic_publish(
                msg, exchange, routing_key, mandatory, immediate, timeout, confirm_timeout, argsig
            )
        self._publish(msg, exchange, routing_key, mandatory, immediate, timeout, argsig, False)

    basic_publish = _basic_publish

    def _publish(
        self,
        msg: Any,
        exchange: str,
        routing_key: str,
        mandatory: bool,
        immediate: bool,
        timeout: float | None,
        argsig: str,
        want_confirm: bool,
    ) -> tuple[int, _Reply] | None:
        """Write one Basic.Publish. Unlike py-amqp's, it does not read the socket
        (``drain_events(timeout=0)``) to see blocked notices: the drainer, or the
        confirm wait that follows in legacy mode, reads them."""
        conn = self._live_conn()
        if conn is None:
            raise RecoverableConnectionError("basic_publish: connection closed")
        if self._close_error is not None:
            self._raise_channel_error(conn, self._close_error)
        ticket = None
        with conn._transport_lock:  # the delivery tag is the write order on this channel
            if self._confirm_mode:
                self._publish_seq += 1
                if want_confirm:
                    reply = _Reply(self, [])
                    self._unconfirmed[self._publish_seq] = reply
                    conn._waiters.add(reply)
                    ticket = (self._publish_seq, reply)
            try:
                transport = conn._transport
                if transport is None:
                    raise conn._error_for_caller()
                with transport.having_timeout(timeout):
                    AbstractChannel.send_method(
                        self,
                        spec.Basic.Publish,
                        argsig,
                        (0, exchange, routing_key, mandatory, immediate),
                        msg,
                    )
            except TimeoutError as exc:
                if ticket is not None:
                    self._drop_confirm(conn, ticket)
                raise RecoverableConnectionError("basic_publish: timed out") from exc
            except BaseException:
                if ticket is not None:
                    self._drop_confirm(conn, ticket)
                raise
        return ticket

    def _drop_confirm(self, conn: Connection, ticket: tuple[int, _Reply]) -> None:
        self._unconfirmed.pop(ticket[0], None)
        conn._waiters.discard(ticket[1])

    def basic_publish_confirm(self, *args: Any, **kwargs: Any) -> Any:
        conn = self._live_conn()
        if conn is None:
            return super().basic_publish_confirm(*args, **kwargs)
        confirm_timeout = kwargs.pop("confirm_timeout", None)
        timeout = confirm_timeout or kwargs.get("timeout")
        if not self._confirm_selected:
            self._confirm_selected = True
            self.confirm_select()
        names = ("msg", "exchange", "routing_key", "mandatory", "immediate", "timeout")
        params = dict(zip(names, args, strict=False))
        params.update(kwargs)
        ticket = self._publish(
            params["msg"],
            params.get("exchange", ""),
            params.get("routing_key", ""),
            params.get("mandatory", False),
            params.get("immediate", False),
            params.get("timeout"),
            params.get("argsig", "Bssbb"),
            True,
        )
        assert ticket is not None
        try:
            method_sig, _ = self._await(ticket[1], conn, timeout)
        finally:
            self._drop_confirm(conn, ticket)
        if method_sig == spec.Basic.Nack:
            raise MessageNacked()

    def _settle(self, method_sig: tuple[int, int], delivery_tag: int, multiple: bool) -> None:
        if multiple:
            tags = [t for t in self._unconfirmed if delivery_tag == 0 or t <= delivery_tag]
        else:
            tags = [delivery_tag]
        for tag in tags:
            reply = self._unconfirmed.pop(tag, None)
            if reply is not None:
                reply(method_sig)

    # -- listeners: called by dispatch (the drainer thread in drainer mode) ----------------
    def _on_basic_ack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(spec.Basic.Ack, delivery_tag, multiple)
        conn = self._drainer_conn()
        if conn is None:
            return super()._on_basic_ack(delivery_tag, multiple)
        if self.events.get("basic_ack"):
            conn._post(super()._on_basic_ack, delivery_tag, multiple)

    def _on_basic_nack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(spec.Basic.Nack, delivery_tag, multiple)
        conn = self._drainer_conn()
        if conn is None:
            return super()._on_basic_nack(delivery_tag, multiple)
        if self.events.get("basic_nack"):
            conn._post(super()._on_basic_nack, delivery_tag, multiple)

    def _on_basic_deliver(self, *args: Any) -> None:
        conn = self._drainer_conn()
        if conn is None:
            return super()._on_basic_deliver(*args)
        conn._post(super()._on_basic_deliver, *args)

    def _on_basic_return(self, *args: Any) -> None:
        conn = self._drainer_conn()
        if conn is None:
            return super()._on_basic_return(*args)
        conn._post(super()._on_basic_return, *args)

    def _on_basic_cancel(self, consumer_tag: str) -> None:
        conn = self._drainer_conn()
        if conn is None:
            return super()._on_basic_cancel(consumer_tag)
        conn._post(super()._on_basic_cancel, consumer_tag)

    def _on_close(self, reply_code: int, reply_text: str, class_id: int, method_id: int) -> None:
        conn = self.connection
        # The broker closed this channel. Reopening it needs a wait, which the drainer
        # must never do, and which in legacy mode belongs to the thread that used the
        # channel, not to whichever thread read the frame: record the error, wake this
        # channel's waiters, and let the first thread that uses the channel reopen it
        # and raise the error.
        AbstractChannel.send_method(self, spec.Channel.CloseOk)
        self.is_open = False
        if self.is_closing or conn.is_closing:
            return
        error = error_for_code(reply_code, reply_text, (class_id, method_id), ChannelError)
        self._close_error = error
        waiting = {r for r in self._pending.values() if isinstance(r, _Reply)}
        waiting.update(self._unconfirmed.values())
        self._unconfirmed.clear()
        for reply in waiting:
            reply.fail(error)

    def _do_revive(self) -> None:
        self._confirm_mode = False
        self._publish_seq = 0
        super()._do_revive()
