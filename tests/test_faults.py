"""Bad days in drainer mode: resets, garbage from the wire, sliced frames, TLS, fork."""

from __future__ import annotations

import os
import signal
import ssl
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from time import monotonic
from typing import Any

import amqp
import kombu
import pytest
import trustme
from support.broker import BROKER_HOST, unique_name, wait_until
from support.publishing import queue_bodies
from support.relays import relay
from support.threads import CallCounter

import drainer_amqp
from drainer_amqp import ConnectionLost, MalformedFrame, deferred, transport
from drainer_amqp.drainer import CHECK_CLOSED

JOIN = 15.0


@pytest.fixture
def direct() -> Iterator[drainer_amqp.Connection]:
    conn = drainer_amqp.Connection(host=BROKER_HOST, dedicated_drainer=True)
    conn.connect()
    yield conn
    conn.close()


@pytest.fixture
def queue(direct: drainer_amqp.Connection) -> Iterator[str]:
    name = unique_name()
    direct.channel().queue_declare(name, auto_delete=False)
    yield name
    direct.channel().queue_delete(name)


def start_waiters(targets: list[Callable[[], object]]) -> tuple[list, list[threading.Thread]]:
    """One thread per target; each appends what it raised to the returned list."""
    errors: list[BaseException] = []

    def run(target: Callable[[], object]) -> None:
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(t,), name=f"waiter-{i}") for i, t in enumerate(targets)
    ]
    for t in threads:
        t.start()
    return errors, threads


def join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(JOIN)
        assert not t.is_alive(), f"{t.name} hung"


def test_a_reset_releases_every_waiting_thread_with_the_same_error(proxied_broker) -> None:
    conn = drainer_amqp.Connection(host=proxied_broker.hostport, dedicated_drainer=True)
    conn.connect()
    try:
        name = unique_name()
        conn.channel().queue_declare(name, exclusive=True)
        channels = [conn.channel() for _ in range(10)]
        for channel in channels:
            channel.confirm_select()
        # Freeze the broker-to-client stream so that confirms never arrive...
        proxied_broker.proxy.add_toxic(
            type="timeout", stream="downstream", attributes={"timeout": 0}
        )

        def confirm(channel: amqp.Channel) -> Callable[[], object]:
            return lambda: channel.basic_publish_confirm(amqp.Message(b"x"), routing_key=name)

        targets = [lambda: conn.drain_events(timeout=60)] * 10 + [confirm(c) for c in channels]
        errors, threads = start_waiters(targets)
        assert wait_until(lambda: conn.drainer_stats()["waiting_threads"] == 10, 10)
        # ...then kill the link: every waiter wakes with one error.
        proxied_broker.proxy.disable()
        join_all(threads)
        assert len(errors) == 20
        assert all(isinstance(e, ConnectionLost) for e in errors), errors
        assert len({str(e) for e in errors}) == 1
        assert not conn.connected
        with pytest.raises(ConnectionLost):
            conn.channel()
    finally:
        conn.close()


def frame(frame_type: int, channel: int, payload: bytes, end: int = 0xCE) -> bytes:
    return struct.pack(">BHI", frame_type, channel, len(payload)) + payload + bytes([end])


@pytest.mark.parametrize(
    ("garbage", "close_after", "message"),
    [
        (frame(8, 0, b"", end=0x00), False, "frame-end"),
        (frame(42, 0, b"abc"), False, "unknown frame type"),
        (struct.pack(">BHI", 3, 1, 10_000_000), False, "exceeds frame_max"),
        (frame(1, 0, b"\x00\x0a\x00\x1e")[:-2], True, "truncated"),
    ],
    ids=["bad-frame-end", "unknown-type", "above-frame-max", "truncated"],
)
def test_malformed_input_fails_every_waiter_and_stops_the_drainer(
    garbage: bytes, close_after: bool, message: str, no_leaks: None
) -> None:
    with relay() as link:
        conn = drainer_amqp.Connection(host=f"127.0.0.1:{link.port}", dedicated_drainer=True)
        conn.connect()
        try:
            channel = conn.channel()
            channel.basic_consume(
                channel.queue_declare("", exclusive=True).queue, callback=lambda m: None
            )
            errors, threads = start_waiters([lambda: conn.drain_events(timeout=60)] * 5)
            assert wait_until(lambda: conn.drainer_stats()["pending_callbacks"] == 0, 1)
            link.inject(garbage, then_close=close_after)
            join_all(threads)
            assert len(errors) == 5
            assert all(isinstance(e, MalformedFrame) and message in str(e) for e in errors), errors
            assert wait_until(lambda: not conn.drainer_stats()["running"], 5)
        finally:
            conn.close()


def test_a_frame_arriving_in_small_slow_pieces_is_delivered_whole_without_spinning(
    proxied_broker, direct, queue
) -> None:
    calls = CallCounter()
    conn = drainer_amqp.Connection(host=proxied_broker.hostport, dedicated_drainer=True)
    with calls.following_new_threads():
        conn.connect()  # its drainer thread starts: its calls are counted
    try:
        received: list[bytes] = []
        channel = conn.channel()
        channel.basic_consume(queue, no_ack=True, callback=lambda m: received.append(m.body))
        proxy = proxied_broker.proxy
        proxy.add_toxic(type="bandwidth", stream="downstream", attributes={"rate": 64})
        proxy.add_toxic(
            type="slicer",
            stream="downstream",
            attributes={"average_size": 512, "size_variation": 64, "delay": 100},
        )
        body = os.urandom(100_000)
        publisher = direct.channel()
        publisher.confirm_select()
        drainer = next(t for t in threading.enumerate() if t.name == f"drainer-amqp-{conn.host}")
        stats_before = conn.drainer_stats()
        begun = monotonic()
        with calls.window() as counts:
            publisher.basic_publish_confirm(
                amqp.Message(body, content_type="application/octet-stream"), routing_key=queue
            )
            conn.drain_events(timeout=20)
        idle_checks = 2 + int((monotonic() - begun) / CHECK_CLOSED)
        reads = conn.drainer_stats()["reads"] - stats_before["reads"]
        made = counts.get(drainer.ident or -1, Counter())
        assert received == [body]
        assert reads > 50, "the toxics did not slice the frame"
        # A reader asleep in select between pieces makes one pass of its loop per read,
        # and one per idle check; a reader that spins makes thousands, however loaded
        # the machine is.
        passes = made["select"]
        assert 0 < passes <= reads + idle_checks, f"the drainer spun between pieces: {made}"
    finally:
        conn.close()


@pytest.fixture(scope="module")
def tls_ca() -> trustme.CA:
    return trustme.CA()


def test_tls_connection_in_drainer_mode(tls_ca: trustme.CA, tmp_path, no_leaks) -> None:
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.issue_cert("127.0.0.1").configure_cert(server_context)
    ca_file = tmp_path / "ca.pem"
    tls_ca.cert_pem.write_to_path(str(ca_file))
    with relay(server_tls=server_context) as link:
        conn = drainer_amqp.Connection(
            host=f"127.0.0.1:{link.port}",
            ssl={"ca_certs": str(ca_file), "server_hostname": "127.0.0.1"},
            dedicated_drainer=True,
        )
        conn.connect()
        try:
            assert isinstance(conn.sock, ssl.SSLSocket)
            channel = conn.channel()
            name = channel.queue_declare("", exclusive=True).queue
            received: list[bytes] = []
            channel.basic_consume(name, no_ack=True, callback=lambda m: received.append(m.body))
            publisher = conn.channel()
            publisher.confirm_select()
            # Large bodies span several TLS records: decrypted bytes wait in the SSL
            # object, where select() cannot see them (SSLSocket.pending()).
            bodies = [os.urandom(size) for size in (10, 70_000, 120_000, 5)]
            for body in bodies:
                publisher.basic_publish_confirm(
                    amqp.Message(body, content_type="application/octet-stream"), routing_key=name
                )
            while len(received) < len(bodies):
                conn.drain_events(timeout=10)
            assert received == bodies
        finally:
            conn.close()


def test_fork_leaves_the_child_a_clear_error_and_the_parent_untouched(direct, queue) -> None:
    channel = direct.channel()
    channel.confirm_select()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 0
        try:
            try:
                channel.basic_publish_confirm(amqp.Message(b"inherited"), routing_key=queue)
                code = 2
            except ConnectionLost:
                pass
            if direct.connected or any(
                t.name.startswith("drainer-amqp") for t in threading.enumerate()
            ):
                code = 3
            fresh = drainer_amqp.Connection(host=BROKER_HOST, dedicated_drainer=True)
            fresh.connect()
            fresh_channel = fresh.channel()
            fresh_channel.confirm_select()
            fresh_channel.basic_publish_confirm(amqp.Message(b"child"), routing_key=queue)
            fresh.close()
        except BaseException:  # noqa: BLE001 - reported through the exit code
            code = 4
        os._exit(code)
    status: list[int] = []

    def child_done() -> bool:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status.append(code)
        return bool(status)

    assert wait_until(child_done, JOIN), "the child hung"
    assert os.waitstatus_to_exitcode(status[0]) == 0
    channel.basic_publish_confirm(amqp.Message(b"parent"), routing_key=queue)
    bodies = []
    while (message := channel.basic_get(queue, no_ack=True)) is not None:
        bodies.append(message.body)
    assert sorted(bodies) == [b"child", b"parent"]


def test_a_future_inherited_pending_fails_in_the_child(
    direct: drainer_amqp.Connection, queue: str
) -> None:
    """A deferred publish still unconfirmed at the fork: the child's copy of its future
    fails with the inherited connection; the parent's is acked."""
    channel = direct.channel()
    channel.confirm_select()
    with direct.transport_lock:  # the drainer cannot dispatch the ack meanwhile
        future = channel.basic_publish_deferred(amqp.Message(b"pending"), routing_key=queue)
        assert not future.done()
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 1
            try:
                if isinstance(future.exception(JOIN), ConnectionLost):
                    code = 0
            finally:
                os._exit(code)
    assert child_exit_code(pid, "the child's future stayed pending") == 0
    assert future.result(JOIN) is True


#: Locks that a thread of the parent other than the forking one may hold at the fork
#: (the drainer thread settling confirms or queueing deliveries for an event loop, a
#: publisher, a reconnect), and that the child takes as it forgets the inherited
#: connection or opens a new one.
FORK_HELD_LOCKS: dict[str, Callable[[Any, Any, kombu.Connection], Any]] = {
    "the inbox's event-loop pipe": lambda conn, channel, client: conn.inbox.signal()._lock,
    "the drainer's wake-up pipe": lambda conn, channel, client: conn.reader._wake._lock,
    "a channel's confirms": lambda conn, channel, client: channel.confirms._lock,
    "the waiters": lambda conn, channel, client: conn.waiters._lock,
    "the inbox": lambda conn, channel, client: conn.inbox._lock,
    "the futures' lock": lambda conn, channel, client: deferred._CHOOSING,
    "the transport's registry": lambda conn, channel, client: transport._live_lock,
    "a kombu connection's reconnect lock": (
        lambda conn, channel, client: transport._reconnect_locks[client]
    ),
}


@pytest.mark.parametrize("held", sorted(FORK_HELD_LOCKS))
def test_fork_while_another_thread_holds_a_lock_leaves_the_child_working(
    direct: drainer_amqp.Connection, queue: str, held: str
) -> None:
    """A Celery prefork pool forks children while the parent's drainer thread works: a
    lock that thread held at the fork stays held in the child, whose thread is gone. The
    child must neither hang in the fork hook nor later, when it closes what it inherited
    or connects anew."""
    channel = direct.channel()
    channel.confirm_select()
    client = kombu.Connection(
        f"amqp://guest:guest@{BROKER_HOST}//",
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": True, "confirm_publish": True},
    )
    client.ensure_connection(max_retries=1)
    lock = FORK_HELD_LOCKS[held](direct, channel, client)
    taken, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            let_go.wait(JOIN)

    holder = threading.Thread(target=hold, name="lock-holder")
    holder.start()
    try:
        assert taken.wait(JOIN)
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest; the exit code says where
            code = 10
            try:
                with pytest.raises(ConnectionLost):
                    channel.basic_publish_confirm(amqp.Message(b"inherited"), routing_key=queue)
                code = 11
                direct.close()
                code = 12
                client.ensure_connection(max_retries=1)  # reconnects: the link is the parent's
                client.default_channel.basic_publish(amqp.Message(b"kombu"), "", queue)
                client.release()
                code = 13
                fresh = drainer_amqp.Connection(host=BROKER_HOST, dedicated_drainer=True)
                fresh.connect()
                future = fresh.channel().basic_publish_deferred(
                    amqp.Message(b"deferred"), routing_key=queue
                )
                assert future.result(JOIN) is True
                fresh.close()
                code = 0
            finally:
                os._exit(code)
        code = child_exit_code(pid, f"the child hung, holding {held} inherited")
        assert code == 0, f"the child failed at step {code}"
    finally:
        let_go.set()
        holder.join(JOIN)
        client.release()
    assert sorted(queue_bodies(queue)) == [b"deferred", b"kombu"]


def child_exit_code(pid: int, hung: str) -> int:
    """The exit code of the forked child ``pid``; the test fails with ``hung`` (the child
    killed) if it has not exited within ``JOIN``."""
    status: list[int] = []

    def child_done() -> bool:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status.append(os.waitstatus_to_exitcode(code))
        return bool(status)

    if not wait_until(child_done, JOIN):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(hung)
    return status[0]
