"""A channel the broker closes while other threads use it.

After the broker's ``Channel.Close`` and our ``CloseOk`` the channel does not exist on
the broker: anything else written on it before a ``Channel.Open`` makes RabbitMQ end
the whole connection (504 CHANNEL_ERROR). So nothing of a closed channel's may be
written after its CloseOk, a confirm it waited for fails at once, and the thread that
reopens it writes Channel.Open before anyone else's method. Forced with a fake broker
and hooks; then the real broker closes a channel under ten publishing threads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
from amqp import Message, spec
from amqp.exceptions import ChannelError, NotFound, RecoverableConnectionError
from support.broker import JOIN, unique_name, wait_until
from support.fake_broker import FakeBroker, fake_broker, method
from support.publishing import connect, queue_bodies
from support.threads import run_in_thread

import drainer_amqp
from drainer_amqp.sync import Waiter

MODES = ["drainer", "legacy"]
CLOSE_404 = (404, "NOT_FOUND - no queue 'missing'", 50, 10)


@contextlib.contextmanager
def drainer_on_fake_broker(**options: Any) -> Iterator[tuple[FakeBroker, drainer_amqp.Connection]]:
    """A fake broker (``options``: its own) and a drainer-mode connection to it, closed
    after."""
    with fake_broker(**options) as broker:
        conn = drainer_amqp.Connection(host=broker.hostport, dedicated_drainer=True)
        conn.connect()
        try:
            yield broker, conn
        finally:
            conn.close()


def methods_on(broker: FakeBroker, channel: int) -> list[tuple[int, int]]:
    with broker._lock:  # noqa: SLF001 - the record of what the client wrote
        return [sig for ch, sig, _ in broker.methods if ch == channel]


def assert_nothing_between_close_ok_and_open(sigs: list[tuple[int, int]]) -> None:
    closed = False
    for sig in sigs:
        if sig == spec.Channel.CloseOk:
            closed = True
        elif sig == spec.Channel.Open:
            closed = False
        else:
            assert not closed, f"{sig} written on a closed channel: {sigs}"


@pytest.mark.parametrize("confirms", [False, True])
def test_a_publish_that_passed_its_check_is_not_written_after_close_ok(
    monkeypatch: pytest.MonkeyPatch, confirms: bool, switching: None
) -> None:
    """P1 is writing (held); P2 has looked at the channel (open) and is about to queue;
    then the broker closes the channel and our CloseOk is queued. P2's publish must not
    go out behind the CloseOk: it is refused as it is taken for writing."""
    with drainer_on_fake_broker() as (broker, conn):
        channel = conn.channel()
        publish = channel.basic_publish
        if confirms:
            channel.confirm_select()
            publish = channel.basic_publish_confirm
        assert conn.writer is not None
        looked, go = threading.Event(), threading.Event()
        real_wait_unblocked = conn.wait_unblocked

        def wait_unblocked(timeout: float | None) -> None:  # after the channel's check
            if threading.current_thread().name == "P2":
                looked.set()
                assert go.wait(JOIN)
            real_wait_unblocked(timeout)

        monkeypatch.setattr(conn, "wait_unblocked", wait_unblocked)
        conn.io_lock.acquire()  # P1's write waits here, holding the lead
        try:
            p1, p1_out = run_in_thread(lambda: publish(Message(b"1"), routing_key="q"), "P1")
            assert wait_until(lambda: conn.writer is not None and conn.writer.busy, JOIN)
            p2, p2_out = run_in_thread(lambda: publish(Message(b"2"), routing_key="q"), "P2")
            assert looked.wait(JOIN)
            broker.send(method(1, spec.Channel.Close, "BsBB", CLOSE_404))
            # The drainer read it: the CloseOk waits in the queue behind P1's write.
            assert wait_until(lambda: len(conn.writer._queue) == 1, JOIN)  # type: ignore[union-attr]  # noqa: SLF001
            go.set()
            assert wait_until(lambda: len(conn.writer._queue) == 2, JOIN)  # type: ignore[union-attr]  # noqa: SLF001
        finally:
            conn.io_lock.release()
        for thread in (p1, p2):
            thread.join(JOIN)
            assert not thread.is_alive()
        assert isinstance(p2_out[0], NotFound), p2_out
        if confirms:  # its confirm will never come: failed at once, not at a timeout
            assert isinstance(p1_out[0], NotFound), p1_out
        else:
            assert p1_out == [None]  # written before the CloseOk: returned
        # P2 reopened the channel: Channel.Open, then the channel works again.
        assert broker.wait_for(spec.Channel.Open, count=2)
        channel.basic_publish(Message(b"3"), routing_key="q")
        assert broker.wait_for(spec.Basic.Publish, count=2)
        sigs = methods_on(broker, 1)
        assert_nothing_between_close_ok_and_open(sigs)
        assert sigs.count(spec.Basic.Publish) == 2, sigs  # P1's and the last
        assert len(channel.confirms) == 0
        assert conn.reason is None


def test_the_thread_that_reopens_a_channel_writes_channel_open_first(
    monkeypatch: pytest.MonkeyPatch, switching: None
) -> None:
    """While one thread reopens the channel, another thread's method must wait for the
    Channel.Open to be taken, or raise the close error: never go out before it."""
    with drainer_on_fake_broker(answer_declare=True) as (broker, conn):
        channel = conn.channel()
        broker.send(method(1, spec.Channel.Close, "BsBB", CLOSE_404))
        assert broker.wait_for(spec.Channel.CloseOk)
        reviving, go = threading.Event(), threading.Event()
        real_write = channel._write

        def write(conn_: Any, sig: Any, *args: Any, **kwargs: Any) -> None:
            if sig == spec.Channel.Open:
                reviving.set()  # the revive is claimed; Channel.Open not yet written
                assert go.wait(JOIN)
            real_write(conn_, sig, *args, **kwargs)

        monkeypatch.setattr(channel, "_write", write)
        reviver, reviver_out = run_in_thread(lambda: channel.basic_qos(0, 10, False), "reviver")
        assert reviving.wait(JOIN)
        with pytest.raises(NotFound):  # the channel is still closed for everyone else
            channel.basic_publish(Message(b"early"), routing_key="q")
        go.set()
        reviver.join(JOIN)
        assert isinstance(reviver_out[0], NotFound), reviver_out
        channel.basic_publish(Message(b"after"), routing_key="q")
        assert broker.wait_for(spec.Basic.Publish)
        assert_nothing_between_close_ok_and_open(methods_on(broker, 1))
        assert conn.reason is None


def test_the_drainer_fails_pending_waits_while_other_threads_add_and_remove_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_on_close`` runs in the drainer while user threads register and forget waits in
    the same dict: it must not iterate the live dict (a RuntimeError there would end the
    connection for everyone). Forced: a wait is added during any iteration of it."""

    class ChangingWhileIterated(dict):  # type: ignore[type-arg]
        def values(self) -> Any:  # as if another thread's _expect landed mid-iteration
            view = super().values()
            for i, value in enumerate(view):
                if i == 0:
                    self[(99, 99)] = Waiter()
                yield value

        def __iter__(self) -> Any:
            return iter(list(self.values()))

    with drainer_on_fake_broker() as (broker, conn):
        channel = conn.channel()
        channel._pending = ChangingWhileIterated(channel._pending)
        declare, outcome = run_in_thread(
            lambda: channel.queue_declare("q", passive=True), "declare"
        )
        assert broker.wait_for(spec.Queue.Declare)
        broker.send(method(1, spec.Channel.Close, "BsBB", CLOSE_404))
        declare.join(JOIN)
        assert isinstance(outcome[0], NotFound), outcome
        assert conn.reason is None, conn.reason


def test_nobody_reopens_the_channel_or_is_woken_before_the_close_ok_is_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between the broker's Channel.Close and our CloseOk, a thread woken by the close (or
    one that finds the channel closed) would reopen it: a Channel.Open before the CloseOk
    makes RabbitMQ end the connection (504, second 'channel.open'). Forced: as the drainer
    queues the CloseOk, a waiter is still asleep, and another thread's publish raises the
    close error without reopening the channel."""
    with drainer_on_fake_broker() as (broker, conn):
        channel = conn.channel()
        waiting, waiting_out = run_in_thread(
            lambda: channel.queue_declare("missing", passive=True), "waiting"
        )
        assert broker.wait_for(spec.Queue.Declare)
        seen: dict[str, Any] = {}
        real_send_frames = conn.send_frames

        def send_frames(channel_id: int, sig: Any, *args: Any, **kwargs: Any) -> None:
            if sig == spec.Channel.CloseOk and not seen:
                seen["woken"] = [w.done for w in set(channel._pending.values())]
                other, seen["other"] = run_in_thread(
                    lambda: channel.basic_publish(Message(b"x"), routing_key="q"), "other"
                )
                other.join(JOIN)
                seen["other_done"] = not other.is_alive()
            real_send_frames(channel_id, sig, *args, **kwargs)

        monkeypatch.setattr(conn, "send_frames", send_frames)
        broker.send(method(1, spec.Channel.Close, "BsBB", CLOSE_404))
        waiting.join(JOIN)
        assert not waiting.is_alive()
        assert seen["woken"] == [False], seen
        assert seen["other_done"], "the other thread reopened the channel and hung"
        assert isinstance(seen["other"][0], NotFound), seen
        assert isinstance(waiting_out[0], NotFound), waiting_out
        # The woken thread reopened the channel, after the CloseOk.
        assert broker.wait_for(spec.Channel.Open, count=2)
        sigs = methods_on(broker, 1)
        assert sigs.index(spec.Channel.CloseOk) < len(sigs) - 1 - sigs[::-1].index(
            spec.Channel.Open
        ), sigs
        assert_nothing_between_close_ok_and_open(sigs)
        assert spec.Basic.Publish not in sigs, sigs
        channel.basic_publish(Message(b"after"), routing_key="q")
        assert broker.wait_for(spec.Basic.Publish)
        assert conn.reason is None


@pytest.mark.parametrize("call", ["publish", "confirmed", "declare"])
def test_nothing_is_written_on_a_channel_behind_its_own_close(
    monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """A thread's method has passed every check and is on its way to the writer when
    another thread closes the channel: written behind the Channel.Close, it would reach
    RabbitMQ after the channel ended there (504: the connection ends, every channel
    with it). It is refused as it is taken for writing, with the error a call on the
    closed channel gets (RecoverableConnectionError), and the connection goes on."""
    with drainer_on_fake_broker(answer_declare=True) as (broker, conn):
        channel = conn.channel()
        if call == "confirmed":
            channel.confirm_select()
        calls = {
            "publish": lambda: channel.basic_publish(Message(b"late"), routing_key="q"),
            "confirmed": lambda: channel.basic_publish_confirm(
                Message(b"late"), routing_key="q", confirm_timeout=JOIN
            ),
            "declare": lambda: channel.queue_declare("q"),
        }
        at_writer, go = threading.Event(), threading.Event()
        real_send_frames = conn.send_frames

        def send_frames(*args: Any, **kwargs: Any) -> None:
            if threading.current_thread().name == "late":
                at_writer.set()
                assert go.wait(JOIN)
            real_send_frames(*args, **kwargs)

        monkeypatch.setattr(conn, "send_frames", send_frames)
        late, late_out = run_in_thread(calls[call], "late")
        assert at_writer.wait(JOIN)
        channel.close()
        go.set()
        late.join(JOIN)
        assert not late.is_alive()
        assert isinstance(late_out[0], RecoverableConnectionError), late_out
        sigs = methods_on(broker, 1)
        assert sigs[-1] == spec.Channel.Close, sigs
        assert conn.reason is None
        other = conn.channel()
        other.queue_declare("q")
        assert other.channel_id == 1  # the closed channel's id, reused: clean
        assert methods_on(broker, 1)[len(sigs) :] == [spec.Channel.Open, spec.Queue.Declare]


def close_under_publishers(conn: Any, queue: str, confirmed: bool, round_: int) -> None:
    """One round: three threads publish on a new channel until another closes it."""
    shared = conn.channel()
    if confirmed:
        shared.confirm_select()
    publish = shared.basic_publish_confirm if confirmed else shared.basic_publish
    returned: list[bytes] = []
    errors: list[BaseException] = []
    started = threading.Barrier(4, timeout=JOIN)

    def publisher(t: int) -> None:
        started.wait()
        n = 0
        while True:
            body = b"%d-%d-%d" % (round_, t, n)
            n += 1
            try:
                publish(Message(body), routing_key=queue, timeout=JOIN)
            except BaseException as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)
                return
            returned.append(body)

    threads = [run_in_thread(partial(publisher, t), f"pub-{t}")[0] for t in range(3)]
    started.wait()
    assert wait_until(lambda: len(returned) >= 30, JOIN)
    shared.close()
    for thread in threads:
        thread.join(JOIN)
        assert not thread.is_alive(), "a publisher hung"
    assert len(errors) == 3
    assert all(isinstance(e, RecoverableConnectionError) for e in errors), errors
    bodies = set(queue_bodies(queue))
    missing = set(returned) - bodies
    assert not missing, f"returned but not in the queue: {sorted(missing)[:5]}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("confirmed", [False, True], ids=["plain", "confirmed"])
def test_a_channel_closed_under_its_publishers_leaves_the_connection_alone(
    mode: str, confirmed: bool
) -> None:
    """Three threads publish on one channel; another thread closes it. Each publisher
    gets an error at its next publish; the connection and its other channels go on; and
    every publish that returned is in the queue (a confirmed one: acked). Three rounds."""
    queue = unique_name("drainer-own-close")
    conn = connect(mode)
    try:
        other = conn.channel()
        other.queue_declare(queue, auto_delete=False)
        try:
            for round_ in range(3):
                close_under_publishers(conn, queue, confirmed, round_)
                assert other.queue_declare(queue, passive=True).queue == queue
                assert conn.reason is None, conn.reason
        finally:
            other.queue_delete(queue)
    finally:
        conn.close()


@pytest.mark.parametrize("mode", MODES)
def test_the_broker_closes_a_channel_under_ten_publishing_threads(mode: str) -> None:
    """Ten threads publish with confirms on one channel while another thread's passive
    declare of a missing queue makes the broker close it, again and again. The
    connection survives (no 504), every publish returns or raises within its timeout,
    and every acked message is in the queue."""
    queue = unique_name("drainer-chclose")
    conn = connect(mode)
    admin = connect("drainer")
    admin.channel().queue_declare(queue, auto_delete=False)
    acked: list[bytes] = []
    failures: list[BaseException] = []
    stop = threading.Event()
    try:
        channel = conn.channel()

        def publisher(t: int) -> None:
            n = 0
            while not stop.is_set():
                body = b"%d-%d" % (t, n)
                n += 1
                try:
                    channel.basic_publish_confirm(
                        Message(body), routing_key=queue, timeout=JOIN, confirm_timeout=JOIN
                    )
                except ChannelError:
                    continue  # the channel was closed under it; it reopens
                except BaseException as exc:  # noqa: BLE001 - asserted below
                    failures.append(exc)
                    return
                acked.append(body)

        threads = [run_in_thread(partial(publisher, t), f"pub-{t}")[0] for t in range(10)]
        assert wait_until(lambda: len(acked) >= 50, JOIN)
        closes = 0
        for _ in range(20):
            try:
                channel.queue_declare("drainer-missing-" + queue, passive=True)
            except NotFound:
                closes += 1
            except ChannelError:
                pass  # the close of another round, raised here
        stop.set()
        for thread in threads:
            thread.join(JOIN)
            assert not thread.is_alive(), "a publisher hung"
        assert closes > 0
        assert not failures, failures[:3]
        assert conn.reason is None, conn.reason
        # The last declare's close may not be reopened yet (its thread saw another thread
        # reviving the close before): then this publish raises it once, reopens the
        # channel, and the next one goes through.
        begun = time.monotonic()
        try:
            channel.basic_publish_confirm(Message(b"last"), routing_key=queue, confirm_timeout=JOIN)
        except NotFound:
            channel.basic_publish_confirm(Message(b"last"), routing_key=queue, confirm_timeout=JOIN)
        assert time.monotonic() - begun < JOIN
    finally:
        stop.set()
        conn.close()
        bodies = queue_bodies(queue)
        admin.channel().queue_delete(queue)
        admin.close()
    missing = set(acked) - set(bodies)
    assert not missing, f"acked but not in the queue: {sorted(missing)[:5]}"
    assert b"last" in bodies


@pytest.mark.parametrize("mode", MODES)
def test_deliveries_queued_for_a_channel_closed_since_are_dropped(mode: str) -> None:
    """A consumer's callback closes its channel while more of its deliveries wait to be
    run (read already: by the drainer, or by close() itself in legacy mode). They are
    dropped, as stock py-amqp drops what comes while it closes, and the broker requeues
    them: drain_events() raises nothing (a "channel closed" error there would read as
    a lost connection to kombu, which would reconnect), and the connection goes on."""
    queue = unique_name("drainer-closed-consumer")
    conn = connect(mode)
    try:
        channel = conn.channel()
        channel.queue_declare(queue, auto_delete=False)
        for i in range(20):
            channel.basic_publish(Message(b"%d" % i), routing_key=queue)
        channel.basic_qos(0, 20, False)
        ran: list[bytes] = []
        behind: list[int] = []

        def on_message(message: Message) -> None:
            ran.append(message.body)
            if mode == "drainer":  # the drainer reads the rest meanwhile
                assert wait_until(lambda: len(conn.inbox) > 0, JOIN)
            channel.close()
            behind.append(len(conn.inbox))

        channel.basic_consume(queue, callback=on_message)
        deadline = time.monotonic() + JOIN
        while not ran or len(conn.inbox):
            assert time.monotonic() < deadline, "the deliveries were never run"
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.5)
        assert ran == [b"0"]
        assert behind[0] > 0, "no delivery was queued behind the close: nothing was tested"
        assert conn.reason is None, conn.reason
        other = conn.channel()
        assert wait_until(
            lambda: other.queue_declare(queue, passive=True).message_count == 20, JOIN
        ), "the dropped deliveries were not requeued"
        other.queue_delete(queue)
    finally:
        conn.close()


def test_a_reply_awaited_on_a_channel_another_thread_closes_fails_the_wait() -> None:
    """A thread waits for a reply (here one that never comes: a broker drops what
    arrives on a channel it is closing, and so does py-amqp) when another thread closes
    the channel. The wait ends with the closed channel's error, not never."""
    with drainer_on_fake_broker() as (broker, conn):  # it answers no Queue.Declare
        channel = conn.channel()
        waiting, outcome = run_in_thread(lambda: channel.queue_declare("q"), "waiting")
        assert broker.wait_for(spec.Queue.Declare)
        channel.close()
        waiting.join(JOIN)
        assert not waiting.is_alive(), "the wait outlived its channel"
        assert isinstance(outcome[0], RecoverableConnectionError), outcome
        assert conn.reason is None


def test_a_channel_closed_while_another_thread_reopens_it_ends_that_wait() -> None:
    """A thread reopens a channel the broker closed (its Channel.Open written, the OpenOk
    on its way) when another thread closes the channel: py-amqp's close() lets go of a
    channel that is not open at once. The OpenOk then finds the channel let go of; the
    reopening thread's wait ends with the closed channel's error, not never. Forced:
    the drainer dispatches nothing until the close is done."""
    with drainer_on_fake_broker() as (broker, conn):
        channel = conn.channel()
        broker.send(method(1, spec.Channel.Close, "BsBB", CLOSE_404))
        assert broker.wait_for(spec.Channel.CloseOk)
        with conn.transport_lock:  # the OpenOk waits to be dispatched
            reviver, outcome = run_in_thread(lambda: channel.basic_qos(0, 10, False), "reviver")
            assert broker.wait_for(spec.Channel.Open, count=2)
            channel.close()
        reviver.join(JOIN)
        assert not reviver.is_alive(), "the reopening thread waits for ever"
        assert isinstance(outcome[0], RecoverableConnectionError), outcome
        assert conn.reason is None
