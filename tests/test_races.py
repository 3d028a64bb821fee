"""Races found by reading the code, each forced with events and hooks (never sleeps), and
each concurrency test run once more with the interpreter switching threads constantly."""

from __future__ import annotations

import concurrent.futures
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import amqp
import pytest
from amqp import spec
from support.broker import JOIN
from support.threads import run_in_thread, stack_names

import drainer_amqp
from drainer_amqp import ConnectionClosedIntentionally, reading
from drainer_amqp.channel import Channel
from drainer_amqp.deferred import ConfirmFuture
from drainer_amqp.framing import Frame
from drainer_amqp.reading import LegacyReader
from drainer_amqp.sync import SelfPipe, Waiter
from drainer_amqp.waits import Confirms, Waiters

MODES = ["legacy", "drainer"]


# -- R2: the first confirmed publishes of two threads on one channel ---------------------


@pytest.mark.parametrize("mode", MODES)
def test_two_first_confirmed_publishes_on_one_channel_both_return(
    connect: Callable[..., drainer_amqp.Connection],
    mode: str,
    switching: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    conn = connect(mode)
    channel = conn.channel()
    queue = channel.queue_declare("", exclusive=True).queue
    # Both threads see "confirms not selected yet" before either goes on.
    both_looked = threading.Barrier(2, timeout=JOIN)
    looks = [0]
    looks_lock = threading.Lock()

    def get(self: Channel) -> bool:
        selected = bool(self.__dict__.get("_test_selected"))
        with looks_lock:
            first_two = not selected and looks[0] < 2
            looks[0] += first_two
        if first_two:
            both_looked.wait()
        return selected

    def set_(self: Channel, value: bool) -> None:
        self.__dict__["_test_selected"] = value

    monkeypatch.setattr(Channel, "_confirm_selected", property(get, set_), raising=False)

    def publish() -> object:
        return channel.basic_publish_confirm(amqp.Message(b"x"), "", queue)

    threads = [run_in_thread(publish, f"publisher-{i}") for i in range(2)]
    for thread, _ in threads:
        thread.join(JOIN)
    hung = [t.name for t, _ in threads if t.is_alive()]
    conn.collect()  # wakes a hung publisher
    assert not hung, f"{hung} never got its confirm"
    for _, outcome in threads:
        assert not isinstance(outcome[0], BaseException), outcome


# -- R3: a wait forgotten just as the reading thread fills it ---------------------------


@pytest.mark.parametrize("mode", MODES)
def test_forgetting_a_wait_the_reader_just_took_is_no_key_error(
    connect: Callable[..., drainer_amqp.Connection], mode: str, switching: None
) -> None:
    conn = connect(mode)
    channel = conn.channel()
    waiter = channel._expect(conn, spec.Basic.QosOk)

    class ReaderPopsAfterLookUp(dict):  # type: ignore[type-arg]
        def get(self, key: Any, default: Any = None) -> Any:
            value = super().get(key, default)
            # The reading thread dispatches the reply (py-amqp pops the entry) now.
            reader = threading.Thread(target=self.pop, args=(key, None), name="reader")
            reader.start()
            reader.join(JOIN)
            return value

    channel._pending = ReaderPopsAfterLookUp(channel._pending)
    channel._forget(conn, waiter)
    assert spec.Basic.QosOk not in channel._pending


# -- R4: a set() that lands inside SelfPipe.clear() --------------------------------------


@pytest.mark.parametrize("lands", ["before the pipe is emptied", "after the pipe is emptied"])
def test_a_set_during_clear_leaves_the_signal_readable(lands: str, switching: None) -> None:
    signal = SelfPipe()
    pipe = signal._r

    def set_from_another_thread() -> None:
        setter = threading.Thread(target=signal.set, name="setter")
        setter.start()
        setter.join(JOIN)

    class HookedPipe:
        calls = 0

        def recv(self, size: int) -> bytes:
            self.calls += 1
            if lands.startswith("before") and self.calls == 1:
                set_from_another_thread()  # its byte is then read away by this clear()
            try:
                return pipe.recv(size)
            except BlockingIOError:
                if lands.startswith("after"):
                    set_from_another_thread()
                raise

    try:
        signal.set()
        signal._r = HookedPipe()  # type: ignore[assignment]
        signal.clear()
        signal._r = pipe
        assert select.select([pipe], [], [], 0)[0], "the set() was lost"
    finally:
        signal._r = pipe
        signal.close()


# -- R1: a legacy reader that takes the lock just after close() looked -------------------


class GatedLock:
    """The transport lock, except that ``gated``'s first acquire waits for ``go``."""

    def __init__(self, lock: Any, gated: str) -> None:
        self.lock, self.gated = lock, gated
        self.go, self.taken = threading.Event(), threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        mine = threading.current_thread().name == self.gated and not self.taken.is_set()
        if mine:
            self.go.wait(JOIN)
        got = bool(self.lock.acquire(blocking, timeout))
        if mine:
            self.taken.set()
        return got

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()


def test_legacy_close_keeps_its_deadline_when_a_reader_takes_the_lock_just_after_it_looked(
    connect: Callable[..., drainer_amqp.Connection],
    switching: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    conn = connect("legacy")
    gate = GatedLock(conn.transport_lock, "reader")
    conn.transport_lock = gate  # type: ignore[assignment]
    reading = LegacyReader.reading

    def look(self: LegacyReader) -> bool:
        answer = reading.fget(self)  # type: ignore[attr-defined]
        if threading.current_thread().name == "closer":
            gate.go.set()  # the reader takes the lock now, just after close() looked
            assert gate.taken.wait(JOIN)
        return bool(answer)

    monkeypatch.setattr(LegacyReader, "reading", property(look))
    reader, read = run_in_thread(conn.drain_events, "reader")  # no timeout, no heartbeat
    closer, _ = run_in_thread(conn.close, "closer")
    closer.join(JOIN)
    stuck = closer.is_alive()
    if stuck:
        conn.transport.sock.shutdown(socket.SHUT_RDWR)  # frees the reader, then close()
    reader.join(JOIN)
    assert not stuck, "close() waited behind a blocked read past its deadline"
    assert isinstance(read[0], ConnectionClosedIntentionally), read


# -- a legacy heartbeat timeout ends the connection -------------------------------------


def test_a_legacy_heartbeat_timeout_wakes_a_blocked_reader_and_closes_the_socket(
    connect: Callable[..., drainer_amqp.Connection],
    switching: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    conn = connect("legacy", heartbeat=120)
    assert conn.heartbeat
    in_read = threading.Event()
    read_frame = reading.read_frame

    def hooked(transport: Any, frame_max: int, *rest: Any) -> Frame:
        in_read.set()
        return read_frame(transport, frame_max, *rest)

    monkeypatch.setattr(reading, "read_frame", hooked)
    reader, read = run_in_thread(conn.drain_events, "reader")  # blocked until a frame comes
    assert in_read.wait(JOIN)
    # Two intervals without a frame from the broker; nothing due to send.
    conn.prev_sent, conn.prev_recv = conn.bytes_sent, conn.bytes_recv
    conn.last_heartbeat_sent = time.monotonic()
    conn.last_heartbeat_received = time.monotonic() - 10 * conn.heartbeat
    with pytest.raises(drainer_amqp.Transport.recoverable_connection_errors):
        conn.heartbeat_tick()
    reader.join(JOIN)
    stuck = reader.is_alive()
    if stuck:
        conn.collect()
    assert not stuck, "a thread blocked in drain_events() was not woken"
    assert isinstance(read[0], drainer_amqp.Transport.recoverable_connection_errors), read
    assert conn.transport is None or conn.transport.sock is None, "the socket is still open"


# -- a reply read just before the bytes that end the connection --------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_reply_read_just_before_the_end_is_returned_not_the_end(
    connect: Callable[..., drainer_amqp.Connection], mode: str
) -> None:
    """The waiting thread finds its reply missing; then, before it looks at the
    connection, another thread reads the reply and the bad bytes behind it, and ends the
    connection: the wait returns the reply (seen once in CI as an UnexpectedFrame
    raised to the thread whose DeclareOk had been read)."""
    conn = connect(mode)

    class FilledThenEnded:
        filled = False

        def ready(self) -> bool:
            if self.filled:
                return True
            # Another thread, between this check and the next: the reply, then the end.
            self.filled = True
            conn.end(drainer_amqp.ConnectionLost("bad bytes just after the reply"))
            return False

        def wait(self, timeout: float | None) -> bool:  # the drainer's: filled as it sleeps
            self.ready()
            return True

    conn.reader.wait(FilledThenEnded(), time.monotonic() + JOIN)  # returns, does not raise


# -- a channel closed by the broker: its error is handed over under its own lock ---------


def test_each_channel_hands_over_its_close_error_under_a_lock_of_its_own(
    connect: Callable[..., drainer_amqp.Connection],
) -> None:
    conn = connect("legacy")
    first, second = conn.channel(), conn.channel()
    assert first._close_lock is not second._close_lock


# -- the release: once, whoever comes first ---------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_collect_beside_a_close_waits_for_its_release_instead_of_racing_it(
    connect: Callable[..., drainer_amqp.Connection], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kombu's ``collect()`` (or a user's) in one thread while ``close()`` (or the exit
    hook) releases the connection in another: the release happens once, the second call
    waits for it within its deadline, and neither raises (one used to set
    ``channels = None`` while the other popped from it)."""
    conn = connect(mode)
    channels = [conn.channel(), conn.channel()]
    collected: list[str] = []
    in_release, go = threading.Event(), threading.Event()
    real_collect = Channel.collect

    def collect(self: Channel) -> None:
        collected.append(threading.current_thread().name)
        if threading.current_thread().name == "closer" and not in_release.is_set():
            in_release.set()
            assert go.wait(JOIN)
        real_collect(self)

    monkeypatch.setattr(Channel, "collect", collect)
    closer, closed = run_in_thread(conn.close, "closer")
    assert in_release.wait(JOIN)
    collector, collected_out = run_in_thread(conn.collect, "collector")
    # It reaches the release and waits there for the closer's.
    assert wait_for(lambda: stack_names(collector)[:1] == ["_release"])
    assert collector.is_alive()
    go.set()
    for thread in (closer, collector):
        thread.join(JOIN)
        assert not thread.is_alive()
    assert closed == [None] and collected_out == [None], (closed, collected_out)
    assert collected == ["closer"] * len(channels), collected
    assert conn.channels is None


def wait_for(predicate: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + JOIN
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)  # polling another thread's stack: there is no event to wait on
    return True


def test_a_late_drop_of_a_tag_from_before_a_reopen_leaves_the_new_publish_of_that_tag() -> None:
    """A publish of the channel's previous life (tag 1) finishes after the channel was
    reopened and a new publish took tag 1: its clean-up must not take the new one's wait
    (which then never hears its ack; seen under ten threads and a broker close)."""
    confirms = Confirms(Waiters())
    old, new = Waiter(), Waiter()
    assert confirms.number(old) == 1
    confirms.reset()  # the channel reopened
    assert confirms.number(new) == 1
    confirms.drop(1, old)
    confirms.settle(spec.Basic.Ack, 1, False)
    assert new.value is not None, "the new publish's ack was lost"


def test_a_return_fails_its_own_publish_even_when_other_acks_come_before_its_ack() -> None:
    """RabbitMQ sends a Return before its message's ack, but acks of earlier messages may
    come between (a queue confirmed them later): the Return names no delivery tag, so it
    is matched by what it carries to the oldest such mandatory publish still waiting."""
    confirms = Confirms(Waiters())
    waiters = [Waiter() for _ in range(7)]
    for waiter in waiters[:5]:
        confirms.number(waiter)
    confirms.number(waiters[5], ("", "nowhere", b"m"))  # tag 6: mandatory, unroutable
    confirms.number(waiters[6], ("", "nowhere", b"m"))  # tag 7: the same, still waiting
    error = RuntimeError("312 NO_ROUTE")
    assert confirms.fail_returned(("", "nowhere", b"m"), error)  # the Return of tag 6
    confirms.settle(spec.Basic.Ack, 5, True)  # the acks of 1-5 come next
    confirms.settle(spec.Basic.Ack, 6, False)  # then tag 6's own ack: nothing left to do
    assert [w.error for w in waiters[:5]] == [None] * 5 and all(w.done for w in waiters[:5])
    assert waiters[5].error is error
    assert not waiters[6].done  # the next Return like it is tag 7's
    assert not confirms.fail_returned(("", "elsewhere", b"m"), error)
    assert confirms.fail_returned(("", "nowhere", b"m"), error)
    assert waiters[6].error is error


# -- a deferred publish's future: watchers racing its settling ----------------------------


class _FutureReader:
    """Drainer mode's wait: sleep on the awaitable itself."""

    def wait(self, awaitable: Any, deadline: float | None, closing: bool = False) -> None:
        if not awaitable.wait(None if deadline is None else deadline - time.monotonic()):
            raise TimeoutError()


class _FutureConnection:
    reader: Any = _FutureReader()

    def error_for_caller(self, report: bool = True) -> BaseException:
        return drainer_amqp.ConnectionLost("the connection ended")


def test_a_future_does_what_concurrent_futures_does_with_the_same_attributes() -> None:
    """ConfirmFuture makes its own copy of Future's attributes (all but the condition,
    made only when watched): a Python release that adds one fails here."""
    future = ConfirmFuture(_FutureConnection(), lambda f, outcome: None)
    stock = set(vars(concurrent.futures.Future()))
    ours = set(vars(future)) | set(vars(ConfirmFuture))  # most are class defaults
    assert stock - {"_condition"} <= ours, stock - ours


@pytest.mark.parametrize("outcome", ["acked", "failed"])
def test_a_future_settled_before_anyone_watched_it_serves_every_kind_of_watcher(
    outcome: str,
) -> None:
    """Settled unwatched, a future has no condition nor lists of its own (they come with
    the first watcher): ``wait``, ``as_completed``, a done callback, ``result`` and
    ``exception`` still see it done, at once, as often as they ask."""
    error = RuntimeError("failed")
    future: concurrent.futures.Future[Any] = ConfirmFuture(
        _FutureConnection(), lambda f, outcome: None
    )
    if outcome == "acked":
        future(spec.Basic.Ack)  # type: ignore[operator]
    else:
        future.fail(error)  # type: ignore[attr-defined]
    for _ in range(2):
        done, not_done = concurrent.futures.wait([future], timeout=0)
        assert (done, not_done) == ({future}, set())
        assert list(concurrent.futures.as_completed([future], timeout=0)) == [future]
        called: list[bool] = []

        def on_done(f: concurrent.futures.Future[Any], called: list[bool] = called) -> None:
            called.append(f.done())

        future.add_done_callback(on_done)
        assert called == [True]
        if outcome == "acked":
            assert future.result(timeout=0) is True
            assert future.exception(timeout=0) is None
        else:
            assert future.exception(timeout=0) is error
            with pytest.raises(RuntimeError):
                future.result(timeout=0)


def race_to_settle(watcher: str) -> None:
    """One future, an ack and a failure racing to settle it, a thread watching it."""
    counted: list[str] = []
    seen: list[object] = []
    future = ConfirmFuture(_FutureConnection(), lambda f, outcome: counted.append(outcome))
    start = threading.Barrier(3, timeout=JOIN)

    def ack() -> None:
        start.wait()
        future(spec.Basic.Ack)

    def fail() -> None:
        start.wait()
        future.fail(RuntimeError("failed"))

    def watch() -> None:
        start.wait()
        if watcher == "result":
            try:
                seen.append(future.result(timeout=JOIN))
            except RuntimeError as exc:
                seen.append(exc)
        elif watcher == "wait":
            done, _ = concurrent.futures.wait([future], timeout=JOIN)
            seen.append(future in done)
        elif watcher == "callback":
            future.add_done_callback(lambda f: seen.append(f.done()))
        elif watcher == "as_completed":
            watched: list[concurrent.futures.Future[Any]] = [future]
            seen.extend(f.done() for f in concurrent.futures.as_completed(watched, JOIN))
        else:
            while not future.done():
                time.sleep(0)
            seen.append(True)

    threads = [threading.Thread(target=t) for t in (ack, fail, watch)]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN)
    assert not any(t.is_alive() for t in threads)
    # A watcher that missed its wake-up returns only at its timeout (JOIN).
    assert time.monotonic() - began < JOIN / 2, "the watcher was not woken"
    assert len(counted) == 1, counted
    assert future.done()
    assert len(seen) == 1, seen
    if counted == ["acked"]:
        assert future.result(0) is True
        assert seen[0] is True
    else:
        assert isinstance(future.exception(0), RuntimeError)
        assert seen[0] is True or isinstance(seen[0], RuntimeError), seen


@pytest.mark.parametrize("watcher", ["result", "wait", "callback", "as_completed", "done"])
def test_a_future_settles_once_for_every_watcher_racing_its_settling(
    switching: None, watcher: str
) -> None:
    """An ack and a failure race to settle each future while a thread watches it: one
    answer stands, counted once; the watcher sees it (a waiting watcher is woken, a
    done callback runs once), whichever of the three came first."""
    for _ in range(500):
        race_to_settle(watcher)
