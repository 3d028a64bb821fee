"""Deferred publisher confirms against the real broker, in both modes: every future
settles exactly once, says acked only for a message the broker has, and never stays
pending past the connection's end. Checked by message identity."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import kombu
import pytest
from amqp import Message
from amqp.exceptions import ChannelError, MessageNacked
from support.broker import BROKER_HOST, JOIN, close_broker_connections, unique_name, wait_until
from support.fake_broker import fake_broker
from support.publishing import connect
from support.threads import run_in_thread, wait_until_blocked

import drainer_amqp
from drainer_amqp import ConnectionClosedIntentionally, ConnectionLost, reading
from drainer_amqp.deferred import ConfirmFuture, Window

MODES = ["drainer", "legacy"]


def consume_all(queue: str, expected: int) -> list[bytes]:
    """Every body in ``queue``: consumed (no_ack) until ``expected`` arrived and the
    queue is empty, so nothing extra hides behind."""
    conn = connect("drainer")
    bodies: list[bytes] = []
    try:
        channel = conn.channel()
        channel.basic_qos(0, 2000, False)
        tag = channel.basic_consume(queue, callback=lambda m: bodies.append(m.body), no_ack=True)
        deadline = time.monotonic() + JOIN * 4
        while len(bodies) < expected and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=1)
            except TimeoutError:
                pass
        # What the broker pushed to the consumer and is not counted yet (it left the
        # queue) runs as the consumer is cancelled; then what the queue still holds.
        channel.basic_cancel(tag)
        return bodies + [m.body for m in iter(lambda: channel.basic_get(queue), None)]
    finally:
        conn.close()


def outcomes(futures: dict[bytes, ConfirmFuture]) -> tuple[set[bytes], dict[bytes, BaseException]]:
    acked, failed = set(), {}
    for body, future in futures.items():
        assert future.done(), f"{body!r} still pending"
        error = future.exception(0)
        if error is None:
            assert future.result(0) is True
            acked.add(body)
        else:
            failed[body] = error
    return acked, failed


@pytest.mark.parametrize(
    ("mode", "threads", "total"),
    [
        ("drainer", 1, 100_000),
        ("drainer", 10, 100_000),
        ("legacy", 1, 20_000),
        ("legacy", 10, 20_000),
    ],
)
def test_every_deferred_publish_is_confirmed_and_in_the_queue(
    mode: str, threads: int, total: int, queue: str
) -> None:
    conn = connect(mode)
    futures: dict[bytes, ConfirmFuture] = {}
    try:
        channels = [conn.channel() for _ in range(threads)]

        def publish(t: int) -> None:
            for n in range(total // threads):
                body = b"%d-%d" % (t, n)
                futures[body] = channels[t].basic_publish_deferred(Message(body), routing_key=queue)

        workers = [threading.Thread(target=partial(publish, t)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(JOIN * 4)
            assert not worker.is_alive()
        for channel in channels:
            assert channel.wait_for_confirms(timeout=JOIN) is True
        stats = conn.drainer_stats()
        assert stats["confirms_outstanding"] == 0
        assert stats["confirms_acked"] == total
    finally:
        conn.close()
    acked, failed = outcomes(futures)
    assert not failed and len(acked) == total
    bodies = consume_all(queue, total)
    assert sorted(bodies) == sorted(acked), "the queue differs from what was acked"


@pytest.mark.parametrize("mode", MODES)
def test_exactly_the_overflowing_publishes_are_nacked(mode: str) -> None:
    queue, length, extra = unique_name("drainer-nack"), 50, 30
    conn = connect(mode)
    try:
        channel = conn.channel()
        channel.queue_declare(
            queue,
            auto_delete=False,
            arguments={"x-max-length": length, "x-overflow": "reject-publish"},
        )
        futures = {
            b"%03d" % n: channel.basic_publish_deferred(Message(b"%03d" % n), routing_key=queue)
            for n in range(length + extra)
        }
        assert channel.wait_for_confirms(timeout=JOIN) is False  # some were nacked
        acked, failed = outcomes(futures)
        assert all(isinstance(e, MessageNacked) for e in failed.values()), failed
        assert len(failed) == extra and len(acked) == length
        assert conn.drainer_stats()["confirms_nacked"] == extra
        bodies = [m.body for m in iter(lambda: channel.basic_get(queue, no_ack=True), None)]
        assert sorted(bodies) == sorted(acked)
        channel.queue_delete(queue)
    finally:
        conn.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_mandatory_publish_to_no_queue_fails_only_its_own_future(mode: str, queue: str) -> None:
    conn = connect(mode)
    try:
        channel = conn.channel()
        before = [
            channel.basic_publish_deferred(Message(b"b%d" % i), routing_key=queue)
            for i in range(20)
        ]
        lost = channel.basic_publish_deferred(
            Message(b"lost"), routing_key="nowhere-" + queue, mandatory=True
        )
        after = [
            channel.basic_publish_deferred(Message(b"a%d" % i), routing_key=queue)
            for i in range(20)
        ]
        with pytest.raises(ChannelError) as info:
            lost.result(JOIN)
        assert info.value.reply_code == 312
        assert all(f.result(JOIN) is True for f in before + after)
        assert conn.drainer_stats()["confirms_returned"] == 1
    finally:
        conn.close()


@pytest.mark.parametrize("mode", MODES)
def test_close_settles_every_outstanding_future_within_its_deadline(mode: str, queue: str) -> None:
    """50,000 outstanding when close() comes: it gives them time, then fails the rest with
    ConnectionClosedIntentionally; none is left pending, none says acked wrongly."""
    conn = connect(mode, max_unconfirmed=50_000)
    channel = conn.channel()
    futures = {
        b"%d" % n: channel.basic_publish_deferred(Message(b"%d" % n), routing_key=queue)
        for n in range(50_000)
    }
    begun = time.monotonic()
    conn.close(timeout=5.0)
    assert time.monotonic() - begun < 5.0 + 0.5
    acked, failed = outcomes(futures)
    assert all(isinstance(e, ConnectionClosedIntentionally) for e in failed.values())
    bodies = set(consume_all(queue, len(acked)))
    assert acked <= bodies, f"acked but not in the queue: {sorted(acked - bodies)[:5]}"


@pytest.mark.parametrize("mode", MODES)
def test_a_connection_closed_by_the_broker_fails_every_outstanding_future_at_once(
    mode: str, queue: str
) -> None:
    conn = connect(mode, max_unconfirmed=100_000)
    channel = conn.channel()
    futures: dict[bytes, ConfirmFuture] = {}
    stop = threading.Event()

    def publish() -> None:
        n = 0
        while not stop.is_set():
            body = b"%d" % n
            try:
                futures[body] = channel.basic_publish_deferred(Message(body), routing_key=queue)
            except Exception:  # noqa: BLE001 - the connection ended under it
                return
            n += 1

    publisher = threading.Thread(target=publish)
    channel.confirm_select()
    # Drainer mode: the drainer waits to dispatch the acks meanwhile, so confirms are
    # outstanding at the close. Legacy mode: nobody reads while the publisher writes.
    locked = mode == "drainer" and conn.transport_lock.acquire()
    publisher.start()
    try:
        assert wait_until(lambda: len(futures) > 2000, JOIN)
        outstanding = conn.unconfirmed.used
        port = conn.sock.getsockname()[1]
        if mode == "legacy":  # somebody must read to notice: a drain, as a consumer would
            drainer_amqp_thread = threading.Thread(
                target=lambda: _drain_until_error(conn), daemon=True
            )
            drainer_amqp_thread.start()
        assert close_broker_connections(port, "test: closed with confirms outstanding") == 1
        if locked:
            conn.transport_lock.release()
            locked = False
        ended = time.monotonic()
        assert wait_until(lambda: conn.reason is not None, JOIN)
        assert wait_until(lambda: all(f.done() for f in list(futures.values())), 1.0 + 0.5), (
            "a future stayed pending after the connection ended"
        )
        assert time.monotonic() - ended < JOIN
    finally:
        if locked:
            conn.transport_lock.release()
        stop.set()
        publisher.join(JOIN)
        conn.close()
    assert outstanding > 0, "nothing was outstanding at the close"
    acked, failed = outcomes(dict(futures))
    assert all(
        isinstance(e, (ConnectionLost, ChannelError)) or "closed" in str(e) for e in failed.values()
    ), set(map(type, failed.values()))
    bodies = set(consume_all(queue, len(acked)))
    assert acked <= bodies, f"acked but not in the queue: {sorted(acked - bodies)[:5]}"


@pytest.mark.parametrize("mode", MODES)
def test_a_reset_link_fails_every_outstanding_future_within_a_second(
    mode: str, queue: str, proxied_broker: Any
) -> None:
    """Toxiproxy resets the link mid-stream (reset_peer): publishers on two channels are
    told at once, every future settles within 1 s of the reset, and none says acked for
    a message the queue does not hold."""
    conn = connect(mode, host=proxied_broker.hostport, max_unconfirmed=100_000)
    channels = [conn.channel() for _ in range(2)]
    futures: dict[bytes, ConfirmFuture] = {}
    raised: list[BaseException] = []

    def publish(t: int) -> None:
        n = 0
        while True:
            body = b"%d-%d" % (t, n)
            try:
                futures[body] = channels[t].basic_publish_deferred(
                    Message(body), routing_key=queue, timeout=JOIN
                )
            except Exception as exc:  # noqa: BLE001 - the reset, asserted below
                raised.append(exc)
                return
            n += 1

    drains = mode == "legacy"  # legacy: somebody must read to notice, as a consumer would
    publishers = [threading.Thread(target=partial(publish, t)) for t in range(2)]
    reader = threading.Thread(target=lambda: _drain_until_error(conn), daemon=True)
    try:
        for thread in publishers:
            thread.start()
        assert wait_until(lambda: len(futures) > 3000, JOIN)
        if drains:  # only now: a legacy read holds the socket, publishes wait behind it
            reader.start()
        proxied_broker.proxy.add_toxic(name="reset", type="reset_peer", attributes={"timeout": 0})
        reset = time.monotonic()
        for thread in publishers:
            thread.join(JOIN)
            assert not thread.is_alive(), "a publisher waited past its timeout"
        assert wait_until(lambda: all(f.done() for f in list(futures.values())), 1.0), (
            "a future stayed pending a second after the reset"
        )
        assert time.monotonic() - reset < JOIN
        assert conn.reason is not None
    finally:
        if "reset" in [t.name for t in proxied_broker.proxy.toxics().values()]:
            proxied_broker.proxy.destroy_toxic("reset")
        conn.close()
        if drains:
            reader.join(JOIN)
    assert len(raised) == 2 and all(isinstance(e, ConnectionLost) for e in raised), raised
    acked, failed = outcomes(dict(futures))
    assert failed, "nothing was outstanding at the reset"
    assert all(isinstance(e, ConnectionLost) for e in failed.values()), {
        type(e) for e in failed.values()
    }
    bodies = set(consume_all(queue, len(acked)))
    assert acked <= bodies, f"acked but not in the queue: {sorted(acked - bodies)[:5]}"


def _drain_until_error(conn: drainer_amqp.Connection) -> None:
    while True:
        try:
            conn.drain_events(timeout=0.2)
        except TimeoutError:
            continue
        except Exception:  # noqa: BLE001 - the end it waits for
            return


@pytest.mark.parametrize("mode", MODES)
def test_outstanding_confirms_never_exceed_max_unconfirmed(mode: str, queue: str) -> None:
    conn = connect(mode, max_unconfirmed=100)
    channel = conn.channel()
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(conn.unconfirmed.used)
            time.sleep(0.0005)  # sampling, not synchronisation

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        futures = [
            channel.basic_publish_deferred(Message(b"x"), routing_key=queue, timeout=JOIN)
            for _ in range(5000)
        ]
        assert channel.wait_for_confirms(timeout=JOIN)
    finally:
        stop.set()
        watcher.join(JOIN)
        conn.close()
    assert max(seen) <= 100, max(seen)
    assert all(f.result(0) for f in futures)


#: How long the never-stopping publisher runs (the issue's full length: 60).
BOUND_SECONDS = float(os.environ.get("DRAINER_BOUND_SECONDS", "5"))


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_a_publisher_that_never_stops_stays_within_its_bounds() -> None:
    """Deferred publishes of 1 KiB without pause, beside a slow consumer: outstanding
    confirms never above max_unconfirmed, what waits to be written never above its byte
    bound, and the process's memory flat after the first quarter."""
    queue = unique_name("drainer-bound")
    conn = connect("drainer", max_unconfirmed=2000)
    consumer_conn = connect("drainer")
    channel = conn.channel()
    writer = conn.writer
    assert writer is not None
    channel.queue_declare(queue, auto_delete=False, arguments={"x-max-length": 20_000})
    stop = threading.Event()
    used: list[int] = []
    unwritten: list[int] = []
    rss: list[tuple[float, float]] = []
    failed: list[BaseException] = []
    began = time.monotonic()

    def watch() -> None:
        while not stop.wait(0.02):  # sampling, not synchronisation
            used.append(conn.unconfirmed.used)
            unwritten.append(writer._behind_bytes)  # noqa: SLF001 - the bound under test
            rss.append((time.monotonic() - began, _rss_mb()))

    def slow_consumer() -> None:
        consumer = consumer_conn.channel()
        consumer.basic_qos(0, 10, False)

        def on_message(message: Message) -> None:
            message.channel.basic_ack(message.delivery_tag)
            stop.wait(0.001)  # a slow consumer: a millisecond per message

        consumer.basic_consume(queue, callback=on_message)
        while not stop.is_set():
            try:
                consumer_conn.drain_events(timeout=0.2)
            except TimeoutError:
                pass

    def on_done(future: concurrent.futures.Future) -> None:
        error = future.exception(0)
        if error is not None:
            failed.append(error)

    threads = [threading.Thread(target=watch), threading.Thread(target=slow_consumer)]
    for thread in threads:
        thread.start()
    published = 0
    try:
        body = b"x" * 1024
        while time.monotonic() - began < BOUND_SECONDS:
            future = channel.basic_publish_deferred(Message(body), routing_key=queue, timeout=JOIN)
            future.add_done_callback(on_done)
            published += 1
        assert channel.wait_for_confirms(timeout=JOIN)
    finally:
        stop.set()
        for thread in threads:
            thread.join(JOIN)
        channel.queue_delete(queue)
        conn.close()
        consumer_conn.close()
    assert not failed, failed[:3]
    assert published > 1000, published
    assert max(used) <= 2000, max(used)
    assert max(unwritten) <= drainer_amqp.writer.UNWRITTEN_LIMIT, max(unwritten)
    settled = [mb for t, mb in rss if t > BOUND_SECONDS / 4]
    grew = max(settled) - settled[0]
    assert grew < 30, f"RSS grew {grew:.0f} MB from {settled[0]:.0f} MB"


def test_a_publish_waits_at_most_its_timeout_for_room(queue: str) -> None:
    conn = connect("drainer", max_unconfirmed=1)
    try:
        channel = conn.channel()
        channel.confirm_select()
        conn.unconfirmed.enter(0)  # the one slot, held by the test: no room
        begun = time.monotonic()
        with pytest.raises(Exception, match="max_unconfirmed"):
            channel.basic_publish_deferred(Message(b"x"), routing_key=queue, timeout=0.2)
        assert 0.15 <= time.monotonic() - begun < JOIN
        conn.unconfirmed.leave()
        assert channel.basic_publish_deferred(Message(b"y"), routing_key=queue).result(JOIN)
    finally:
        conn.close()


def _enter_in_a_thread(window: Window) -> tuple[threading.Thread, list[bool]]:
    """A publisher that waits for a slot of a full window; returns once it waits."""
    got: list[bool] = []
    waiting = len(window._turns)
    thread = threading.Thread(target=lambda: got.append(window.enter(JOIN)))
    thread.start()
    assert wait_until(lambda: len(window._turns) == waiting + 1, JOIN)
    return thread, got


def test_a_full_window_gives_slots_in_arrival_order_once_an_eighth_is_free() -> None:
    """Publishers waiting for a slot get them first come, first served, and only once
    an eighth of the window is free: each then publishes a run, not one message per
    slot freed (one wake-up per message with many publishing threads)."""
    window = Window(80)
    for _ in range(80):
        assert window.enter(0)
    (first, got_first), (second, got_second) = (
        _enter_in_a_thread(window),
        _enter_in_a_thread(window),
    )
    for _ in range(9):
        window.leave()
    assert window.used == 71 and len(window._turns) == 2 and not got_first + got_second
    window.leave()  # 70 outstanding: an eighth is free
    first.join(JOIN)
    second.join(JOIN)
    assert got_first == got_second == [True] and window.used == 72

    small = Window(8)  # an eighth of 8 is one slot: a slot at a time, in arrival order
    for _ in range(8):
        assert small.enter(0)
    (first, got_first), (second, got_second) = _enter_in_a_thread(small), _enter_in_a_thread(small)
    small.leave()
    first.join(JOIN)
    assert got_first == [True] and not got_second and len(small._turns) == 1
    small.leave()
    second.join(JOIN)
    assert got_second == [True] and small.used == 8


def test_kombu_producer_publish_returns_the_future_and_ensure_does_not_republish(
    queue: str,
) -> None:
    with kombu.Connection(
        f"amqp://guest:guest@{BROKER_HOST}//",
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": True, "confirm_publish": "deferred"},
    ) as kconn:
        producer = kombu.Producer(kconn.channel())
        future = producer.publish({"n": 1}, routing_key=queue, retry=True)
        assert isinstance(future, concurrent.futures.Future)
        assert future.result(JOIN) is True
        publish = kconn.ensure(producer, producer.publish, max_retries=3)
        futures = [publish({"n": n}, routing_key=queue) for n in range(2, 12)]
        assert all(f.result(JOIN) for f in futures)
    assert len(consume_all(queue, 11)) == 11  # once each: nothing re-published


def test_a_failed_future_nobody_asked_about_logs_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    conn = connect("drainer")
    try:
        channel = conn.channel()
        future = channel.basic_publish_deferred(
            Message(b"x"), routing_key=unique_name("nowhere"), mandatory=True
        )
        assert wait_until(future.done, JOIN)
        with caplog.at_level(logging.WARNING, logger="drainer_amqp.deferred"):
            del future
            gc.collect()
        assert [r.message for r in caplog.records if "nobody asked" in r.message]
    finally:
        conn.close()


EXIT_SCRIPT = """
import atexit, sys
futures = []
queue = sys.argv[1]


def report():
    done = [f for f in futures if f.done()]
    acked = [f.body for f in done if f.exception(0) is None]
    print("settled", len(done), "of", len(futures), flush=True)
    print("acked", " ".join(acked), flush=True)


atexit.register(report)  # before the library's hook: runs after it
import drainer_amqp
from amqp import Message

conn = drainer_amqp.Connection(host=sys.argv[2], dedicated_drainer=sys.argv[3] == "drainer")
conn.connect()
channel = conn.channel()
for n in range(2000):
    future = channel.basic_publish_deferred(Message(b"m%d" % n), routing_key=queue)
    future.body = "m%d" % n
    futures.append(future)
# exit without close()
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_script_that_exits_without_close_settles_every_future(mode: str, queue: str) -> None:
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(EXIT_SCRIPT), queue, BROKER_HOST, mode],
        capture_output=True,
        timeout=JOIN * 2,
    )
    assert child.returncode == 0, child.stderr.decode(errors="replace")
    lines = dict(line.split(" ", 1) for line in child.stdout.decode().splitlines() if " " in line)
    assert lines["settled"] == "2000 of 2000", lines
    acked = set(lines["acked"].encode().split())
    bodies = set(consume_all(queue, len(acked)))
    assert acked <= bodies, f"acked but not in the queue: {sorted(acked - bodies)[:5]}"
    assert len(acked) == 2000  # the exit hook waited for them


def _fill_the_window(channel: Any, queue: str, pending: Any) -> None:
    for _ in range(2):  # one slot is free: the second publish finds none
        channel.basic_publish_deferred(Message(b"room"), routing_key=queue)


CALLBACK_WAITS: dict[str, Callable[[Any, str, Any], object]] = {
    "a method's reply": lambda ch, queue, pending: ch.queue_declare(queue, passive=True),
    "a synchronous confirm": lambda ch, queue, pending: ch.basic_publish_confirm(
        Message(b"sync"), routing_key=queue
    ),
    "a pending future's result": lambda ch, queue, pending: pending.result(),
    "room among the outstanding confirms": _fill_the_window,
    "wait_for_confirms": lambda ch, queue, pending: ch.wait_for_confirms(),
}


def test_a_done_callback_that_writes_does_not_wait_for_the_drainers_own_write(
    queue: str,
) -> None:
    """A done callback runs in the drainer's thread, which may hold the lead on a write
    behind that the socket has not taken whole (it waits for the socket to be writable):
    a publish from the callback must not wait for that lead, which only its own thread
    would finish (it goes out with that batch), and a call that waits for a reply raises
    at once, having sent nothing.

    Forced: the socket takes the first of two deferred publishes written as one batch,
    then nothing while ``stalled`` is set; the first one's ack comes meanwhile."""
    conn = connect("drainer")
    try:
        channel = conn.channel()
        channel.confirm_select()
        writer = conn.writer
        assert writer is not None
        held, stalled, done = threading.Event(), threading.Event(), threading.Event()
        budget = [0]  # bytes the socket takes while stalled
        start_flush, send_some = writer._start_flush, writer._send_some

        def held_start() -> Any:
            return None if held.is_set() else start_flush()

        def stalling_send(mine: Any) -> bool:
            if not stalled.is_set():
                return send_some(mine)
            whole = writer._unsent
            writer._unsent = whole[: budget[0]]
            send_some(mine)
            taken = budget[0] - len(writer._unsent)
            budget[0] -= taken
            writer._unsent = whole[taken:]
            return not writer._unsent

        writer._start_flush = held_start  # type: ignore[method-assign]
        writer._send_some = stalling_send  # type: ignore[method-assign]
        seen: list[object] = []

        def on_done(future: concurrent.futures.Future[Any]) -> None:
            try:
                channel.basic_publish(Message(b"from-callback"), routing_key=queue)
                seen.append("published")
                channel.queue_declare(queue, passive=True)
                seen.append("declared")
            except BaseException as exc:  # noqa: BLE001 - reported below
                seen.append(exc)
            finally:
                done.set()

        held.set()
        stalled.set()
        first = channel.basic_publish_deferred(Message(b"first"), routing_key=queue)
        second = channel.basic_publish_deferred(Message(b"second"), routing_key=queue)
        budget[0] = sum(map(len, writer._behind[0].chunks))  # the first one's frames
        first.add_done_callback(on_done)
        held.clear()
        conn.reader.wake()  # type: ignore[attr-defined]
        assert done.wait(JOIN), "the done callback hung on its publish"
        assert seen[0] == "published", seen
        assert isinstance(seen[1], drainer_amqp.CannotWaitInReadingThread), seen
        assert writer._flushing is not None  # the drainer still held its lead
        stalled.clear()
        conn.reader.wake()  # type: ignore[attr-defined]
        assert second.result(JOIN) is True
        # Nothing was sent for the refused wait: the next reply is this call's own.
        assert channel.queue_declare(queue, passive=True).message_count >= 0
    finally:
        conn.close()
    assert sorted(consume_all(queue, 3)) == [b"first", b"from-callback", b"second"]


def test_a_done_callback_that_writes_does_not_wait_for_a_write_that_waits_for_it(
    queue: str,
) -> None:
    """Legacy mode: a done callback runs in the thread that reads, holding the transport
    lock, which a writer also takes to write. A publish from the callback must not wait
    for another thread's write, which waits for that lock: it goes out with that write.

    Forced: as the callback runs, another thread publishes, and the callback publishes
    once that thread leads and is taking the socket."""
    conn = connect("legacy")
    try:
        channel, other = conn.channel(), conn.channel()
        channel.confirm_select()
        writer = conn.writer
        assert writer is not None
        io_lock = writer.io_lock
        taking, done = threading.Event(), threading.Event()

        class WatchedLock:  # the socket's lock: says when the other thread goes for it
            def acquire(self, *args: Any, **kwargs: Any) -> bool:
                if threading.current_thread().name == "test-other-publisher":
                    taking.set()
                return bool(io_lock.acquire(*args, **kwargs))

            def release(self) -> None:
                io_lock.release()

        writer.io_lock = WatchedLock()
        publisher = threading.Thread(
            target=lambda: other.basic_publish(Message(b"other"), routing_key=queue),
            name="test-other-publisher",
            daemon=True,
        )
        seen: list[object] = []

        def on_done(future: concurrent.futures.Future[Any]) -> None:
            try:
                publisher.start()
                assert taking.wait(JOIN)
                channel.basic_publish(Message(b"from-callback"), routing_key=queue)
                seen.append("published")
            except BaseException as exc:  # noqa: BLE001 - reported below
                seen.append(exc)
            finally:
                done.set()

        first = channel.basic_publish_deferred(Message(b"first"), routing_key=queue)
        first.add_done_callback(on_done)
        reader = threading.Thread(target=first.result, args=(JOIN,), daemon=True)
        reader.start()  # reads the ack, and runs the callback, holding the lock
        assert done.wait(JOIN), "the done callback hung on its publish"
        assert seen == ["published"], seen
        reader.join(JOIN)
        publisher.join(JOIN)
        assert not reader.is_alive() and not publisher.is_alive()
        assert first.result(0) is True
    finally:
        conn.close()
    assert sorted(consume_all(queue, 3)) == [b"first", b"from-callback", b"other"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("call", sorted(CALLBACK_WAITS))
def test_a_done_callback_that_would_wait_for_itself_raises_at_once(
    call: str, mode: str, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A future's done callback runs in the thread that read its ack, dispatching it: the
    drainer, or in legacy mode the reading caller, holding the transport lock. A call
    there that waits for the broker would wait for itself (drainer mode: for ever
    without a timeout; legacy mode: reading inside that dispatch while the writes wait
    for the lock). It raises ``CannotWaitInReadingThread`` at once instead, and the
    connection carries on."""
    # A legacy publish reads what is waiting (before_publish): here only the first looks,
    # so the acks are read by result() below, not by the publishes themselves.
    monkeypatch.setattr(reading, "BEFORE_PUBLISH_EVERY", JOIN)
    conn = connect(mode, max_unconfirmed=3)
    try:
        channel = conn.channel()
        seen: list[tuple[str, float]] = []
        done = threading.Event()
        futures: list[ConfirmFuture] = []

        def on_done(future: concurrent.futures.Future[Any]) -> None:
            began = time.monotonic()
            try:
                CALLBACK_WAITS[call](channel, queue, futures[1])
                seen.append(("returned", time.monotonic() - began))
            except drainer_amqp.CannotWaitInReadingThread:
                seen.append(("raised", time.monotonic() - began))
            except BaseException as exc:  # noqa: BLE001 - reported below
                seen.append((repr(exc), time.monotonic() - began))
            finally:
                done.set()

        # Holding the transport lock keeps any ack from being dispatched until all three
        # are out: the callback then runs on the first ack, with the second future still
        # pending (its ack comes after) and two of three slots taken.
        channel.confirm_select()  # a round trip: not under the lock
        with conn.transport_lock:
            for body in (b"first", b"pending", b"third"):
                futures.append(channel.basic_publish_deferred(Message(body), routing_key=queue))
            futures[0].add_done_callback(on_done)
        if mode == "legacy":  # this thread reads the acks: the callback runs here
            assert futures[0].result(JOIN) is True
        assert done.wait(JOIN), "the done callback never ran"
        assert seen and seen[0][0] == "raised", seen
        assert seen[0][1] < 1.0, seen
        # the connection still works
        assert channel.basic_publish_deferred(Message(b"after"), routing_key=queue).result(JOIN)
        assert channel.queue_declare(queue, passive=True).queue == queue
    finally:
        conn.close()


def test_the_end_wakes_every_thread_before_the_futures_done_callbacks_run() -> None:
    """The link ends with a deferred publish outstanding whose done callback takes its
    time (here: until the test lets it go). The thread in ``drain_events()`` learns of
    the end at once, not after the callbacks; the callback runs in the thread that
    settles the future (the drainer, which read the end of stream)."""
    with fake_broker() as broker:  # it never acks: the future stays pending
        conn = drainer_amqp.Connection(host=broker.hostport, dedicated_drainer=True)
        conn.connect()
        let_go = threading.Event()
        try:
            future = conn.channel().basic_publish_deferred(Message(b"x"), routing_key="q")
            in_callback = threading.Event()
            ran_in: list[str] = []

            def slow(_: Any) -> None:
                ran_in.append(threading.current_thread().name)
                in_callback.set()
                let_go.wait(JOIN)

            future.add_done_callback(slow)
            consumer, drained = run_in_thread(lambda: conn.drain_events(timeout=JOIN), "consumer")
            assert wait_until_blocked(consumer, ["drain_events"])
            broker.end_stream()
            assert in_callback.wait(JOIN)
            consumer.join(JOIN)
            assert not consumer.is_alive(), "drain_events() woke only after the callbacks"
            assert isinstance(drained[0], drainer_amqp.ConnectionLost), drained
            assert ran_in == [conn.reader.thread.name]  # type: ignore[attr-defined]
        finally:
            let_go.set()
            conn.collect()
