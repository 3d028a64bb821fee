"""The group-committing Writer on its own, with a fake socket: order, contiguity, a send
that returns only once written, the leader's hand-over, timeouts, ``last`` and failure.

Every wait here has a deadline; the fake socket blocks only when a test holds it."""

from __future__ import annotations

import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from drainer_amqp import writer as writer_module
from drainer_amqp.writer import _WRITTEN, Writer, _Message

JOIN = 30.0


class FakeSocket:
    """Records what is written; ``hold()`` makes each ``sendall`` wait for a permit."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.calls: list[str] = []  # the name of the thread of each sendall
        self.entered = threading.Semaphore(0)  # released as each sendall starts
        self._permits: threading.Semaphore | None = None
        self.error: OSError | None = None
        self.timeout: float | None = None  # as a socket's: sendall raises after it
        self.takes: int | None = None  # bytes a non-blocking send takes (None: all)

    def gettimeout(self) -> float | None:
        return self.timeout

    def settimeout(self, timeout: float | None) -> None:
        self.timeout = timeout

    def hold(self) -> None:
        self._permits = threading.Semaphore(0)

    def permit(self, n: int = 1) -> None:
        assert self._permits is not None
        for _ in range(n):
            self._permits.release()

    def release_all(self) -> None:
        permits, self._permits = self._permits, None
        if permits is not None:
            permits.release(1000)

    def setblocking(self, flag: bool) -> None:
        self.timeout = None if flag else 0.0

    def send(self, payload: bytes) -> int:
        """The flusher's non-blocking write: takes at most ``takes`` bytes (all if None);
        BlockingIOError when it takes none."""
        assert self.timeout == 0.0, "a flusher's write must not block"
        self.calls.append(threading.current_thread().name)
        if self.error is not None:
            raise self.error
        n = len(payload) if self.takes is None else min(self.takes, len(payload))
        if not n:
            raise BlockingIOError()
        self.data += bytes(payload[:n])
        return n

    def sendall(self, payload: bytes) -> None:
        self.calls.append(threading.current_thread().name)
        self.entered.release()
        permits = self._permits
        if permits is not None:
            if not permits.acquire(timeout=JOIN if self.timeout is None else self.timeout):
                assert self.timeout is not None, "the test never permitted this write"
                raise TimeoutError("timed out")  # socket.timeout
        if self.error is not None:
            raise self.error
        self.data += payload


def make_writer(sock: object, io_lock: object = None) -> Writer:
    """A writer whose socket errors end it, as a connection's do."""
    box: list[Writer] = []

    def on_error(exc: BaseException) -> BaseException:
        box[0].fail(lambda: ConnectionError(f"socket failed: {exc}"))
        return ConnectionError(f"socket failed: {exc}")

    writer = Writer(sock, io_lock or threading.RLock(), on_error)  # type: ignore[arg-type]
    box.append(writer)
    return writer


def start(target: Callable[[], object], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def entered(sock: FakeSocket) -> None:
    assert sock.entered.acquire(timeout=JOIN), "no sendall started"


def queued(writer: Writer, n: int) -> None:
    """Until ``n`` messages wait in the queue (the threads sending them are asleep)."""
    deadline = time.monotonic() + JOIN
    while len(writer._queue) < n:  # noqa: SLF001 - the queue is the point under test
        assert time.monotonic() < deadline, f"{len(writer._queue)} queued, not {n}"
        time.sleep(0.001)


def busy_writer(first: bytes = b"A") -> tuple[FakeSocket, Writer, threading.Thread]:
    """A writer whose leader (a thread sending ``first``) is held inside ``sendall``."""
    sock = FakeSocket()
    sock.hold()
    writer = make_writer(sock)
    leader = start(lambda: writer.send([first]), "leader")
    entered(sock)
    return sock, writer, leader


def sender(
    writer: Writer, data: bytes, name: str, **kwargs: object
) -> tuple[threading.Thread, list]:
    """A thread sending ``data`` (``kwargs``: as ``send``'s); its list gets "ok" or the
    exception once it returns."""
    outcome: list[object] = []

    def run() -> None:
        try:
            writer.send([data], **kwargs)  # type: ignore[arg-type]
            outcome.append("ok")
        except BaseException as exc:  # noqa: BLE001 - asserted by the tests
            outcome.append(exc)

    return start(run, name), outcome


def test_messages_of_many_threads_arrive_whole_and_in_each_threads_order(switching: None) -> None:
    sock = FakeSocket()
    writer = make_writer(sock)
    threads, per_thread = 16, 300
    errors: list[BaseException] = []

    def publisher(t: int) -> None:
        try:
            for i in range(per_thread):
                # three chunks, as a method, header and body frame
                writer.send([b"<%d:" % t, b"%d" % i, b">"])
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    workers = [start(partial(publisher, t), f"pub-{t}") for t in range(threads)]
    for w in workers:
        w.join(JOIN)
    assert not any(w.is_alive() for w in workers) and not errors
    messages = re.findall(rb"<(\d+):(\d+)>", bytes(sock.data))
    assert len(messages) == threads * per_thread, "a message was lost or torn"
    assert b"".join(b"<%s:%s>" % m for m in messages) == bytes(sock.data)
    for t in range(threads):
        seen = [int(i) for tt, i in messages if int(tt) == t]
        assert seen == list(range(per_thread)), f"thread {t}'s messages out of order"
    assert not writer.busy


def test_numbering_follows_the_write_order(switching: None) -> None:
    """Delivery tags are numbered as messages are taken: they match the wire order with
    no lock of the caller's."""
    sock = FakeSocket()
    writer = make_writer(sock)
    tags: dict[bytes, int] = {}
    counter = [0]

    def publisher(t: int) -> None:
        for i in range(200):
            name = b"%d.%d" % (t, i)

            def number(name: bytes = name) -> None:
                counter[0] += 1
                tags[name] = counter[0]

            writer.send([b"<" + name + b">"], take=number)

    workers = [start(partial(publisher, t), f"pub-{t}") for t in range(8)]
    for w in workers:
        w.join(JOIN)
    wire = re.findall(rb"<([\d.]+)>", bytes(sock.data))
    assert [tags[name] for name in wire] == list(range(1, 8 * 200 + 1))


def test_a_send_returns_only_once_its_bytes_are_written() -> None:
    sock, writer, leader = busy_writer()
    follower, outcome = sender(writer, b"B", "follower")
    queued(writer, 1)  # B's thread is asleep in the writer
    assert not outcome, "B returned before it was written"
    sock.permit()  # A's write ends; B's thread is woken, leads and writes B
    leader.join(JOIN)
    entered(sock)
    assert not outcome, "B returned before its own write ended"
    sock.permit()
    follower.join(JOIN)
    assert outcome == ["ok"]
    assert bytes(sock.data) == b"AB"
    assert sock.calls == ["leader", "follower"]


def test_the_leader_writes_one_batch_and_wakes_its_first_waiter_to_lead_the_queue() -> None:
    sock, writer, leader = busy_writer()
    b, b_out = sender(writer, b"B", "B")
    queued(writer, 1)
    c, c_out = sender(writer, b"C", "C")
    queued(writer, 2)
    sock.permit()  # A is written: the leader's call ends, B is woken and leads B and C
    leader.join(JOIN)
    assert not leader.is_alive(), "the leader did not return after its batch"
    entered(sock)
    d, d_out = sender(writer, b"D", "D")  # comes while B and C are written: next batch
    queued(writer, 1)
    sock.permit()
    b.join(JOIN)
    c.join(JOIN)
    entered(sock)  # D writes its own batch
    sock.permit()
    d.join(JOIN)
    assert b_out == c_out == d_out == ["ok"]
    assert sock.calls == ["leader", "B", "D"]
    assert bytes(sock.data) == b"ABCD"
    assert not writer.busy


def test_a_reply_nobody_waits_for_is_queued_and_goes_out_with_the_next_batch() -> None:
    sock, writer, leader = busy_writer(b"first")
    writer.send([b"second"], block=False)  # returns at once: the leader writes it
    assert writer.busy and bytes(sock.data) == b""
    sock.release_all()
    leader.join(JOIN)
    assert not leader.is_alive()
    assert bytes(sock.data) == b"firstsecond"
    assert sock.calls == ["leader", "leader"]
    assert not writer.busy


def test_a_queued_message_that_times_out_is_not_written() -> None:
    sock, writer, leader = busy_writer()
    begun = time.monotonic()
    with pytest.raises(TimeoutError, match="not draining"):
        writer.send([b"X"], timeout=0.2)
    assert 0.15 <= time.monotonic() - begun < JOIN
    sock.release_all()
    leader.join(JOIN)
    writer.send([b"B"])
    assert bytes(sock.data) == b"AB"


def test_a_timeout_while_its_batch_is_written_says_it_may_have_been(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The late call's wait times out while the follower is inside ``sendall`` with its
    message: it may or may not be written yet, and the error says so."""
    real_wait = _Message.wait
    in_flight = threading.Event()

    def wait_then_time_out(message: _Message, timeout: float | None) -> bool:
        if message.chunks != [b"C"]:
            return real_wait(message, timeout)
        assert in_flight.wait(JOIN), "the follower never wrote the late message"
        return False  # its timer fires while its batch is being written

    monkeypatch.setattr(_Message, "wait", wait_then_time_out)
    sock, writer, leader = busy_writer()
    follower, outcome = sender(writer, b"B", "follower")
    queued(writer, 1)
    late, late_out = sender(writer, b"C", "late", timeout=JOIN)
    queued(writer, 2)
    sock.permit()  # A done: the follower leads B and C and is held writing them
    entered(sock)
    in_flight.set()
    late.join(JOIN)
    assert isinstance(late_out[0], TimeoutError) and "may have been" in str(late_out[0])
    sock.release_all()
    follower.join(JOIN)
    leader.join(JOIN)
    assert outcome == ["ok"]
    assert bytes(sock.data) == b"ABC"


@pytest.mark.parametrize("outcome", ["written", "failed"])
def test_a_timeout_that_ends_as_its_batch_is_done_reports_what_happened(
    monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    """The late call's wait times out at the moment the follower's write of its batch
    ends: it returns OK if its bytes were written and raises the connection's reason if
    the write failed, never "may have been"."""
    real_wait = _Message.wait

    def wait_then_time_out(message: _Message, timeout: float | None) -> bool:
        if message.chunks != [b"C"]:
            return real_wait(message, timeout)
        assert real_wait(message, JOIN), "the late message was never woken"
        return False  # its timer fired just as the follower woke it

    monkeypatch.setattr(_Message, "wait", wait_then_time_out)
    sock, writer, leader = busy_writer()
    follower, follower_out = sender(writer, b"B", "follower")
    queued(writer, 1)
    late, late_out = sender(writer, b"C", "late", timeout=JOIN)
    queued(writer, 2)
    sock.permit()  # A done: the follower leads B and C
    entered(sock)
    if outcome == "failed":
        sock.error = BrokenPipeError(32, "Broken pipe")
    sock.release_all()
    for thread in (late, follower, leader):
        thread.join(JOIN)
    if outcome == "written":
        assert late_out == follower_out == ["ok"]
        assert bytes(sock.data) == b"ABC"
    else:
        assert isinstance(late_out[0], ConnectionError), late_out
        assert "Broken pipe" in str(late_out[0])
        assert bytes(sock.data) == b"A"


def test_fail_raises_in_every_queued_thread_at_once_and_refuses_later_sends() -> None:
    sock, writer, leader = busy_writer()
    waiting = [sender(writer, b"%d" % i, f"w{i}") for i in range(5)]
    queued(writer, 5)
    writer.fail(lambda: ConnectionAbortedError("the connection ended"))
    for thread, outcome in waiting:
        thread.join(JOIN)  # none of them waits for the leader's write
        assert isinstance(outcome[0], ConnectionAbortedError), outcome
    with pytest.raises(ConnectionAbortedError, match="ended"):
        writer.send([b"C"])
    sock.release_all()
    leader.join(JOIN)
    assert bytes(sock.data) == b"A"  # the leader's batch was taken before the failure
    assert not writer.busy


def test_a_socket_error_fails_the_batch_and_the_queue_and_every_later_send() -> None:
    sock, writer, leader = busy_writer()
    b, b_out = sender(writer, b"B", "B")
    queued(writer, 1)
    sock.permit()
    leader.join(JOIN)
    entered(sock)  # B leads its batch
    c, c_out = sender(writer, b"C", "C")
    queued(writer, 1)
    sock.error = BrokenPipeError(32, "Broken pipe")
    sock.release_all()
    b.join(JOIN)
    c.join(JOIN)
    assert isinstance(b_out[0], ConnectionError) and "Broken pipe" in str(b_out[0])
    assert isinstance(c_out[0], ConnectionError)
    with pytest.raises(ConnectionError):
        writer.send([b"D"])
    assert not writer.busy


def test_a_last_message_goes_after_everything_before_it_and_nothing_after_it() -> None:
    sock, writer, leader = busy_writer()
    before, before_out = sender(writer, b"B", "before")
    queued(writer, 1)
    closing: list[object] = []

    def send_last() -> None:
        writer.send([b"CLOSE"], last=lambda: ConnectionAbortedError("closed"))
        closing.append("ok")

    closer = start(send_last, "closer")
    queued(writer, 2)
    # `last` took effect as the close was queued: no later send gets in behind it.
    with pytest.raises(ConnectionAbortedError, match="closed"):
        writer.send([b"late"])
    sock.release_all()
    for t in (leader, before, closer):
        t.join(JOIN)
    assert before_out == closing == ["ok"]
    assert bytes(sock.data) == b"ABCLOSE"


class FlakySocket:
    """A socket with random stalls and short writes, and a failure on demand."""

    def __init__(self, rng: random.Random) -> None:
        self.data = bytearray()
        self.rng = rng
        self.broken = False
        self._lock = threading.Lock()

    def gettimeout(self) -> float | None:
        return None

    def settimeout(self, timeout: float | None) -> None:
        pass

    def sendall(self, payload: bytes) -> None:
        view = memoryview(payload)
        while view:
            if self.broken:
                raise ConnectionResetError(104, "Connection reset by peer")
            n = self.rng.randint(1, max(1, len(view)))  # a short write
            with self._lock:
                self.data += view[:n]
            view = view[n:]
            if self.rng.random() < 0.05:
                time.sleep(self.rng.random() * 0.002)  # a stall


@pytest.mark.parametrize("seed", range(6))
def test_randomized_every_send_that_returned_is_written_once_whole_and_in_order(
    seed: int,
) -> None:
    rng = random.Random(seed)
    sock = FlakySocket(random.Random(seed + 1000))
    writer = make_writer(sock)
    threads = rng.randint(2, 50)
    per_thread = rng.randint(20, 120)
    fail_after = rng.choice([None, rng.uniform(0.01, 0.2)])
    returned: list[list[int]] = [[] for _ in range(threads)]
    overdue: list[float] = []
    sizes = [10, 100, 1000, 60_000, 64 * 1024, 70_000]

    def publisher(t: int) -> None:
        r = random.Random(seed * 1000 + t)
        for i in range(per_thread):
            body = b"." * r.choice(sizes)
            timeout = r.choice([None, 0.05, 1.0])
            begun = time.monotonic()
            try:
                writer.send([b"<%d:%d:" % (t, i), body, b">"], timeout=timeout)
            except TimeoutError:
                pass  # not written, or said it may have been: checked below
            except ConnectionError:
                return
            else:
                returned[t].append(i)
            if timeout is not None and time.monotonic() - begun > timeout + 5.0:
                overdue.append(time.monotonic() - begun)

    workers = [start(partial(publisher, t), f"pub-{t}") for t in range(threads)]
    if fail_after is not None:
        time.sleep(fail_after)  # a random moment of the run, not a synchronisation
        sock.broken = True
    for w in workers:
        w.join(JOIN * 2)
        assert not w.is_alive(), "a sender hung"
    assert not overdue, f"waits past their timeout: {overdue}"
    data = bytes(sock.data)
    whole = re.findall(rb"<(\d+):(\d+):\.*>", data)
    written = [(int(t), int(i)) for t, i in whole]
    assert len(set(written)) == len(written), "a message was written twice"
    for t in range(threads):
        mine = [i for tt, i in written if tt == t]
        assert mine == sorted(mine), f"thread {t}'s messages out of order"
        missing = set(returned[t]) - set(mine)
        assert not missing, f"thread {t}: sends returned OK but not written: {sorted(missing)}"
    if fail_after is None:
        assert b"".join(m.group(0) for m in re.finditer(rb"<\d+:\d+:\.*>", data)) == data


# -- timeouts, interrupts and refusals leave the writer as if the caller never came ------


def numbering(tags: dict[bytes, int]) -> Callable[[bytes], Callable[[], None]]:
    """``take`` callbacks that number messages as a channel numbers delivery tags."""
    counter = [0]

    def take_for(name: bytes) -> Callable[[], None]:
        def take() -> None:
            counter[0] += 1
            tags[name] = counter[0]

        return take

    return take_for


def test_a_publish_that_times_out_while_queued_takes_no_delivery_tag() -> None:
    """The broker numbers what it receives: a message that left the queue unwritten must
    not have used a tag, or every later ack is matched to the wrong publish."""
    tags: dict[bytes, int] = {}
    take_for = numbering(tags)
    sock = FakeSocket()
    sock.hold()
    writer = make_writer(sock)
    leader = start(lambda: writer.send([b"<A>"], take=take_for(b"A")), "A")
    entered(sock)
    with pytest.raises(TimeoutError, match="not draining"):
        writer.send([b"<B>"], take=take_for(b"B"), timeout=0.05)
    c, c_out = sender(writer, b"<C>", "C", take=take_for(b"C"))
    queued(writer, 1)
    d, d_out = sender(writer, b"<D>", "D", take=take_for(b"D"))
    queued(writer, 2)
    sock.release_all()
    for thread in (leader, c, d):
        thread.join(JOIN)
    assert c_out == d_out == ["ok"]
    wire = re.findall(rb"<(\w)>", bytes(sock.data))
    assert wire == [b"A", b"C", b"D"]
    assert [tags[name] for name in wire] == [1, 2, 3], tags
    assert b"B" not in tags


def interrupt_wait_of(
    monkeypatch: pytest.MonkeyPatch, chunk: bytes, after_wake: bool
) -> threading.Event:
    """``KeyboardInterrupt`` in the wait of the message ``chunk``, as a signal handler
    raises it: at once, or just after its thread was woken (handed the lead)."""
    real_wait = _Message.wait
    raised = threading.Event()

    def wait(message: _Message, timeout: float | None) -> bool:
        if message.chunks != [chunk]:
            return real_wait(message, timeout)
        if after_wake:
            assert real_wait(message, JOIN), "never woken"
        raised.set()
        raise KeyboardInterrupt

    monkeypatch.setattr(_Message, "wait", wait)
    return raised


def assert_idle_and_working(writer: Writer, sock: FakeSocket) -> None:
    """Nobody holds the lead, nobody is counted as waiting for a turn, and a new send is
    written at once."""
    assert not writer.busy, "the lead was orphaned"
    assert not writer._queue  # noqa: SLF001 - the queue is the point under test
    assert not writer._turn_waiters, "a thread that left is still counted as waiting"
    sender_thread, outcome = sender(writer, b"Z", "after")
    sender_thread.join(JOIN)
    assert outcome == ["ok"], outcome
    assert bytes(sock.data).endswith(b"Z")


def test_an_interrupt_while_queued_removes_the_message_and_keeps_the_turns(
    monkeypatch: pytest.MonkeyPatch, switching: None
) -> None:
    interrupt_wait_of(monkeypatch, b"X", after_wake=False)
    tags: dict[bytes, int] = {}
    take_for = numbering(tags)
    sock, writer, leader = busy_writer()
    with pytest.raises(KeyboardInterrupt):
        writer.send([b"X"], take=take_for(b"X"))
    y, y_out = sender(writer, b"Y", "Y")
    queued(writer, 1)
    sock.release_all()
    for thread in (leader, y):
        thread.join(JOIN)
    assert y_out == ["ok"]
    assert bytes(sock.data) == b"AY", "raised, yet written"
    assert not tags, "an interrupted message took a tag"
    assert_idle_and_working(writer, sock)


@pytest.mark.parametrize("left", ["waiter", "reply", "reply, with a flusher"])
def test_an_interrupt_as_it_is_woken_to_lead_passes_the_turn_on(
    monkeypatch: pytest.MonkeyPatch, switching: None, left: str
) -> None:
    """X, first in the queue, is woken to lead it (nobody leads) and a signal lands just
    then: X's message leaves unwritten and its KeyboardInterrupt propagates, and the
    turn passes on: Y, waiting behind it, leads; a reply nobody waits for is written by
    X's clean-up, or by the flusher if there is one."""
    raised = interrupt_wait_of(monkeypatch, b"X", after_wake=True)
    sock, writer, leader = busy_writer()
    wakes: list[str] = []
    if left.endswith("flusher"):
        writer.flusher_wake = lambda: wakes.append("wake")
    x, x_out = sender(writer, b"X", "X")
    queued(writer, 1)
    threads = [leader, x]
    if left == "waiter":
        y, y_out = sender(writer, b"Y", "Y")
        threads.append(y)
        queued(writer, 2)
    else:
        writer.send([b"Y"], block=False)
    sock.release_all()
    for thread in threads:
        thread.join(JOIN)
    assert raised.is_set()
    assert isinstance(x_out[0], KeyboardInterrupt), x_out
    if left == "waiter":
        assert y_out == ["ok"], "the queue was left without a leader"
    if left.endswith("flusher"):
        assert wakes == ["wake"] and bytes(sock.data) == b"A"
        assert writer.flush() is False
    assert bytes(sock.data) == b"AY", "raised, yet written; or Y never written"
    assert sock.calls[-1] == {"waiter": "Y", "reply": "X"}.get(left, "MainThread")
    assert_idle_and_working(writer, sock)


def test_a_timeout_as_it_is_woken_to_lead_passes_the_turn_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the interrupt above, with X's timer firing as it is woken: it raises "not
    draining" (nothing of it was written) and Y, behind it, leads."""
    real_wait = _Message.wait

    def wait_then_time_out(message: _Message, timeout: float | None) -> bool:
        if message.chunks != [b"X"]:
            return real_wait(message, timeout)
        assert real_wait(message, JOIN), "X was never woken"
        return False

    monkeypatch.setattr(_Message, "wait", wait_then_time_out)
    sock, writer, leader = busy_writer()
    x, x_out = sender(writer, b"X", "X", timeout=JOIN)
    queued(writer, 1)
    y, y_out = sender(writer, b"Y", "Y")
    queued(writer, 2)
    sock.release_all()
    for thread in (leader, x, y):
        thread.join(JOIN)
    assert isinstance(x_out[0], TimeoutError) and "not draining" in str(x_out[0]), x_out
    assert y_out == ["ok"]
    assert bytes(sock.data) == b"AY"
    assert_idle_and_working(writer, sock)


def slow_after_its_first_wake(
    monkeypatch: pytest.MonkeyPatch, chunk: bytes, until: threading.Event
) -> threading.Event:
    """The thread of the message ``chunk``, once first woken, is slow to run: it goes on
    only once ``until`` is set. Returns an event set as it is woken."""
    real_wait = _Message.wait
    woken = threading.Event()

    def wait(message: _Message, timeout: float | None) -> bool:
        if message.chunks != [chunk] or woken.is_set():
            return real_wait(message, timeout)
        assert real_wait(message, JOIN), f"{chunk!r} was never woken"
        woken.set()
        assert until.wait(JOIN), f"{chunk!r}'s thread was never let go on"
        return True

    monkeypatch.setattr(_Message, "wait", wait)
    return woken


def test_the_thread_that_let_go_of_the_lead_queues_behind_the_waiter_it_woke(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The leader's write of A ends: it wakes B to lead the queue. Its next send, made
    before B runs, queues behind B instead of taking the lead back (a thread
    publishing in a loop would otherwise keep the lead); B leads both."""
    a2_queued = threading.Event()
    b_woken = slow_after_its_first_wake(monkeypatch, b"B", until=a2_queued)
    sock = FakeSocket()
    sock.hold()
    writer = make_writer(sock)
    outcome: list[object] = []

    def leader_twice() -> None:
        writer.send([b"A"])
        assert b_woken.wait(JOIN)
        writer.send([b"a"])
        outcome.append("ok")

    leader = start(leader_twice, "leader")
    entered(sock)
    b, b_out = sender(writer, b"B", "B")
    queued(writer, 1)
    sock.release_all()
    queued(writer, 2)  # B's message and the leader's second, nobody leading
    assert not writer.busy
    a2_queued.set()
    for thread in (b, leader):
        thread.join(JOIN)
    assert b_out == outcome == ["ok"]
    assert bytes(sock.data) == b"ABa"
    assert sock.calls == ["leader", "B"]
    assert_idle_and_working(writer, sock)


def test_a_newcomer_leads_the_queue_while_its_woken_waiter_sleeps_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the leader's write is done it lets go of the lead and wakes B, first in the
    queue; C, who comes before B runs, leads at once, B's message and its own in one
    write; B finds its message written and returns. The socket never waits for a
    sleeping thread's wake-up."""
    c_done = threading.Event()
    b_woken = slow_after_its_first_wake(monkeypatch, b"B", until=c_done)
    sock, writer, leader = busy_writer()
    b, b_out = sender(writer, b"B", "B")
    queued(writer, 1)
    sock.release_all()
    leader.join(JOIN)
    assert b_woken.wait(JOIN)
    assert not writer.busy, "the lead waits for a sleeping thread"
    writer.send([b"C"])  # this thread leads B's message and its own
    c_done.set()
    b.join(JOIN)
    assert b_out == ["ok"]
    assert bytes(sock.data) == b"ABC"
    assert sock.calls == ["leader", threading.current_thread().name]
    assert_idle_and_working(writer, sock)


def test_an_interrupt_between_a_leaders_write_and_its_hand_over_hands_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signal lands in the leader just after its ``sendall``: the clean-up hands the
    queue on (nothing written twice, nobody left waiting) and then raises."""
    real_hand_over = Writer._hand_over
    interrupted: list[str] = []

    def hand_over(self: Writer, mine: _Message) -> None:
        if not interrupted and threading.current_thread().name == "leader":
            interrupted.append("once")
            raise KeyboardInterrupt
        real_hand_over(self, mine)

    monkeypatch.setattr(Writer, "_hand_over", hand_over)
    sock = FakeSocket()
    sock.hold()
    writer = make_writer(sock)
    leader, leader_out = sender(writer, b"A", "leader")
    entered(sock)
    b, b_out = sender(writer, b"B", "B")
    queued(writer, 1)
    sock.release_all()
    for thread in (leader, b):
        thread.join(JOIN)
    assert interrupted == ["once"]
    assert isinstance(leader_out[0], KeyboardInterrupt), leader_out
    assert b_out == ["ok"]
    assert bytes(sock.data) == b"AB", "written twice, or not at all"
    assert_idle_and_working(writer, sock)


class InterruptingLock:
    """A lock whose ``n``-th entry by the thread named ``name`` raises
    ``KeyboardInterrupt`` instead (a signal landing as it takes the lock)."""

    def __init__(self, lock: Any, name: str, n: int) -> None:
        self._lock, self._name, self._n = lock, name, n
        self.entries = 0

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        if threading.current_thread().name == self._name:
            self.entries += 1
            if self.entries == self._n:
                raise KeyboardInterrupt
        return bool(self._lock.acquire(*args, **kwargs))

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@pytest.mark.parametrize("where", ["taking the socket", "letting go"])
def test_an_interrupted_lone_leader_writes_its_message_once_and_lets_go(where: str) -> None:
    """Nobody else writes or waits: a signal lands in the leader as it takes the socket
    (its message taken, nothing written: the clean-up writes it, taken means written),
    or just after its ``sendall``, as it takes the lock to let go of the lead. Either
    way the message is written once and the lead let go, then the interrupt raises; the
    next send is written at once."""
    sock = FakeSocket()
    if where == "taking the socket":
        lock = InterruptingLock(threading.RLock(), "leader", 1)
        writer = make_writer(sock, lock)
    else:
        writer = make_writer(sock)
        writer._lock = lock = InterruptingLock(writer._lock, "leader", 2)  # type: ignore[assignment]
    leader, leader_out = sender(writer, b"A", "leader")
    leader.join(JOIN)
    assert lock.entries >= 2
    assert isinstance(leader_out[0], KeyboardInterrupt), leader_out
    assert bytes(sock.data) == b"A", "written twice, or not at all"
    assert_idle_and_working(writer, sock)


def lead_and_queue(
    writer: Writer, sock: FakeSocket, names: str, **kwargs: dict[str, object]
) -> list[tuple[threading.Thread, list]]:
    """A leader sending ``A``, held inside ``sendall`` by ``sock`` (held), then a thread
    sending each of ``names`` (``kwargs[name]``: its send's), each queued before the
    next starts, so the leader wakes the first to lead the rest: [(thread, outcome)],
    the leader's first."""
    senders = [sender(writer, b"A", "leader")]
    entered(sock)
    for n, name in enumerate(names, 1):
        senders.append(sender(writer, name.encode(), name, **kwargs.get(name, {})))
        queued(writer, n)
    return senders


def test_the_first_waiter_of_a_batch_wakes_the_others_even_if_it_saw_its_state_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A leader wakes only the first waiter whose message it wrote and leaves it the
    others to wake. Here that waiter (Y), awake already, sees its message written while
    the leader (X) is still handing over, before it was given the others: it must wait
    for the hand-over and wake them (Z), not return and leave Z asleep for ever."""
    y_came = threading.Event()  # Y is done, or waits for the writer's lock

    class WatchedLock:
        """The writer's lock; notes when Y comes to take it."""

        def __init__(self) -> None:
            self._lock = threading.Lock()

        def __enter__(self) -> None:
            if threading.current_thread().name == "Y" and hooked:
                y_came.set()
            self._lock.acquire()

        def __exit__(self, *exc_info: object) -> None:
            self._lock.release()

    hooked: list[str] = []
    slot = _Message.__dict__["state"]  # the slot's own descriptor

    class HookedMessage(_Message):
        """Y's message: as X's hand-over marks it written, Y is woken (as by an earlier
        wake-up it had not used yet) and X waits until Y is done or waits for the lock."""

        __slots__ = ()

        @property  # type: ignore[override]
        def state(self) -> int:
            return slot.__get__(self, _Message)  # type: ignore[no-any-return]

        @state.setter
        def state(self, value: int) -> None:
            slot.__set__(self, value)
            name = threading.current_thread().name
            if value == _WRITTEN and self.chunks == [b"Y"] and name == "X" and not hooked:
                hooked.append("once")
                assert self._signal is not None
                self._signal.release()
                assert y_came.wait(JOIN), "Y neither returned nor waited for the lock"

    monkeypatch.setattr(writer_module, "_Message", HookedMessage)
    sock = FakeSocket()
    sock.hold()
    writer = make_writer(sock)
    writer._lock = WatchedLock()  # type: ignore[assignment]  # noqa: SLF001
    senders = lead_and_queue(writer, sock, "XYZ")
    y_thread, y_out = senders[2]

    def y_done() -> None:
        y_thread.join(JOIN)
        y_came.set()

    start(y_done, "watch-Y")
    sock.release_all()
    for thread, _ in senders:
        thread.join(JOIN)
    assert hooked == ["once"]
    assert [out for _, out in senders] == [["ok"]] * 4
    assert bytes(sock.data) == b"AXYZ"
    assert_idle_and_working(writer, sock)


def test_a_waiter_that_gave_up_on_its_batch_is_not_left_to_wake_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Y times out while X writes the batch that holds Y's message and Z's: Y's call
    raises (it may have been written) and its thread leaves, so X wakes Z itself."""
    give_up = threading.Event()

    class GivingUpMessage(_Message):
        """Y's message: its wait times out once X writes its batch."""

        __slots__ = ()

        def wait(self, timeout: float | None) -> bool:
            if self.chunks == [b"Y"]:
                assert give_up.wait(JOIN)
                return False
            return super().wait(timeout)

    monkeypatch.setattr(writer_module, "_Message", GivingUpMessage)
    sock = FakeSocket()
    sock.hold()
    writer = make_writer(sock)
    senders = lead_and_queue(writer, sock, "XYZ", Y={"timeout": JOIN})
    sock.permit()  # A is written; X leads X, Y and Z, and waits in sendall
    entered(sock)
    give_up.set()
    y_thread, y_out = senders[2]
    y_thread.join(JOIN)
    assert isinstance(y_out[0], TimeoutError) and "may have been" in str(y_out[0])
    sock.release_all()
    for thread, _ in senders:
        thread.join(JOIN)
    outcomes = [out for _, out in senders]
    assert outcomes[:2] == [["ok"], ["ok"]] and outcomes[3] == ["ok"], outcomes
    assert bytes(sock.data) == b"AXYZ"
    assert_idle_and_working(writer, sock)


class ReaderHeldLock:
    """A writer's ``io_lock`` as in legacy mode, where a reader holds it while it reads:
    ``hold()`` takes it in a thread of its own until ``let_go()``. ``first_wait[name]``
    runs as the thread ``name`` first waits for it (a signal handler that raises, say)."""

    def __init__(self, first_wait: dict[str, Callable[[], None]]) -> None:
        self._lock = threading.RLock()
        self._first_wait = dict(first_wait)
        self._release = threading.Event()
        self._holder: threading.Thread | None = None

    def hold(self) -> None:
        held = threading.Event()

        def reader() -> None:
            with self._lock:
                held.set()
                self._release.wait(JOIN)

        self._holder = start(reader, "reader")
        assert held.wait(JOIN)

    def let_go(self) -> None:
        self._release.set()
        if self._holder is not None:
            self._holder.join(JOIN)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        first_wait = self._first_wait.pop(threading.current_thread().name, None)
        if first_wait is not None:
            first_wait()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def test_an_interrupt_while_the_leader_waits_for_the_socket_still_writes_its_batch() -> None:
    """Legacy mode: the leader waits for the socket, which a reader holds, and a signal
    lands in that wait. Nothing was written, but its message (and Y's, queued behind)
    were taken, numbered: it writes them once the reader lets go, then raises; the
    connection goes on, with the numbering matching the wire."""
    tags: dict[bytes, int] = {}
    take_for = numbering(tags)
    sock = FakeSocket()
    interrupted = threading.Event()

    def signal_handler() -> None:
        interrupted.set()
        raise KeyboardInterrupt

    io_lock = ReaderHeldLock({"X": signal_handler})
    writer = make_writer(sock, io_lock)
    io_lock.hold()
    x, x_out = sender(writer, b"X", "X", take=take_for(b"X"))
    assert interrupted.wait(JOIN)
    y, y_out = sender(writer, b"Y", "Y", take=take_for(b"Y"))
    queued(writer, 1)
    io_lock.let_go()
    for thread in (x, y):
        thread.join(JOIN)
    assert isinstance(x_out[0], KeyboardInterrupt), x_out
    assert y_out == ["ok"], y_out
    assert bytes(sock.data) == b"XY"
    assert tags == {b"X": 1, b"Y": 2}
    assert_idle_and_working(writer, sock)


def test_a_leader_that_cannot_get_the_socket_by_its_deadline_ends_the_connection() -> None:
    """The reader keeps the socket past the leader's deadline: the leader's message was
    taken (numbered), so it must be written or the connection must end. It ends, at
    about the deadline, for every thread: the leader and the sender queued behind it
    raise, and later sends too."""
    sock = FakeSocket()
    box: list[Writer] = []
    io_lock = ReaderHeldLock({"X": lambda: queued(box[0], 1)})  # Y queues first
    writer = make_writer(sock, io_lock)
    box.append(writer)
    io_lock.hold()
    try:
        started = time.monotonic()
        x, x_out = sender(writer, b"X", "X", timeout=0.2)
        queued_behind, behind_out = sender(writer, b"Y", "Y")
        for thread in (x, queued_behind):
            thread.join(JOIN)
        assert time.monotonic() - started < JOIN / 2
        assert isinstance(x_out[0], ConnectionError), x_out
        assert isinstance(behind_out[0], ConnectionError), behind_out
        with pytest.raises(ConnectionError):
            writer.send([b"Z"])
    finally:
        io_lock.let_go()
    assert bytes(sock.data) == b""


def test_an_endless_timeout_is_no_timeout() -> None:
    """``timeout=float('inf')`` used to raise OverflowError in the lock's wait, leaving
    the message queued with nobody to write it."""
    sock, writer, leader = busy_writer()
    waiting, outcome = sender(writer, b"B", "B", timeout=float("inf"))
    queued(writer, 1)
    sock.release_all()
    for thread in (leader, waiting):
        thread.join(JOIN)
    assert outcome == ["ok"]
    assert bytes(sock.data) == b"AB"
    assert_idle_and_working(writer, sock)


def test_a_leaders_own_write_has_its_deadline_and_the_connection_ends_at_it() -> None:
    """Nobody else writes, and the socket takes nothing: the caller's timeout bounds its
    ``sendall`` (``close()`` and the exit hook rely on that), and since part of a frame
    may be on the wire, the connection ends."""
    sock = FakeSocket()
    sock.hold()  # never permitted: a broker that stopped reading
    writer = make_writer(sock)
    begun = time.monotonic()
    with pytest.raises(ConnectionError, match="timed out"):
        writer.send([b"A"], timeout=0.1)
    assert time.monotonic() - begun < JOIN / 2
    assert sock.timeout is None, "the socket's own timeout was not restored"
    with pytest.raises(ConnectionError):
        writer.send([b"B"])
    assert not writer.busy


def test_a_timeout_that_races_fail_raises_the_connections_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The connection fails just as a queued message's wait times out: the message was
    dropped, not maybe written."""
    real_wait = _Message.wait
    sock, writer, leader = busy_writer()

    def wait(message: _Message, timeout: float | None) -> bool:
        if message.chunks != [b"B"]:
            return real_wait(message, timeout)
        writer.fail(lambda: ConnectionAbortedError("the connection ended"))
        return False  # its timer fired as fail() took it from the queue

    monkeypatch.setattr(_Message, "wait", wait)
    with pytest.raises(ConnectionAbortedError, match="ended"):
        writer.send([b"B"], timeout=JOIN)
    sock.release_all()
    leader.join(JOIN)
    assert bytes(sock.data) == b"A"


def test_a_write_failure_whose_handler_does_not_end_the_writer_still_fails_the_queue() -> None:
    """``on_error`` should end the connection (so :meth:`Writer.fail` runs); if it does
    not, the waiters still get an error, not an assertion or a hang."""
    sock = FakeSocket()
    sock.hold()
    writer = Writer(sock, threading.RLock(), lambda exc: ConnectionError(f"lost: {exc}"))  # type: ignore[arg-type]
    leader, leader_out = sender(writer, b"A", "leader")
    entered(sock)
    b, b_out = sender(writer, b"B", "B")
    queued(writer, 1)
    sock.error = BrokenPipeError(32, "Broken pipe")
    sock.release_all()
    for thread in (leader, b):
        thread.join(JOIN)
    assert isinstance(leader_out[0], ConnectionError), leader_out
    assert isinstance(b_out[0], ConnectionError), b_out
    with pytest.raises(ConnectionError):
        writer.send([b"C"])
    assert not writer.busy


def test_a_refused_message_is_not_written_and_raises_its_error_in_its_thread() -> None:
    """A take may refuse its message (the channel was closed meanwhile): that message
    alone is dropped, the batch around it is written."""
    sock, writer, leader = busy_writer()

    def refuse() -> None:
        raise LookupError("channel closed")

    b, b_out = sender(writer, b"B", "B")
    queued(writer, 1)
    r, r_out = sender(writer, b"R", "R", take=refuse)
    queued(writer, 2)
    writer.send([b"N"], block=False)
    sock.release_all()
    for thread in (leader, b, r):
        thread.join(JOIN)
    assert b_out == ["ok"]
    assert isinstance(r_out[0], LookupError), r_out
    assert bytes(sock.data) == b"ABN"
    with pytest.raises(LookupError):
        writer.send([b"S"], take=refuse)  # refused as it leads, too
    assert_idle_and_working(writer, sock)


# -- written behind (a deferred publish): the flusher writes it -------------------------
def flushing_writer() -> tuple[FakeSocket, Writer, list[str]]:
    """A writer with a flusher; the list counts its wake-ups (the test flushes)."""
    sock = FakeSocket()
    writer = make_writer(sock)
    wakes: list[str] = []
    writer.flusher_wake = lambda: wakes.append("wake")
    return sock, writer, wakes


def test_a_send_written_behind_returns_unwritten_and_the_flusher_writes_it_in_order() -> None:
    sock, writer, wakes = flushing_writer()
    told: list[object] = []
    for data in (b"A", b"B", b"C"):
        writer.send([data], behind=told.append)
    assert bytes(sock.data) == b""
    assert wakes == ["wake"]  # once for the three: the flusher was owed a flush already
    assert writer.flush() is False  # all written, nothing left
    assert bytes(sock.data) == b"ABC"
    assert told == []
    writer.send([b"D"])  # a blocking send: written by its own thread, as ever
    assert bytes(sock.data) == b"ABCD"
    assert_idle_and_working(writer, sock)


def test_a_leader_leaves_what_nobody_waits_for_to_the_flusher() -> None:
    """A leader writes its own batch; messages behind it that nobody waits for go to the
    flusher, so no thread writes for others without end."""
    sock, writer, leader = busy_writer()
    wakes: list[str] = []
    writer.flusher_wake = lambda: wakes.append("wake")
    writer.send([b"B"], behind=lambda error: None)
    writer.send([b"C"], behind=lambda error: None)
    assert wakes == []  # a leader is writing: it hands them on when done
    sock.release_all()
    leader.join(JOIN)
    assert bytes(sock.data) == b"A"
    assert wakes == ["wake"]
    assert not writer.busy
    assert writer.flush() is False
    assert bytes(sock.data) == b"ABC"
    assert_idle_and_working(writer, sock)


def test_a_waiter_behind_messages_written_behind_gets_them_written_first() -> None:
    sock, writer, leader = busy_writer()
    writer.flusher_wake = lambda: None
    writer.send([b"B"], behind=lambda error: None)
    c, c_out = sender(writer, b"C", "C")
    queued(writer, 2)
    sock.release_all()
    for thread in (leader, c):
        thread.join(JOIN)
    assert c_out == ["ok"]
    assert bytes(sock.data) == b"ABC"  # C's thread wrote B before its own C
    assert_idle_and_working(writer, sock)


def test_the_flusher_keeps_the_lead_while_the_socket_takes_part_and_never_blocks() -> None:
    sock, writer, _ = flushing_writer()
    sock.takes = 2
    writer.send([b"AAAAA"], behind=lambda error: None)
    assert writer.flush() is True  # three bytes wait for the socket
    assert writer.busy
    b, b_out = sender(writer, b"B", "B")  # a blocking send waits behind the flusher's lead
    queued(writer, 1)
    assert writer.flush() is True
    sock.takes = 0
    assert writer.flush() is True  # the socket takes nothing: BlockingIOError, no wait
    sock.takes = None
    assert writer.flush() is False  # AAAAA done; the lead went to B's thread
    b.join(JOIN)
    assert b_out == ["ok"]
    assert bytes(sock.data) == b"AAAAAB"
    assert_idle_and_working(writer, sock)


def test_a_refused_message_written_behind_is_told_outside_the_writers_lock() -> None:
    """Its callback settles a future, whose done-callbacks are user code: they may send."""
    sock, writer, _ = flushing_writer()
    told: list[object] = []

    def refuse() -> None:
        raise LookupError("channel closed")

    def on_refused(error: BaseException | None) -> None:
        assert writer._lock.acquire(blocking=False), "told under the writer's lock"  # noqa: SLF001
        writer._lock.release()  # noqa: SLF001
        writer.send([b"X"], behind=told.append)  # from the callback, as user code might
        told.append(error)

    writer.send([b"A"], behind=told.append)
    writer.send([b"R"], take=refuse, behind=on_refused)
    writer.send([b"C"], behind=told.append)
    while writer.flush():
        pass
    while writer.flush():  # X, queued by the callback
        pass
    assert [type(e) for e in told] == [LookupError]
    assert bytes(sock.data) == b"ACX"
    assert_idle_and_working(writer, sock)


def test_fail_tells_every_message_written_behind_and_still_queued() -> None:
    sock, writer, _ = flushing_writer()
    told: list[object] = []
    writer.send([b"A"], behind=told.append)
    writer.send([b"B"], behind=told.append)
    writer.fail(lambda: ConnectionError("gone"))
    assert told == [None, None]  # None: the connection's reason
    assert writer.flush() is False
    assert bytes(sock.data) == b""
    with pytest.raises(ConnectionError):
        writer.send([b"C"], behind=told.append)


class HookedDeque(deque):  # type: ignore[type-arg]
    """The writer's queue of messages written behind, running ``before`` ahead of the
    first append: what another thread does between a sender's checks and its append."""

    def __init__(self, before: Callable[[], object]) -> None:
        super().__init__()
        self.before: Callable[[], object] | None = before

    def append(self, item: object) -> None:
        before, self.before = self.before, None
        if before is not None:
            before()
        super().append(item)


@pytest.mark.parametrize("end", ["last message", "fail"])
def test_a_message_queued_behind_as_the_writer_ends_is_refused_not_written(end: str) -> None:
    """It passed the check for an ended writer, then the last message (the Close) was
    queued, or the connection failed, before it was appended: it must not be written
    after the Close, and its thread is told, once."""
    sock, writer, _ = flushing_writer()
    told: list[object] = []
    if end == "last message":
        before = partial(writer.send, [b"Z"], last=lambda: ConnectionError("closed"))
    else:
        before = partial(writer.fail, lambda: ConnectionError("gone"))
    writer._behind = HookedDeque(before)  # noqa: SLF001
    writer.send([b"A"], behind=told.append)
    assert told == [None]  # None: the writer's reason
    assert writer.flush() is False
    assert bytes(sock.data) == (b"Z" if end == "last message" else b"")
    with pytest.raises(ConnectionError):
        writer.send([b"B"], behind=told.append)


def test_a_message_queued_behind_as_the_leader_lets_go_wakes_the_flusher() -> None:
    """Queued after the leader's last look at the queue, while it still held the lead (so
    the sender did not wake the flusher): the leader wakes it once it has let go."""
    sock, writer, leader = busy_writer()
    wakes: list[str] = []
    writer.flusher_wake = lambda: wakes.append("wake")

    class LateBehind(deque):  # type: ignore[type-arg]
        """The leader's look at it (as it lets go) sees it empty; B comes just after."""

        looked = False

        def __len__(self) -> int:
            size = super().__len__()
            if not self.looked and threading.current_thread() is leader:
                self.looked = True
                writer.send([b"B"], behind=lambda error: None)
            return size

        def __bool__(self) -> bool:  # Python 3.10 tests a deque's truth without __len__
            return len(self) > 0

    writer._behind = LateBehind()  # noqa: SLF001
    sock.release_all()
    leader.join(JOIN)
    assert writer._behind.looked  # type: ignore[attr-defined]  # noqa: SLF001
    assert bytes(sock.data) == b"A"
    assert wakes == ["wake"]
    assert writer.flush() is False
    assert bytes(sock.data) == b"AB"
    assert_idle_and_working(writer, sock)


def test_a_failed_flush_fails_its_batch_and_raises_the_connections_reason() -> None:
    sock, writer, _ = flushing_writer()
    told: list[object] = []
    writer.send([b"A"], behind=told.append)
    sock.error = OSError("reset")
    with pytest.raises(ConnectionError):
        writer.flush()
    assert told == [None]
    assert not writer.busy
    with pytest.raises(ConnectionError):
        writer.send([b"B"])


def test_past_the_unwritten_limit_a_send_written_behind_waits_its_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("drainer_amqp.writer.UNWRITTEN_LIMIT", 4)
    sock, writer, wakes = flushing_writer()
    writer.send([b"AA"], behind=lambda error: None)
    writer.send([b"BB"], behind=lambda error: None)
    assert bytes(sock.data) == b""
    writer.send([b"CC"], behind=lambda error: None)  # over the limit: written, in order
    assert bytes(sock.data) == b"AABBCC"
    assert writer.flush() is False
    assert_idle_and_working(writer, sock)


def test_randomized_sends_written_behind_and_blocking_arrive_whole_and_in_order(
    switching: None,
) -> None:
    """Threads mixing both kinds of send while a flusher thread flushes; every message
    arrives once, whole, in each thread's order; nobody is told of a failure."""
    sock = FakeSocket()
    sock.takes = 7  # partial writes all the time
    writer = make_writer(sock)
    wake = threading.Event()
    writer.flusher_wake = wake.set
    stop = threading.Event()
    told: list[object] = []

    def flusher() -> None:  # as the drainer: flushes when woken, and only then
        while True:
            wake.wait(JOIN)
            wake.clear()
            if stop.is_set():
                return
            while writer.flush():
                pass

    def publisher(t: int) -> None:
        rng = random.Random(t)
        for i in range(300):
            data = b"<%d:%d>" % (t, i)
            if rng.random() < 0.7:
                writer.send([data], behind=told.append)
            else:
                writer.send([data], timeout=JOIN)

    flushing = start(flusher, "flusher")
    threads = [start(partial(publisher, t), f"p{t}") for t in range(6)]
    for thread in threads:
        thread.join(JOIN)
        assert not thread.is_alive()
    deadline = time.monotonic() + JOIN
    while len(re.findall(rb"<\d+:\d+>", bytes(sock.data))) < 6 * 300:
        # Nobody wakes the flusher here: a wake-up the writer owed and lost strands them.
        assert time.monotonic() < deadline, "messages written behind were not flushed"
        time.sleep(0.005)
    stop.set()
    wake.set()
    flushing.join(JOIN)
    assert told == []
    found = re.findall(rb"<(\d+):(\d+)>", bytes(sock.data))
    assert len(found) == 6 * 300
    for t in range(6):
        assert [int(i) for th, i in found if int(th) == t] == list(range(300))
