"""``Channel``: kombu's py-amqp channel, with waits served by the connection's reader.

A thread that needs a reply (a synchronous method, a confirm) registers its
:class:`~drainer_amqp.sync.Waiter` *before* it writes the request (py-amqp issue 90),
then waits through the connection's reader. Methods whose listeners run user code are
queued in the connection's inbox for ``drain_events()``. A channel closed by the broker
is recorded, and raised (and reopened) in the thread that next uses it. The threading
contract: docs/threading.md.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from struct import Struct, unpack_from
from time import monotonic
from typing import Any, Protocol

from amqp import spec
from amqp.exceptions import ChannelError, MessageNacked, RecoverableConnectionError, error_for_code
from amqp.serialization import dumps
from kombu.transport import pyamqp
from vine import promise

from .deferred import ConfirmFuture, Window
from .encoding import PublishEncoder
from .errors import CannotWaitInReadingThread, in_failover_after_another, tag
from .reading import Reader
from .sync import Waiter, deadline_after
from .waits import Confirms, Inbox, Waiters

__all__ = ["CLOSE_TIMEOUT", "Channel"]

logger = logging.getLogger(__name__)

#: Bound on waiting for ``Channel.CloseOk``, and the connection close()'s one deadline.
CLOSE_TIMEOUT = 5.0

_ACK, _NACK = spec.Basic.Ack, spec.Basic.Nack
#: Methods whose listeners are user code, run from the inbox; each is keyed by its
#: consumer tag (the first short string of its payload) so that basic_cancel can run a
#: cancelled consumer's queued deliveries. CancelOk is queued too, so that the removal
#: of the consumer's callback stays behind its deliveries.
_QUEUED_BY_CONSUMER = frozenset((spec.Basic.Deliver, spec.Basic.Cancel, spec.Basic.CancelOk))
_QUEUED = _QUEUED_BY_CONSUMER | {spec.Basic.Return}
_EVENTS = {_ACK: "basic_ack", _NACK: "basic_nack"}
#: Written on a channel the broker closed: the close handshake, and the reopening.
_ALWAYS_WRITTEN = frozenset((spec.Channel.Open, spec.Channel.Close, spec.Channel.CloseOk))
#: A consumer's settlements: encoded directly (one struct), not by py-amqp's frame writer.
_SETTLEMENTS = frozenset((spec.Basic.Ack, spec.Basic.Nack, spec.Basic.Reject))


def _body_bytes(message: Any) -> bytes:
    body = getattr(message, "body", b"")
    if isinstance(body, str):
        return body.encode(getattr(message, "content_encoding", None) or "utf-8")
    return bytes(body)


def _returnable(exchange: str, routing_key: str, message: Any) -> tuple[str, str, bytes]:
    """What a Basic.Return of this mandatory publish would carry."""
    return exchange, routing_key, _body_bytes(message)


def _returned_key(payload: bytes, content: Any) -> tuple[str, str, bytes]:
    """The exchange, routing key and body of a Basic.Return (after its reply code and
    text)."""
    at = 7 + payload[6]
    exchange = payload[at + 1 : at + 1 + payload[at]].decode()
    at += 1 + payload[at]
    routing_key = payload[at + 1 : at + 1 + payload[at]].decode()
    return exchange, routing_key, _body_bytes(content)


def _return_error(payload: bytes) -> BaseException:
    reply_code = unpack_from(">H", payload, 4)[0]
    reply_text = payload[7 : 7 + payload[6]].decode(errors="replace")
    return error_for_code(reply_code, reply_text, spec.Basic.Return, ChannelError)


def _closed_unconfirmed() -> BaseException:
    return RecoverableConnectionError("the channel was closed before the broker confirmed")


_SETTLEMENT_FRAME = Struct(">BHIHHQBB")  # a method frame: Basic.Ack, Nack or Reject


def _settlement_frame(channel_id: int, sig: tuple[int, int], args: tuple[Any, ...]) -> bytes:
    """A Basic.Ack, Nack or Reject frame, encoded as py-amqp would (its bits in one
    octet)."""
    bits = 1 if args[1] else 0  # multiple (Ack, Nack) or requeue (Reject)
    if len(args) > 2 and args[2]:  # Nack's requeue
        bits |= 2
    return _SETTLEMENT_FRAME.pack(1, channel_id, 13, sig[0], sig[1], args[0], bits, 0xCE)


class _PublishTake:
    """A publish's ``take`` (:meth:`Writer.send`), called as the message is taken for
    writing: it numbers the publish's confirm there (``tag``: the broker's count), or
    refuses the message on a channel the broker closed meanwhile. An object, not a
    closure: one allocation per publish instead of seven, which the garbage collector
    would see."""

    __slots__ = ("channel", "conn", "waiter", "returnable", "tag")

    def __init__(
        self, channel: Channel, conn: ChannelConnection, waiter: Waiter | None, returnable: Any
    ) -> None:
        self.channel = channel
        self.conn = conn
        self.waiter = waiter
        self.returnable = returnable
        self.tag = 0

    def __call__(self) -> None:
        channel = self.channel
        if channel._close_taken:
            raise _Refused(channel._closed_here())
        error = channel._close_error
        if error is None and channel._confirm_mode:
            with channel._close_lock:  # against _on_close failing every confirm
                error = channel._close_error
                if error is None:
                    self.tag = channel.confirms.number(self.waiter, self.returnable)
        elif error is None and self.waiter is not None:  # reopened since: no confirms
            error = channel._last_close_error
        if error is not None:
            raise _Refused(error)
        self.conn.messages_sent += 1

    def refused_behind(self, error: BaseException | None) -> None:
        """A deferred publish (``waiter``: its future) written behind was not written: the
        channel had closed (``_Refused``), or the connection ended (None)."""
        if isinstance(error, _Refused):
            error = copy.copy(error.error)
        assert self.waiter is not None
        self.waiter.fail(error)


class _Refused(Exception):  # noqa: N818 - internal: carries the channel's close error
    """A take refused a method: the broker had closed its channel (``error``)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


def _dispatch_now(channel: Any, method_sig: Any, payload: bytes, content: Any) -> Any:
    """What the inbox runs for a channel's method: py-amqp's dispatch, which runs its
    callbacks; nothing on a channel this side has closed since the method was read (its
    deliveries go back to the queue; stock py-amqp drops what comes while it closes)."""
    if channel.connection is None:
        return None
    return _py_dispatch(channel, method_sig, payload, content)


_py_dispatch = pyamqp.Channel.dispatch_method
_DELIVER = spec.Basic.Deliver
_TAG_AND_BIT = Struct(">QB")


def _deliver_args(payload: bytes) -> tuple[str, int, bool, str, str] | None:
    """A ``Basic.Deliver``'s arguments (``sLbss``), as py-amqp's ``loads`` decodes them;
    None if the payload's length is not what its strings say."""
    size = len(payload)
    tag_at = 5 + payload[4] if size > 4 else size
    exchange_at = tag_at + 10
    key_at = exchange_at + payload[exchange_at - 1] if size >= exchange_at else size
    if key_at >= size or size != key_at + 1 + payload[key_at]:
        return None
    delivery_tag, bits = _TAG_AND_BIT.unpack_from(payload, tag_at)
    return (
        payload[5:tag_at].decode("utf-8", "surrogatepass"),
        delivery_tag,
        (bits & 1) == 1,
        payload[exchange_at:key_at].decode("utf-8", "surrogatepass"),
        payload[key_at + 1 :].decode("utf-8", "surrogatepass"),
    )


def _deliver_now(channel: Any, method_sig: Any, payload: bytes, content: Any) -> Any:
    """What the inbox runs for a ``Basic.Deliver``: py-amqp's ``dispatch_method``, its
    steps for a delivery, with the arguments decoded by :func:`_deliver_args` rather
    than by py-amqp's generic ``loads`` (a third of the cost). A closing channel, a
    one-shot wait for a delivery, or a malformed payload: py-amqp's own."""
    if channel.connection is None:
        return None  # closed by this side since: see _dispatch_now
    args = _deliver_args(payload)
    if args is None or channel.is_closing or _DELIVER in channel._pending:
        return _dispatch_now(channel, method_sig, payload, content)
    listener = channel._callbacks.get(_DELIVER)
    if listener is None:
        return None
    if content and channel.auto_decode and hasattr(content, "content_encoding"):
        try:
            content.body = content.body.decode(content.content_encoding)
        except Exception:  # noqa: BLE001, S110 - as py-amqp's: the body stays as it came
            pass
    return listener(*args, content)


def _reads_here(conn: ChannelConnection) -> bool:
    """Whether this thread is dispatching what it read (a done callback runs there: the
    drainer's, or in legacy mode the reader's, under the transport lock): a wait for
    what the connection reads would wait for itself."""
    return conn.dispatching_thread == threading.get_ident()


class ChannelConnection(Protocol):
    """What a channel uses of its :class:`drainer_amqp.Connection`."""

    waiters: Waiters
    inbox: Inbox
    reader: Reader
    publish_encoder: PublishEncoder | None
    reason: BaseException | None
    is_closing: bool
    _channel_id_lock: Any  # guards py-amqp's _used_channel_ids and channels' None
    channels: dict[int, Any] | None
    messages_sent: int  # counted as each publish is queued
    dispatching_thread: int | None  # the thread dispatching what it read, if any
    unconfirmed: Window  # deferred confirms outstanding
    confirm_counts: dict[str, int]  # how settled deferred confirms ended
    on_confirm: Callable[[float, bool], None] | None

    def send_frames(
        self,
        channel: int,
        method_sig: Any,
        args: Any,
        content: Any,
        *,
        take: Callable[[], Any] | None = None,
        timeout: float | None = None,
        encoded: list[bytes | memoryview] | None = None,
        behind: Callable[[BaseException | None], None] | None = None,
    ) -> None: ...
    def wait_unblocked(self, timeout: float | None) -> None: ...
    def raise_if_ended(self) -> None: ...
    def reading_needed(self) -> None: ...
    def error_for_caller(self) -> BaseException: ...


def first_short_string(payload: bytes) -> str:
    """The first short string of a method's arguments (after its 4-byte class/method)."""
    return payload[5 : 5 + payload[4]].decode() if len(payload) > 4 else ""


class Channel(pyamqp.Channel):
    """kombu's py-amqp channel; see the module docstring for the threading contract."""

    connection: ChannelConnection
    _confirm_selected: bool

    def __init__(self, connection: ChannelConnection, *args: Any, **kwargs: Any) -> None:
        self.confirms = Confirms(connection.waiters)
        self._confirm_mode = False
        # Guards _close_error and _close_ok_due against confirms being numbered (a
        # publish's take) and _reviving: the reading thread sets the error, a take reads
        # it, one using thread claims the revive (not before the CloseOk is queued).
        # Taken under the writer's lock, never the reverse.
        self._close_lock = threading.Lock()
        # The broker closed this channel: set before our CloseOk is queued, cleared as
        # the Channel.Open that reopens it is taken for writing, so nothing else of this
        # channel's is written in between (RabbitMQ would end the connection: 504).
        self._close_error: BaseException | None = None
        self._last_close_error: BaseException | None = None
        self._reviving = False  # a thread is reopening the channel
        self._close_ok_due = False  # the broker closed it; our CloseOk is not queued yet
        # This side's Channel.Close was taken for writing: nothing of this channel's is
        # taken after it (the broker would get it after the channel ended: 504). Set and
        # read in takes, under the writer's lock.
        self._close_taken = False
        self._prepared: dict[int, Waiter] = {}  # thread id -> wait registered before writing
        # A Basic.Return read just before its message's ack (reading thread only).
        self._returned: tuple[bytes, Any] | None = None
        # The inbox key of the last consumer a delivery came for (reading thread only).
        self._inbox_key: tuple[int | None, str | None] = (None, None)
        self._ended_connection: ChannelConnection | None = None
        # Held by the thread that selects confirms (the first confirmed publish) until
        # SelectOk, so that racing threads send Confirm.Select once.
        self._confirm_lock = threading.Lock()
        self._deferred_failed = False  # a deferred confirm failed since wait_for_confirms
        self._deferred: set[ConfirmFuture] = set()  # deferred publishes not settled yet
        super().__init__(connection, *args, **kwargs)
        if getattr(connection, "confirm_publish", None) == "deferred":
            self.basic_publish = self.basic_publish_deferred  # type: ignore[method-assign, assignment]

    def after_fork(self) -> None:
        """In a forked child: the threads that used this channel, and the locks they may
        have held, are the parent's."""
        self._close_lock = threading.Lock()
        self._confirm_lock = threading.Lock()

    def _live_conn(self) -> ChannelConnection:
        """The connection; on a closed channel, raises the reason its connection ended
        (after ``close()``, ``ConnectionClosedIntentionally``: kombu does not reconnect),
        or a recoverable error naming that connection (so kombu's cleanup after it
        leaves a newer connection alone)."""
        conn, ended = self.connection, self._ended_connection
        if conn is not None:
            return conn
        if ended is not None and ended.reason is not None:
            raise ended.error_for_caller()
        error = RecoverableConnectionError("channel closed")
        if ended is not None:
            tag(error, ended)
        raise error

    def collect(self) -> None:
        conn = self.connection
        self._ended_connection = conn or self._ended_connection
        # Confirms and replies still out will not come on this channel (py-amqp drops
        # what comes while it closes): their waits end now.
        ended = conn is None or conn.reason is not None
        self.confirms.fail_all(None if ended else _closed_unconfirmed())
        closed = None if ended else self._closed_here()
        for waiter in {w for w in self._pending.copy().values() if isinstance(w, Waiter)}:
            waiter.fail(closed)
        if conn is not None:
            with conn._channel_id_lock:  # py-amqp's collect frees the id in _used_channel_ids
                if conn.channels is not None:
                    return super().collect()
            self.connection = None  # type: ignore[assignment]  # released: nothing to free
        return super().collect()

    def close(self, *args: Any, **kwargs: Any) -> Any:
        """As py-amqp's; on a channel whose connection has ended, a quiet no-op."""
        conn = self.connection
        if conn is not None and conn.reason is not None:
            self.is_open = False
            self.collect()
            return None
        if in_failover_after_another(conn):
            return None  # kombu's failover would close another thread's default channel
        if conn is not None and self._deferred:
            try:  # as the connection's close(): the broker's answers first
                self.wait_for_confirms(timeout=CLOSE_TIMEOUT / 2)
            except Exception:  # noqa: BLE001, S110 - a timeout or an end: close anyway
                pass
        return super().close(*args, **kwargs)

    # -- waiting for replies ---------------------------------------------------------
    def _expect(self, conn: ChannelConnection, methods: Any) -> Waiter:
        """Register a wait *before* the request is written (py-amqp issue 90). In the
        drainer's reading thread (a done callback) it raises ``CannotWaitInReadingThread``
        instead, before anything is written: only that thread would read the reply."""
        if _reads_here(conn):
            raise CannotWaitInReadingThread(
                "this thread reads the connection (a done callback of a deferred publish): "
                "it cannot wait for a reply only it would read (nothing was sent)"
            )
        methods = tuple(methods) if isinstance(methods, list) else (methods,)
        waiter = Waiter(methods)
        for method in methods:
            self._pending[method] = waiter
        conn.waiters.add(waiter)
        error = self._close_error
        if error is not None:
            waiter.fail(error)
        return waiter

    def _forget(self, conn: ChannelConnection, waiter: Waiter) -> None:
        for method in waiter.methods:
            if self._pending.get(method) is waiter:
                self._pending.pop(method, None)  # the reading thread may pop it first
        conn.waiters.discard(waiter)

    def _await(self, waiter: Waiter, conn: ChannelConnection, timeout: float | None) -> Any:
        """Wait until ``waiter`` is filled; return its (method, args), or raise why not."""
        conn.reader.wait(waiter, deadline_after(timeout))
        if waiter.value is not None:
            return waiter.value
        error = waiter.error or self._close_error
        if error is not None:
            self._raise_channel_error(conn, error)
        raise conn.error_for_caller()

    def _raise_channel_error(self, conn: ChannelConnection, error: BaseException) -> None:
        """Reopen the channel the broker closed (once, in this thread) and raise why."""
        with self._close_lock:
            mine = self._close_error is error and not (self._reviving or self._close_ok_due)
            self._reviving = self._reviving or mine
        if mine:
            try:
                if conn.reason is None:
                    self._do_revive()
            finally:
                self._reviving = False
        raise copy.copy(error)

    def _check_open(self) -> None:
        """A method's take (under the writer's lock): refuse it on a channel the broker
        closed, or behind this side's Channel.Close."""
        error = self._close_error
        if self._close_taken:
            error = self._closed_here()
        if error is not None:
            raise _Refused(error)

    def _take_close(self) -> None:
        """This side's Channel.Close's take: what is taken after it is refused."""
        self._close_taken = True

    def _closed_here(self) -> BaseException:
        """What a method taken behind this side's Channel.Close raises: what it raises
        once the close is done (see ``_live_conn``)."""
        error = RecoverableConnectionError("channel closed")
        tag(error, self.connection or self._ended_connection)
        return error

    def _write(
        self, conn: ChannelConnection, sig: Any, args: Any, content: Any, **kwargs: Any
    ) -> None:
        """Write one method of this channel; ``take`` (default: refused on a channel the
        broker has closed by the time it is taken) and the rest as ``send_frames``."""
        if "take" not in kwargs:
            if sig == spec.Channel.Close:
                kwargs["take"] = self._take_close
            else:
                kwargs["take"] = None if sig in _ALWAYS_WRITTEN else self._check_open
        channel_id = self.channel_id
        if channel_id is None:  # collected by another thread meanwhile
            raise conn.error_for_caller()
        try:
            conn.send_frames(channel_id, sig, args, content, **kwargs)
        except _Refused as refused:
            self._raise_channel_error(conn, refused.error)

    def basic_ack(self, delivery_tag: int, multiple: bool = False, argsig: str = "Lb") -> Any:
        """py-amqp's, as :meth:`send_method` writes it, in fewer steps: a consumer may
        ack every delivery."""
        conn, channel_id = self.connection, self.channel_id
        if conn is None or channel_id is None or self._close_error is not None:
            return super().basic_ack(delivery_tag, multiple, argsig)
        encoded: list[bytes | memoryview] = [
            _settlement_frame(channel_id, _ACK, (delivery_tag, multiple))
        ]
        try:
            conn.send_frames(channel_id, _ACK, None, None, take=self._check_open, encoded=encoded)
        except _Refused as refused:
            self._raise_channel_error(conn, refused.error)
        written = promise()  # as py-amqp's: fulfilled once written
        written()
        return written

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
        error = self._close_error
        if error is not None and sig not in _ALWAYS_WRITTEN:
            self._raise_channel_error(conn, error)
        # Channel.Close is bounded like the connection's close(): a broker that stopped
        # reading (blocked) must not hang kombu's release().
        timeout = CLOSE_TIMEOUT if sig == spec.Channel.Close else None
        waiter = self._expect(conn, wait) if wait else None
        channel_id = self.channel_id
        try:
            if sig in _SETTLEMENTS and not callback and channel_id is not None:
                encoded = [_settlement_frame(channel_id, sig, args)]
                self._write(conn, sig, None, None, encoded=encoded)
            else:
                self._write(conn, sig, dumps(format, args) if format else "", content)
            written = promise()  # as py-amqp's: fulfilled once written
            if callback:
                written.then(callback)
            written()
            if waiter is None:
                return written
            return self._finish_wait(waiter, conn, None, timeout, returns_tuple)
        finally:
            if waiter is not None:
                self._forget(conn, waiter)

    def wait(  # type: ignore[override]
        self,
        method: Any,
        callback: Any = None,
        timeout: float | None = None,
        returns_tuple: bool = False,
    ) -> Any:
        conn = self._live_conn()
        waiter = self._prepared.pop(threading.get_ident(), None) or self._expect(conn, method)
        try:
            return self._finish_wait(waiter, conn, callback, timeout, returns_tuple)
        finally:
            self._forget(conn, waiter)

    def _finish_wait(
        self,
        waiter: Waiter,
        conn: ChannelConnection,
        callback: Any,
        timeout: float | None,
        returns: bool,
    ) -> Any:
        method_sig, args = self._await(waiter, conn, timeout)
        if callback is not None:
            callback(method_sig, *args)  # the caller's own thread, as py-amqp does
        return args if returns else (args and args[0])

    def queue_declare(self, *args: Any, **kwargs: Any) -> Any:
        # py-amqp writes Queue.Declare and only then waits for DeclareOk: register first.
        if kwargs.get("nowait") or (len(args) > 5 and args[5]):
            return super().queue_declare(*args, **kwargs)
        conn = self._live_conn()
        waiter = self._expect(conn, spec.Queue.DeclareOk)
        self._prepared[threading.get_ident()] = waiter  # claimed by wait() below
        try:
            return super().queue_declare(*args, **kwargs)
        finally:
            self._prepared.pop(threading.get_ident(), None)
            self._forget(conn, waiter)

    def basic_consume(
        self, queue: str = "", consumer_tag: str = "", *args: Any, **kwargs: Any
    ) -> Any:
        """As py-amqp's, but a consumer with its own tag (kombu always gives one) gets its
        callbacks before ``Basic.Consume`` is written: the broker's first deliveries can
        reach a thread in ``drain_events()`` before this thread wakes from ``ConsumeOk``,
        and py-amqp would reject (requeue) them for want of a callback."""
        if not consumer_tag:
            return super().basic_consume(queue, consumer_tag, *args, **kwargs)
        names = ("no_local", "no_ack", "exclusive", "nowait", "callback", "arguments", "on_cancel")
        given = dict(zip(names, args, strict=False), **kwargs)
        callback, on_cancel = given.get("callback"), given.get("on_cancel")
        self.callbacks[consumer_tag] = callback
        if on_cancel is not None:
            self.cancel_callbacks[consumer_tag] = on_cancel
        try:
            return super().basic_consume(queue, consumer_tag, *args, **kwargs)
        except BaseException:
            if self.callbacks.get(consumer_tag) is callback:
                self.callbacks.pop(consumer_tag, None)
                self.cancel_callbacks.pop(consumer_tag, None)
            raise

    def basic_cancel(self, consumer_tag: str, nowait: bool = False, argsig: str = "sb") -> Any:
        """As py-amqp's; then runs, in this thread, the consumer's deliveries that arrived
        before ``CancelOk`` and are still queued (py-amqp runs them while it waits)."""
        result = super().basic_cancel(consumer_tag, nowait, argsig)
        conn = self.connection
        if not nowait and conn is not None:
            conn.inbox.run_matching((self.channel_id, consumer_tag))
        return result

    # -- dispatch: called by the connection's reader, under the transport lock -----------
    def dispatch_method(self, method_sig: tuple[int, int], payload: bytes, content: Any) -> None:
        conn = self.connection
        if conn is None:  # closed by this side (py-amqp lets go of it even without CloseOk)
            waiter = self._pending.pop(method_sig, None)  # a wait begun before (a reopen's)
            if isinstance(waiter, Waiter):
                waiter.fail(self._closed_here())
            return
        if method_sig in _EVENTS:
            delivery_tag, multiple = unpack_from(">QB", payload, 4)
            if self._returned is not None:
                self._settle_returned(conn, method_sig, delivery_tag)
            self.confirms.settle(method_sig, delivery_tag, bool(multiple))
            if not self.events.get(_EVENTS[method_sig]):
                return
        elif method_sig == spec.Basic.Return and self._confirm_mode:
            if not self.events.get("basic_return"):
                if self.confirms.fail_returned(
                    _returned_key(payload, content), _return_error(payload)
                ):
                    return
                self._returned = (payload, content)  # its ack comes next: see _settle_returned
                return
        elif method_sig not in _QUEUED:
            return super().dispatch_method(method_sig, payload, content)
        waiter = self._pending.pop(method_sig, None)  # CancelOk: basic_cancel waits for it
        consumer = first_short_string(payload) if method_sig in _QUEUED_BY_CONSUMER else None
        key = self._inbox_key  # one tuple fewer per delivery: see Inbox
        if key[1] != consumer or key[0] != self.channel_id:
            key = self._inbox_key = (self.channel_id, consumer)
        run = _deliver_now if method_sig == _DELIVER else _dispatch_now
        conn.inbox.post(key, run, self, method_sig, payload, content)
        if waiter is not None:
            waiter(method_sig, first_short_string(payload))

    # py-amqp's listeners of user events, iterating a copy (one C call): other threads add
    # listeners (kombu's Producer adds on_return) while a drain_events() thread runs these.
    def _on_basic_ack(self, delivery_tag: int, multiple: bool) -> None:
        for callback in list(self.events["basic_ack"]):
            callback(delivery_tag, multiple)

    def _on_basic_nack(self, delivery_tag: int, multiple: bool) -> None:
        for callback in list(self.events["basic_nack"]):
            callback(delivery_tag, multiple)

    def _on_basic_return(
        self, reply_code: int, reply_text: str, exchange: str, routing_key: str, message: Any
    ) -> None:
        handlers = list(self.events.get("basic_return") or ())
        if not handlers:
            return super()._on_basic_return(reply_code, reply_text, exchange, routing_key, message)
        error = error_for_code(reply_code, reply_text, spec.Basic.Return, ChannelError)
        for callback in handlers:
            callback(error, exchange, routing_key, message)

    def _settle_returned(
        self, conn: ChannelConnection, method_sig: tuple[int, int], delivery_tag: int
    ) -> None:
        """A message returned with no ``basic_return`` listener: as stock py-amqp, which
        raises the broker's error (312 NO_ROUTE, ...) in the thread that waits for the
        message's confirm, the waiter of the ack that follows the Return gets the error.
        With nobody waiting for that ack, the Return goes to ``drain_events()``."""
        payload, content = self._returned or (b"", None)
        self._returned = None
        error = _return_error(payload)
        if method_sig != _ACK or not self.confirms.fail(delivery_tag, error):
            key = (self.channel_id, None)
            conn.inbox.post(key, _dispatch_now, self, spec.Basic.Return, payload, content)

    def _on_close(self, reply_code: int, reply_text: str, class_id: int, method_id: int) -> None:
        conn = self.connection
        if conn is None:
            return  # let go of by this side meanwhile
        self.is_open = False
        if self.is_closing or conn.is_closing:
            self._write(conn, spec.Channel.CloseOk, "", None)
            return
        # The broker closed this channel. Reopening it needs a wait, which the drainer must
        # never do, and which in legacy mode belongs to the thread that used the channel:
        # the next thread that uses the channel reopens it and raises the error. In this
        # order: the error is recorded (nothing of this channel's is numbered or taken for
        # writing after it) and the confirms waited for are taken; the CloseOk is queued;
        # then the waiters are woken, and a thread may reopen the channel: its
        # Channel.Open goes out after the CloseOk (before it, RabbitMQ ends the connection).
        error = error_for_code(reply_code, reply_text, (class_id, method_id), ChannelError)
        with self._close_lock:
            self._close_error = self._last_close_error = error
            self._close_ok_due = True
            unconfirmed = self.confirms.take_all()
        try:
            self._write(conn, spec.Channel.CloseOk, "", None)
        finally:
            with self._close_lock:
                self._close_ok_due = False
            pending = self._pending.copy()  # one call: other threads add and remove
            for waiter in [*unconfirmed, *{w for w in pending.values() if isinstance(w, Waiter)}]:
                waiter.fail(error)

    def _do_revive(self) -> None:
        """Reopen the channel the broker closed (py-amqp's, with the error cleared as the
        Channel.Open is taken for writing: see ``_close_error``)."""
        conn = self._live_conn()
        self.is_open = False
        waiter = Waiter((spec.Channel.OpenOk,))  # not _expect(): the channel is closed
        self._pending[spec.Channel.OpenOk] = waiter
        conn.waiters.add(waiter)
        try:
            self._write(conn, spec.Channel.Open, dumps("s", ("",)), None, take=self._reopened)
            self._await(waiter, conn, None)
        finally:
            self._forget(conn, waiter)

    def _reopened(self) -> None:
        # The Channel.Open's take: what follows it is written on a new channel.
        with self._close_lock:
            self._close_error = None
        self._confirm_mode = self._confirm_selected = False
        self._returned = None
        self.confirms.reset()

    # -- publishing --------------------------------------------------------------------
    def confirm_select(self, nowait: bool = False) -> Any:
        conn = self._live_conn()
        waiter = None if nowait else self._expect(conn, spec.Confirm.SelectOk)
        try:
            # Publishes taken after it are numbered.
            args = dumps("b", (nowait,))
            self._write(conn, spec.Confirm.Select, args, None, take=self._start_numbering)
            if waiter is not None:
                self._await(waiter, conn, None)
        finally:
            if waiter is not None:
                self._forget(conn, waiter)

    def _start_numbering(self) -> None:
        # A second Confirm.Select on a channel in confirm mode changes nothing on the
        # broker: its delivery tags keep counting.
        self._check_open()
        if not self._confirm_mode:
            self.confirms.reset()
            self._confirm_mode = True
        self._confirm_selected = True

    def _select_confirms(self) -> None:
        with self._confirm_lock:
            if not self._confirm_selected:  # set as Confirm.Select is queued
                self.confirm_select()

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
        """Write one Basic.Publish. Unlike py-amqp's, it never waits for a read: a blocked
        connection is known from the broker's ``Connection.Blocked``, and a publish on
        it waits at most ``min(timeout, blocked_timeout)``. (Legacy mode reads what is
        waiting, when nobody else reads: see ``LegacyReader.before_publish``.)"""
        self._publish(msg, exchange, routing_key, mandatory, immediate, timeout, argsig, None)

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
        waiter: Waiter | None,
        behind: bool = False,
    ) -> int:
        """Write one Basic.Publish; its delivery tag, if it was written already and the
        channel is in confirm mode. ``behind``: a deferred publish (``waiter``: its
        future), written behind (see :meth:`Writer.send`)."""
        conn = self.connection
        if conn is None:
            conn = self._live_conn()  # raises
        conn.reader.before_publish()
        error = self._close_error
        if error is not None:
            self._raise_channel_error(conn, error)
        conn.wait_unblocked(timeout)
        # Only a publish that waits for its confirm can be failed by a Return.
        returnable = (
            _returnable(exchange, routing_key, msg) if mandatory and waiter is not None else None
        )
        take = _PublishTake(self, conn, waiter, returnable)
        encoder, channel_id = conn.publish_encoder, self.channel_id
        chunks = args = None
        if encoder is not None and argsig == "Bssbb" and channel_id is not None:
            chunks = encoder.encode(channel_id, exchange, routing_key, mandatory, immediate, msg)
        if chunks is None:
            args = dumps(argsig, (0, exchange, routing_key, mandatory, immediate))
        try:
            if channel_id is None:  # collected by another thread meanwhile
                raise conn.error_for_caller()
            try:
                conn.send_frames(
                    channel_id, spec.Basic.Publish, args, msg,
                    take=take, timeout=timeout, encoded=chunks,
                    behind=take.refused_behind if behind else None,
                )  # fmt: skip
            except _Refused as refused:
                self._raise_channel_error(conn, refused.error)
        except TimeoutError as exc:
            self.confirms.drop(take.tag, waiter)
            raise RecoverableConnectionError("basic_publish: timed out") from exc
        except BaseException:
            self.confirms.drop(take.tag, waiter)
            raise
        return take.tag

    def basic_publish_confirm(
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
        """As py-amqp's: publish, then wait for the broker's ack (``MessageNacked`` on a
        nack) for at most ``confirm_timeout or timeout`` seconds."""
        conn = self._live_conn()
        if not self._confirm_selected:
            self._select_confirms()
        waiter = conn.waiters.add(Waiter())
        tag = 0
        start = monotonic()
        try:
            tag = self._publish(
                msg, exchange, routing_key, mandatory, immediate, timeout, argsig, waiter
            )
            method_sig, _ = self._await(waiter, conn, confirm_timeout or timeout)
        finally:
            self.confirms.drop(tag, waiter)
            conn.waiters.discard(waiter)
        on_confirm = conn.on_confirm
        if on_confirm is not None:
            on_confirm(monotonic() - start, method_sig != _NACK)
        if method_sig == _NACK:
            raise MessageNacked()
        return promise()

    # -- deferred confirms -------------------------------------------------------------
    def basic_publish_deferred(
        self,
        msg: Any,
        exchange: str = "",
        routing_key: str = "",
        mandatory: bool = False,
        immediate: bool = False,
        timeout: float | None = None,
        argsig: str = "Bssbb",
        **_: Any,
    ) -> ConfirmFuture:
        """Publish, and return at once a :class:`~drainer_amqp.deferred.ConfirmFuture`
        the broker's answer settles (docs/confirms.md). Puts the channel in confirm mode.
        In drainer mode the message is written behind, by the drainer or whichever thread
        writes next, in order with everything else; in legacy mode (and over TLS) this
        call writes it. Waits, at most ``timeout`` seconds, while ``max_unconfirmed``
        confirms of the connection are outstanding or ``UNWRITTEN_LIMIT`` bytes wait to
        be written."""
        conn = self.connection
        if conn is None:
            conn = self._live_conn()  # raises
        if not self._confirm_selected:
            self._select_confirms()
        deadline = deadline_after(timeout)
        window = conn.unconfirmed
        if not conn.reader.owns_socket and not window.room.ready():
            # Legacy mode reads the confirms that make room. (In drainer mode the
            # drainer reads them, and enter() waits in line.)
            try:
                conn.reader.wait(window.room, deadline)
            except TimeoutError:
                pass  # reported below
        left = None if deadline is None else deadline - monotonic()
        # A done callback (drainer mode): only this thread would read the confirms that free room.
        reads_confirms = _reads_here(conn)
        if reads_confirms:
            left = 0
        if not window.enter(left):
            conn.raise_if_ended()
            if reads_confirms:
                raise CannotWaitInReadingThread(
                    f"basic_publish_deferred: {conn.unconfirmed.size} confirms outstanding "
                    "(max_unconfirmed), and this thread reads them (a done callback): it "
                    "cannot wait for room"
                )
            raise RecoverableConnectionError(
                f"basic_publish_deferred: timed out: {conn.unconfirmed.size} confirms "
                "outstanding (max_unconfirmed)"
            )
        conn.reading_needed()  # its confirm must not wait behind a consumer's backlog
        # Until it is written, the writer fails it if it is not (refused_behind); once
        # taken, it waits in self.confirms, which the connection's end fails.
        future = ConfirmFuture(conn, self._deferred_settled)  # type: ignore[arg-type]
        self._deferred.add(future)
        try:
            left = None if deadline is None else deadline - monotonic()
            self._publish(
                msg, exchange, routing_key, mandatory, immediate, left, argsig,
                future, behind=True,  # type: ignore[arg-type]
            )  # fmt: skip
        except BaseException as exc:
            future._asked = True  # the caller gets the error, not the future
            future.fail(exc if isinstance(exc, Exception) else None)
            raise
        return future

    def _deferred_settled(self, future: ConfirmFuture, outcome: str) -> None:
        # In the thread that settled it (the reader, or whoever ended the connection).
        conn = self._ended_connection or self.connection
        if conn is not None:
            conn.unconfirmed.leave()
            conn.confirm_counts[outcome] += 1
        if outcome != "acked":
            self._deferred_failed = True
        self._deferred.discard(future)

    def wait_for_confirms(self, timeout: float | None = None) -> bool:
        """Wait until every deferred publish of this channel made so far is settled;
        return whether all of them since the last call were acked (False if any was
        nacked, returned or failed: their futures say which). ``TimeoutError`` after
        ``timeout`` seconds. In legacy mode this thread reads while it waits."""
        conn = self._live_conn()
        deadline = deadline_after(timeout)
        for future in self._deferred.copy():  # one C call: the drainer discards from it
            if not future.done():
                try:
                    conn.reader.wait(future, deadline)
                except (TimeoutError, CannotWaitInReadingThread):
                    raise
                except Exception:  # noqa: BLE001, S110 - the end settled it
                    pass
        failed, self._deferred_failed = self._deferred_failed, False
        return not failed
