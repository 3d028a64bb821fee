"""Deferred publisher confirms against the real broker, in both modes: every future
settles exactly once, says acked only for a message the broker has, and never stays
pending past the connection's end. Checked by message identity."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import subprocess
import sys
import textwrap
import threading
import time
from functools import partial

import kombu
import pytest
from amqp import Message
from amqp.exceptions import ChannelError, MessageNacked
from support.broker import BROKER_HOST, JOIN, close_broker_connections, unique_name, wait_until
from support.publishing import connect

import drainer_amqp
from drainer_amqp import ConnectionClosedIntentionally, ConnectionLost
from drainer_amqp.deferred import ConfirmFuture

MODES = ["drainer", "legacy"]


def consume_all(queue: str, expected: int) -> list[bytes]:
    """Every body in ``queue``: consumed (no_ack) until ``expected`` arrived and the
    queue is empty, so nothing extra hides behind."""
    conn = connect("drainer")
    bodies: list[bytes] = []
    try:
        channel = conn.channel()
        channel.basic_qos(0, 2000, False)
        channel.basic_consume(queue, callback=lambda m: bodies.append(m.body), no_ack=True)
        deadline = time.monotonic() + JOIN * 4
        while len(bodies) < expected and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=1)
            except TimeoutError:
                pass
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
