"""What a call that returned promises, against the real broker, in both modes.

A publish that returned is written before anything the caller does afterwards that ends
the connection: ``close()``, kombu's ``release()``, ``channel.close()``, a plain exit.
Checked by message identity: every body is unique, and every body whose publish
returned must be in the queue. Publishing threads all make progress, and a failure
reaches a thread waiting in the writer at once.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

import kombu
import pytest
from amqp import Message
from amqp.exceptions import ChannelError, RecoverableConnectionError
from support.broker import BROKER_HOST, JOIN, unique_name, wait_until
from support.fake_broker import frame
from support.publishing import Publishers, connect, lose_the_link_while_publishing, queue_bodies
from support.relays import relay

import drainer_amqp
from drainer_amqp.channel import CLOSE_TIMEOUT

MODES = ["drainer", "legacy"]
THREADS = 10


@pytest.fixture
def fresh_queue() -> Iterator[str]:
    """A unique queue, declared and deleted by a connection of its own."""
    name = unique_name("drainer-promise")
    conn = connect("drainer")
    conn.channel().queue_declare(name, auto_delete=False)
    yield name
    conn.channel().queue_delete(name)
    conn.close()


def assert_delivered(returned: set[bytes], name: str) -> None:
    in_queue = set(queue_bodies(name))
    lost = returned - in_queue
    assert not lost, f"{len(lost)} of {len(returned)} returned publishes lost: {sorted(lost)[:5]}"


@pytest.mark.parametrize("mode", MODES)
def test_close_while_threads_publish_keeps_every_returned_publish(
    mode: str, fresh_queue: str
) -> None:
    conn = connect(mode)
    channels = [conn.channel() for _ in range(THREADS)]

    def publish(i: int, body: bytes) -> None:
        channels[i].basic_publish(Message(body), routing_key=fresh_queue)

    with Publishers(THREADS, publish) as publishers:
        publishers.wait_for(50)
        start = time.perf_counter()
        conn.close()
        took = time.perf_counter() - start
        # Every thread's next publish raises (a thread between two publishes when close()
        # returned must not be stopped before it tries).
        assert wait_until(lambda: all(publishers.errors), JOIN), publishers.errors
    assert took < 1.0, f"close() took {took:.2f}s while threads published"
    for error in publishers.errors:  # a closed connection, or a channel it closed
        assert isinstance(
            error, (drainer_amqp.ConnectionClosedIntentionally, RecoverableConnectionError)
        ), repr(error)
    assert_delivered(publishers.all_returned(), fresh_queue)


@pytest.mark.parametrize("mode", MODES)
def test_kombu_release_while_threads_publish_keeps_every_returned_publish(
    mode: str, fresh_queue: str
) -> None:
    conn = kombu.Connection(
        f"amqp://guest:guest@{BROKER_HOST}//",
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": mode == "drainer"},
    )
    conn.connect()
    producers = [kombu.Producer(conn.channel()) for _ in range(THREADS)]

    def publish(i: int, body: bytes) -> None:
        producers[i].publish(body, routing_key=fresh_queue, retry=False)

    with Publishers(THREADS, publish) as publishers:
        publishers.wait_for(50)
        start = time.perf_counter()
        conn.release()
        took = time.perf_counter() - start
    assert took < 1.0, f"release() took {took:.2f}s while threads published"
    assert_delivered(publishers.all_returned(), fresh_queue)


@pytest.mark.parametrize("mode", MODES)
def test_channel_close_comes_after_every_returned_publish_on_it(
    mode: str, fresh_queue: str
) -> None:
    conn = connect(mode)
    try:
        others = [conn.channel() for _ in range(THREADS - 1)]
        mine = conn.channel()
        sent = []

        def publish(i: int, body: bytes) -> None:
            others[i].basic_publish(Message(body), routing_key=fresh_queue)

        with Publishers(THREADS - 1, publish) as publishers:
            publishers.wait_for(20)
            for n in range(200):
                body = b"mine-%d" % n
                mine.basic_publish(Message(body), routing_key=fresh_queue)
                sent.append(body)
            mine.close()
        returned = publishers.all_returned()
    finally:
        conn.close()
    assert_delivered(returned | set(sent), fresh_queue)


EXIT_SCRIPT = """
import os, signal, sys, threading
import drainer_amqp
from amqp import Message

queue, mode = sys.argv[1], sys.argv[2]
conn = drainer_amqp.Connection(host={host!r}, dedicated_drainer=mode == "drainer")
conn.connect()
started = threading.Barrier(4)

def spam(i):
    channel = conn.channel()
    n = 0
    while True:
        channel.basic_publish(Message(b"daemon-%d-%d" % (i, n)), routing_key=queue)
        if n == 0:
            started.wait()
        n += 1

for i in range(3):
    threading.Thread(target=spam, args=(i,), daemon=True).start()
started.wait()
channel = conn.channel()
for n in range(20):
    channel.basic_publish(Message(b"main-%02d" % n), routing_key=queue)
# no close(), then:
{ending}
"""
MAIN = sorted(b"main-%02d" % n for n in range(20))


def run_script(host: str, queue: str, mode: str, ending: str, status: int) -> None:
    script = textwrap.dedent(EXIT_SCRIPT).format(host=host, ending=ending)
    child = subprocess.run(
        [sys.executable, "-c", script, queue, mode], capture_output=True, timeout=JOIN * 2
    )
    assert child.returncode == status, child.stderr.decode(errors="replace")


@pytest.mark.parametrize("mode", MODES)
def test_a_script_that_publishes_and_exits_delivers_what_returned(
    mode: str, fresh_queue: str
) -> None:
    """A plain exit closes every open connection (the library's exit hook), after what
    returned: the broker routes all of it. Without the Close, RabbitMQ may drop what it
    had read but not routed when the TCP connection drops (seen with stock py-amqp)."""
    for _ in range(5):
        run_script(BROKER_HOST, fresh_queue, mode, "pass  # the script ends", 0)
        assert sorted(b for b in queue_bodies(fresh_queue) if b.startswith(b"main-")) == MAIN


def run_killed_script_through_a_relay(queue: str, mode: str, ending: str, status: int) -> None:
    with relay() as link:
        run_script(f"127.0.0.1:{link.port}", queue, mode, ending, status)

        def written() -> list[bytes]:
            return [body for body in MAIN if body in link.sent]

        assert wait_until(lambda: written() == MAIN, JOIN), written()


@pytest.mark.parametrize(
    ("ending", "status"), [("os._exit(3)", 3), ("os.kill(os.getpid(), signal.SIGKILL)", -9)]
)
@pytest.mark.parametrize("mode", MODES)
def test_a_script_killed_after_publishing_had_written_what_returned(
    mode: str, ending: str, status: int, fresh_queue: str
) -> None:
    """``os._exit()`` and SIGKILL skip the exit hook, and the broker may drop what it had
    not routed, so this checks the wire: every returned publish had left the process
    (a relay between the script and the broker saw its bytes)."""
    for _ in range(5):
        run_killed_script_through_a_relay(fresh_queue, mode, ending, status)


SILENT_BROKERS_SCRIPT = """
import sys
import drainer_amqp

ports, mode = sys.argv[1].split(","), sys.argv[2]
conns = [drainer_amqp.Connection(host="127.0.0.1:" + port, dedicated_drainer=mode == "drainer")
         for port in ports]
for conn in conns:
    conn.connect()
print("connected", flush=True)
sys.stdin.readline()
for conn in conns:
    conn.send_heartbeat()  # the last frame the relay reads
sys.stdin.read()  # until the test closes it; then exit without close()
"""
HEARTBEAT = frame(8, 0, b"")


@pytest.mark.parametrize("mode", MODES)
def test_the_exit_hook_closes_silent_connections_within_one_deadline_in_all(mode: str) -> None:
    """Three connections whose broker stops answering: the exit hook's close() calls
    share one CLOSE_TIMEOUT (one by one they would take three)."""
    with contextlib.ExitStack() as stack:
        links = [stack.enter_context(relay()) for _ in range(3)]
        ports = ",".join(str(link.port) for link in links)
        child = subprocess.Popen(
            [sys.executable, "-c", SILENT_BROKERS_SCRIPT, ports, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        stack.callback(child.kill)
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == b"connected\n"
        for link in links:
            link.stop_after(HEARTBEAT)
        child.stdin.write(b"go\n")
        child.stdin.flush()
        # Each relay has read its heartbeat and stopped: Connection.Close stays unread.
        assert wait_until(lambda: all(link.sent.endswith(HEARTBEAT) for link in links), JOIN)
        start = time.monotonic()
        child.stdin.close()
        status = child.wait(timeout=JOIN * 2)
        took = time.monotonic() - start
    assert status == 0, child.stderr.read() if child.stderr else ""
    assert took < CLOSE_TIMEOUT + 2.0, f"the exit took {took:.1f}s"


STALLED_BROKER_SCRIPT = """
import atexit, sys

handshakes = {}
# Registered before the library's hook, so it runs after it (atexit is last in, first out).
atexit.register(lambda: print("handshakes", sorted(handshakes.items()), flush=True))

import drainer_amqp
from amqp import Message
from drainer_amqp import connection

stalled_port, healthy_ports, queue, mode, broker = sys.argv[1:6]
drainer = mode == "drainer"


def open_connection(host):
    conn = drainer_amqp.Connection(host=host, dedicated_drainer=drainer)
    conn.connect()
    return conn


def publish(conn, name):
    channel = conn.channel()
    for n in range(20):
        channel.basic_publish(Message(b"%s-%02d" % (name, n)), routing_key=queue)


stalled = open_connection("127.0.0.1:" + stalled_port)
healthy = [open_connection("127.0.0.1:" + port) for port in healthy_ports.split(",")]
print("connected", flush=True)
sys.stdin.readline()  # the stalled relay stops reading after its current read:
stalled.send_heartbeat()  # the last bytes it reads
sys.stdin.readline()  # it has read them and stopped
sock = stalled.transport.sock
sock.setblocking(False)
try:
    while True:  # fill the kernel's buffers: the next write blocks
        sock.send(bytes(65536))
except BlockingIOError:
    pass
sock.setblocking(True)
for i, conn in enumerate(healthy):
    publish(conn, b"healthy%d" % i)

# A connection opened while the exit hook runs (after it took its list).
real_send_close = connection.Connection._send_close
late = []


def send_close(self, *args):
    if not late:
        late.append(open_connection(broker))
        publish(late[0], b"late")
    ok = real_send_close(self, *args)
    return ok


def finish_close(self, *args):
    real_finish_close(self, *args)
    closed_ok = self._closed_ok
    handshakes["late" if self in late else self.host] = bool(closed_ok and closed_ok.value)


real_finish_close = connection.Connection._finish_close
connection.Connection._send_close = send_close
connection.Connection._finish_close = finish_close
# exit without close()
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_stalled_broker_costs_the_other_connections_nothing_at_exit(
    mode: str, fresh_queue: str
) -> None:
    """At exit, one broker has stopped reading (even the Close cannot be written) while
    two others are healthy, and a fourth connection opens while the hook runs. The exit
    ends within CLOSE_TIMEOUT, and every healthy connection, the late one too, completes
    its close handshake with everything it published delivered."""
    with relay() as stalled, relay() as one, relay() as two:
        healthy = f"{one.port},{two.port}"
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                STALLED_BROKER_SCRIPT,
                str(stalled.port),
                healthy,
                fresh_queue,
                mode,
                BROKER_HOST,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline() == b"connected\n"
            stalled.stop_after(HEARTBEAT)
            child.stdin.write(b"go\n")
            child.stdin.flush()
            assert wait_until(lambda: stalled.sent.endswith(HEARTBEAT), JOIN)
            start = time.monotonic()
            child.stdin.write(b"fill\n")
            child.stdin.close()
            status = child.wait(timeout=JOIN * 2)
            took = time.monotonic() - start
            output = child.stdout.read().decode()
        finally:
            child.kill()
    assert status == 0, child.stderr.read() if child.stderr else ""
    assert took < CLOSE_TIMEOUT + 2.0, f"the exit took {took:.1f}s"
    handshakes = dict(eval(output.split("handshakes", 1)[1]))  # noqa: S307 - our own output
    assert handshakes == {
        f"127.0.0.1:{stalled.port}": False,
        f"127.0.0.1:{one.port}": True,
        f"127.0.0.1:{two.port}": True,
        "late": True,
    }, handshakes
    bodies = set(queue_bodies(fresh_queue))
    for name in (b"healthy0", b"healthy1", b"late"):
        missing = {b"%s-%02d" % (name, n) for n in range(20)} - bodies
        assert not missing, f"returned but lost: {sorted(missing)}"


FAILING_CLOSE_SCRIPT = """
import atexit, sys

closed = []
# Registered before the library's hook, so it runs after it (atexit is last in, first out).
atexit.register(lambda: print("closed", closed, "failed", failed_index, flush=True))

import drainer_amqp
from amqp import Message
from drainer_amqp import connection

queue, mode = sys.argv[1], sys.argv[2]
drainer = mode == "drainer"
conns = [drainer_amqp.Connection(host={host!r}, dedicated_drainer=drainer) for _ in range(2)]
for i, conn in enumerate(conns):
    conn.connect()
    channel = conn.channel()
    for n in range(20):
        channel.basic_publish(Message(b"conn%d-%02d" % (i, n)), routing_key=queue)

real_send_close = connection.Connection._send_close
real_finish_close = connection.Connection._finish_close
failed_index = None


def send_close(self, *args):
    global failed_index
    if failed_index is None:  # the first connection the hook closes
        failed_index = conns.index(self)
        raise OSError("this close fails")
    return real_send_close(self, *args)


def finish_close(self, *args):
    real_finish_close(self, *args)
    closed.append(bool(self._closed_ok and self._closed_ok.value))


connection.Connection._send_close = send_close
connection.Connection._finish_close = finish_close
# exit without close()
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_close_that_fails_at_exit_leaves_the_others_closed(mode: str, fresh_queue: str) -> None:
    """The exit hook closes every connection: one whose close raises is logged and left,
    and the next still completes its close handshake with all it published delivered."""
    script = textwrap.dedent(FAILING_CLOSE_SCRIPT).format(host=BROKER_HOST)
    child = subprocess.run(
        [sys.executable, "-c", script, fresh_queue, mode], capture_output=True, timeout=JOIN * 2
    )
    stderr = child.stderr.decode(errors="replace")
    assert child.returncode == 0, stderr
    assert "this close fails" in stderr, stderr  # logged, with its traceback
    assert "Exception ignored" not in stderr, stderr
    _, closed, _, failed = child.stdout.decode().split(maxsplit=3)
    assert closed == "[True]", child.stdout
    other = b"conn%d" % (1 - int(failed))
    bodies = set(queue_bodies(fresh_queue))
    missing = {b"%s-%02d" % (other, n) for n in range(20)} - bodies
    assert not missing, f"returned but lost: {sorted(missing)}"


REFUSED_THREADS_SCRIPT = """
import atexit, sys, threading
import drainer_amqp
from amqp import Message

queue = sys.argv[1]


def goodbye():
    # What Python 3.12 does to a thread started while the interpreter shuts down.
    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    threading.Thread.start = refuse
    conn = drainer_amqp.Connection(host={host!r}, dedicated_drainer=True)
    conn.connect()
    conn.channel().basic_publish_confirm(Message(b"goodbye"), routing_key=queue)
    print("dedicated_drainer", conn.dedicated_drainer, flush=True)
    # no close(): the library's hook, registered before this one, runs after it


atexit.register(goodbye)
"""


def test_a_drainer_connection_opened_where_python_refuses_threads_reads_in_its_callers(
    fresh_queue: str,
) -> None:
    """An atexit handler that connects and publishes (a service's last message): where
    Python refuses new threads then (3.12), the connection reads in its callers' threads,
    as stock's does, says so, and its confirmed publish is delivered."""
    script = textwrap.dedent(REFUSED_THREADS_SCRIPT).format(host=BROKER_HOST)
    child = subprocess.run(
        [sys.executable, "-c", script, fresh_queue], capture_output=True, timeout=JOIN * 2
    )
    stderr = child.stderr.decode(errors="replace")
    assert child.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert "refuses new threads" in stderr, stderr  # the warning
    assert child.stdout.decode().split() == ["dedicated_drainer", "False"], child.stdout
    assert queue_bodies(fresh_queue) == [b"goodbye"]


@pytest.mark.parametrize("threads", [10, 100])
@pytest.mark.parametrize("mode", MODES)
def test_every_publishing_thread_makes_progress(mode: str, threads: int, fresh_queue: str) -> None:
    conn = connect(mode)
    try:
        channels = [conn.channel() for _ in range(threads)]

        def publish(i: int, body: bytes) -> None:
            channels[i].basic_publish(Message(body), routing_key=fresh_queue, timeout=5.0)

        with Publishers(threads, publish) as publishers:
            threading.Event().wait(5.0)  # the run's length, not a synchronisation
        counts = publishers.counts()
    finally:
        conn.close()
    assert not any(publishers.errors), publishers.errors
    mean = sum(counts) / len(counts)
    assert min(counts) >= 0.05 * mean, f"a thread starved: {counts}"
    assert max(publishers.longest) < 2.0, f"longest publish {max(publishers.longest):.3f}s"


@pytest.mark.parametrize("mode", MODES)
def test_a_thread_waiting_in_the_writer_learns_of_a_failure_at_once(mode: str) -> None:

    conn = connect(mode)
    try:
        channel = conn.channel()
        writer = conn.writer
        assert writer is not None
        # Hold the socket's write lock: the leader's write waits, the next publish queues.
        io_lock = writer.io_lock
        io_lock.acquire()
        outcome: list[BaseException | None] = []
        raised_at: list[float] = []

        def publish() -> None:
            try:
                channel.basic_publish(Message(b"x"), routing_key="nowhere")
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001
                outcome.append(exc)
            raised_at.append(time.perf_counter())

        leader = threading.Thread(target=publish, name="leader")
        follower = threading.Thread(target=publish, name="follower")
        leader.start()
        assert wait_until(lambda: writer.busy, JOIN)
        follower.start()
        assert wait_until(lambda: bool(writer._queue), JOIN), "the follower did not queue"
        failed_at = time.perf_counter()
        conn.end(drainer_amqp.ConnectionLost("test: link failed"))
        follower.join(JOIN)
        assert not follower.is_alive()
        assert isinstance(outcome[0], drainer_amqp.ConnectionLost), outcome
        assert raised_at[0] - failed_at < 0.1
        io_lock.release()
        leader.join(JOIN)
    finally:
        conn.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", ["py-amqp", "kombu"])
def test_an_unroutable_mandatory_publish_raises_no_route(mode: str, api: str) -> None:
    key = unique_name("drainer-no-queue")
    if api == "py-amqp":
        conn = connect(mode, confirm_publish=True)
        try:
            channel = conn.channel()
            with pytest.raises(ChannelError) as info:
                channel.basic_publish(Message(b"x"), routing_key=key, mandatory=True)
            assert info.value.reply_code == 312
            channel.basic_publish(Message(b"y"), routing_key=key)  # not mandatory: fine
        finally:
            conn.close()
    else:
        with kombu.Connection(
            f"amqp://guest:guest@{BROKER_HOST}//",
            transport="drainer_amqp:Transport",
            transport_options={"dedicated_drainer": mode == "drainer", "confirm_publish": True},
        ) as conn:
            producer = kombu.Producer(conn.channel())
            with pytest.raises(ChannelError) as info:
                producer.publish(b"x", routing_key=key, mandatory=True, retry=False)
            assert info.value.reply_code == 312


@pytest.mark.parametrize("mode", [*MODES, "stock"])
def test_a_link_failure_loses_no_more_returned_publishes_than_the_kernel_held(
    mode: str, fresh_queue: str
) -> None:
    """The relay stops reading while 10 threads publish 1 KiB messages, then the link
    dies (:func:`lose_the_link_while_publishing`). The returned publishes that are not
    in the queue must fit in the kernel's buffers on the way: what stock py-amqp loses
    too (checked here, its callers taking turns under a lock), and nothing the library
    held back after a publish returned."""
    loss = lose_the_link_while_publishing(mode, fresh_queue, THREADS)
    for error in loss.errors:
        assert isinstance(error, (OSError, RecoverableConnectionError)), repr(error)
    assert not loss.strangers, "the queue holds a message nobody published"
    assert loss.lost * loss.body_size <= loss.held, loss


ACKED_BEFORE_END = 300  # acks a consumer makes, then it ends the connection at once
HELD_BACK = 20  # the last acks, made while the drainer is kept from writing behind
PREFILLED = 600


def prefill(queue: str, n: int = PREFILLED) -> None:
    conn = connect("drainer")
    try:
        channel = conn.channel()
        for i in range(n):
            channel.basic_publish(Message(b"todo-%04d" % i), routing_key=queue)
        assert wait_until(
            lambda: channel.queue_declare(queue, passive=True).message_count == n, JOIN
        )
    finally:
        conn.close()


def queue_size(queue: str) -> int:
    conn = connect("drainer")
    try:
        return int(conn.channel().queue_declare(queue, passive=True).message_count)
    finally:
        conn.close()


def assert_acks_applied(acked: list[bytes], queue: str) -> None:
    """Every acked body left the queue; every other one is back in it."""
    assert len(acked) == ACKED_BEFORE_END
    left = queue_bodies(queue)
    assert not set(acked) & set(left), f"{len(set(acked) & set(left))} acked bodies redelivered"
    assert sorted(left + acked) == sorted(b"todo-%04d" % i for i in range(PREFILLED))


def hold_back_writes(conn: drainer_amqp.Connection, held: threading.Event) -> None:
    """Once ``held`` is set, the drainer starts no new write behind (one under way ends):
    what is queued then waits for whoever sends next (in drainer mode; legacy writes
    every ack before it returns)."""
    writer = conn.writer
    assert writer is not None
    start = writer._start_flush
    writer._start_flush = lambda: None if held.is_set() else start()  # type: ignore[method-assign]


def acks_in(stream: bytes, channel_id: int) -> set[int]:
    """The delivery tags of the ``Basic.Ack`` frames on ``channel_id`` in what a client
    sent (its protocol header first)."""
    tags = set()
    at = 8
    while at + 7 <= len(stream):
        kind, channel, size = struct.unpack_from(">BHI", stream, at)
        if kind == 1 and channel == channel_id and stream[at + 7 : at + 11] == b"\x00\x3c\x00\x50":
            tags.add(struct.unpack_from(">Q", stream, at + 11)[0])
        at += 7 + size + 1
    return tags


@pytest.mark.parametrize("ending", ["close", "channel.close", "kombu release", "link failure"])
@pytest.mark.parametrize("mode", MODES)
def test_every_ack_that_returned_is_applied_before_the_end(
    mode: str, ending: str, fresh_queue: str
) -> None:
    """An ack that returned is written: whatever ends the connection or the channel next
    comes after it on the wire, and a link that fails right after it loses it no more
    than stock: it had reached the kernel. Acks made while another thread publishes on
    the connection, then the last ones with the drainer kept from writing anything
    behind, as the end comes.

    The link failure is the client's socket shut for writing (the kernel sends what it
    holds, then the end) behind a relay that keeps every byte the client sent: each ack
    that returned must be among them. The broker is not asked which it applied: on a link
    that ends without a close, it may drop acks it had received, whatever the client."""
    prefill(fresh_queue)
    acked: list[bytes] = []
    tags: list[int] = []
    held = threading.Event()

    def ack(settle: Callable[[], object], body: bytes, tag: int) -> None:
        if len(acked) < ACKED_BEFORE_END:
            if len(acked) == ACKED_BEFORE_END - HELD_BACK:
                held.set()
            settle()
            acked.append(body)
            tags.append(tag)

    with contextlib.ExitStack() as stack:
        conn: kombu.Connection | None = None
        if ending == "kombu release":
            conn = kombu.Connection(
                f"amqp://guest:guest@{BROKER_HOST}//",
                transport="drainer_amqp:Transport",
                transport_options={"dedicated_drainer": mode == "drainer"},
            )
            consumer = kombu.Consumer(
                conn.channel(),
                queues=[kombu.Queue(fresh_queue, no_declare=True)],
                callbacks=[
                    lambda body, message: ack(message.ack, message.body, message.delivery_tag)
                ],
                accept=None,
                prefetch_count=100,
            )
            consumer.consume()
            drainer_conn = conn.connection
        else:
            if ending == "link failure":
                link = stack.enter_context(relay())
                drainer_conn = connect(mode, host=f"127.0.0.1:{link.port}")
            else:
                drainer_conn = connect(mode)
            channel = drainer_conn.channel()
            channel.basic_qos(0, 100, False)
            channel.basic_consume(
                fresh_queue,
                callback=lambda m: ack(
                    partial(channel.basic_ack, m.delivery_tag), m.body, m.delivery_tag
                ),
            )
        hold_back_writes(drainer_conn, held)
        side = drainer_conn.channel()
        nowhere = unique_name("drainer-promise-nowhere")

        def publish(i: int, body: bytes) -> None:  # keeps the writer busy, routed nowhere
            side.basic_publish(Message(body), routing_key=nowhere)

        def drain_until(count: int) -> None:
            deadline = time.monotonic() + JOIN
            while len(acked) < count and time.monotonic() < deadline:
                drainer_conn.drain_events(timeout=1)

        try:
            with Publishers(1, publish) as publishers:
                publishers.wait_for(10)
                drain_until(ACKED_BEFORE_END - HELD_BACK)
            drain_until(ACKED_BEFORE_END)  # the publisher has stopped: these stay queued
            if ending == "close":
                drainer_conn.close()
            elif ending == "channel.close":
                channel.close()
                drainer_conn.close()
            elif ending == "link failure":
                drainer_conn.sock.shutdown(socket.SHUT_WR)
                assert link.client_ended.wait(JOIN)
                assert len(acked) == ACKED_BEFORE_END
                unwritten = set(tags) - acks_in(bytes(link.sent), channel.channel_id)
                assert not unwritten, f"{len(unwritten)} acks returned and never sent"
                # The broker requeues what it did not apply once it sees the link end.
                assert wait_until(lambda: queue_size(fresh_queue) >= PREFILLED - len(acked), JOIN)
            else:
                assert conn is not None
                conn.release()
        finally:
            drainer_conn.collect()
    if ending == "link failure":  # nothing lost: each body acked or back in the queue
        left = queue_bodies(fresh_queue)
        assert set(left) | set(acked) == {b"todo-%04d" % i for i in range(PREFILLED)}
    else:
        assert_acks_applied(acked, fresh_queue)


ACK_EXIT_SCRIPT = """
import sys
import drainer_amqp

queue, mode, count, held = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
conn = drainer_amqp.Connection(host={host!r}, dedicated_drainer=mode == "drainer")
conn.connect()
channel = conn.channel()
channel.basic_qos(0, 100, False)
acked = []

def on_delivery(message):
    if len(acked) < count:
        if len(acked) == count - held:  # the drainer starts no write behind from here on
            conn.writer._start_flush = lambda: None
        channel.basic_ack(message.delivery_tag)
        acked.append(message.body.decode())

channel.basic_consume(queue, callback=on_delivery)
while len(acked) < count:
    conn.drain_events(timeout=10)
print(" ".join(acked), flush=True)
# no close(): the script ends
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_script_that_acks_and_exits_applied_every_ack(mode: str, fresh_queue: str) -> None:
    """The exit hook's close comes after every ack that returned, the last ones still
    queued in the writer (the drainer kept from writing them)."""
    prefill(fresh_queue)
    script = textwrap.dedent(ACK_EXIT_SCRIPT).format(host=BROKER_HOST)
    child = subprocess.run(
        [sys.executable, "-c", script, fresh_queue, mode, str(ACKED_BEFORE_END), str(HELD_BACK)],
        capture_output=True,
        timeout=JOIN * 2,
    )
    assert child.returncode == 0, child.stderr.decode(errors="replace")
    acked = [body.encode() for body in child.stdout.decode().split()]
    assert_acks_applied(acked, fresh_queue)
