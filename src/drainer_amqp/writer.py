"""The write side of a connection's socket, shared by every thread (group commit).

A thread with a complete message (all its frames, already encoded) calls
:meth:`Writer.send`. Messages go out whole, in the order they were queued, and:

* **Returned means written.** ``send`` returns once the message's bytes are in the
  socket (``sendall`` returned), never before. So anything a thread does after it (a
  ``close()``, an exit) comes after the message on the wire, and a link failure loses
  only what the kernel had accepted, as with stock py-amqp.
* **One writer at a time, in turns.** If nobody is writing, the caller becomes the
  *leader*: it takes the whole queue, and its own message, as one batch and writes it
  as one ``sendall``. Otherwise it joins the queue and sleeps. When a leader's write
  is done, it lets go of the lead and wakes the first waiter whose message it wrote
  (which wakes the others of the batch: one wake-up for the leader, and the woken
  threads do not all wait for the interpreter lock at once; a waiter that gave up
  on its batch is left none), and the first waiter still queued, who then leads the
  queue, unless a thread that came meanwhile, awake already, leads it first (so the
  socket does not wait for a sleeping thread's wake-up, and threads do not queue
  behind one); but not the thread that let go, which queues until another thread has
  led (so threads take turns).
  First come, first served: a call waits for at most the batch being written, then
  its message goes out in the next batch. Nobody waits behind a stream of newcomers,
  and a leader writes one batch, then at most the replies nobody waits for, before it
  returns.
* **Taken means written.** A message is *taken* when it enters a batch that is about to
  be written: its ``take`` callback runs then, under the writer's lock, in batch order
  (so a delivery tag given there is the broker's count), and may refuse the message by
  raising. Until it is taken a message may leave the queue (its caller timed out or was
  interrupted: it was never numbered nor written); once taken it is written, or the
  connection fails. Only its own thread removes a queued message; only a leader takes.
* **Every write has a deadline** when its writer has one (``send(timeout=...)``): a
  ``sendall`` that does not finish in time may have left part of a frame on the wire,
  so the connection ends (``on_error``), as for any failed write.
* **A failure reaches every waiter at once.** :meth:`fail` makes every queued message
  raise the connection's reason (none of them was written) and every later ``send``
  raise it; the leader's write of its batch either ends (written: those calls return)
  or fails (the socket was shut down: they raise).
* **A last message.** ``send(..., last=error)`` queues a message (``Connection.Close``)
  and refuses every later ``send`` with ``error()`` in the same step, so nothing can be
  written behind it and reported as sent.
* **Every way out restores the turn.** A timeout or an exception (``KeyboardInterrupt``
  from a signal handler) in a waiting thread removes its message if it was not taken
  (and, if nobody leads, wakes the next waiter to lead the queue, or writes what is
  left in it, the replies nobody waits for); a thread that leads writes its batch and
  lets go of the lead before the exception propagates (also if it came while the
  thread waited for ``io_lock``: nothing was written then; that wait is bounded by
  ``CLEAN_UP_WAIT``).
  State changes happen under the lock, and the wake-ups after it can be repeated, so
  the clean-up can always finish what the interrupted step began.

``block=False`` (heartbeats, and every write of the thread that dispatches what it read:
its replies, a done callback's) never sleeps: the message is queued for the leader, or
written at once when nobody is writing.

**Written behind.** When the connection has a *flusher* (drainer mode on plain TCP: the
drainer thread), ``send(behind=...)`` (a deferred publish, whose future is its promise)
queues the message and returns at once, unwritten. A
leader that finds only such messages queued hands them to the flusher instead of writing
them, so no caller writes for others without end; the flusher (:meth:`Writer.flush`)
writes them without blocking, and keeps the lead while the socket takes them. Without a
flusher, ``behind`` is a blocking send. At most ``UNWRITTEN_LIMIT`` bytes wait behind:
beyond it, ``behind`` is a blocking send too, so a fast publisher waits its turn, and
writes the backlog itself when nobody is writing. (The bound is small on purpose: a
publisher that keeps the interpreter busy lets the flusher's thread run only every
few milliseconds, and the broker should not wait for that turn.) Such a
message is queued without the writer's lock (many publishing threads would otherwise
queue up on it, one sleep and wake-up each): in a queue of its own, moved, in order,
to the main queue by whichever thread next reads that under the lock, before it adds
its own message; so a thread's messages keep their order whichever way each is sent.

The queue holds at most one waiting message per thread, the replies, and
``UNWRITTEN_LIMIT`` bytes written behind.

**The interpreter lock.** A write goes first to :func:`~drainer_amqp.sending.send_at_once`,
which gives the socket what it takes at once without letting go of the interpreter lock
(``sendall`` lets go of it, and with many threads waiting for it, getting it back costs
the writer two context switches); ``sendall`` writes the rest. Only while no other
thread waits: while one waits for a reply (a method's, a confirm's) or for its turn to
write, every write lets go of the lock, so the thread that reads the reply, or the
next in the turns, gets it within a write rather than at the interpreter's switch
interval (5 ms) behind each thread that keeps it busy. The flusher always keeps it: it
reads the replies itself.
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from collections.abc import Callable, Sized
from functools import partial
from time import monotonic
from typing import Any

from .sending import send_at_once
from .sync import deadline_after, lock_timeout

__all__ = ["Writer"]

# A message's state, changed under the writer's lock only.
_QUEUED, _TAKEN, _LEAD, _WRITTEN, _FAILED = range(5)
#: How often an interrupted clean-up is taken up again before it gives up.
_CLEAN_UP_TRIES = 10
#: How long the clean-up of an interrupted call may wait for the socket to write what it
#: leads (seconds); then the connection ends.
CLEAN_UP_WAIT = 5.0
#: A leader whose deadline has passed (woken to lead just then) still waits this long
#: for ``io_lock``, which the flusher and TLS reads hold only for moments (seconds).
_IO_LOCK_GRACE = 0.1
#: Bytes queued to be written behind, at most (beyond, a send written behind is written
#: by its thread, in turn): about a thousand small publishes.
UNWRITTEN_LIMIT = 128 * 1024
_NONE: list[Any] = []


class _Message:
    """One message, and the wake-up of the thread that waits for it."""

    __slots__ = (
        "chunks", "take", "refused", "state", "error", "batch", "written", "wake_next",
        "_signal",
    )  # fmt: skip

    def __init__(
        self,
        chunks: list[bytes | memoryview],
        take: Callable[[], Any] | None,
        refused: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        self.chunks = chunks
        self.take = take
        # A message nobody waits for: told, outside the lock, if it is not written.
        self.refused = refused
        self.state = _QUEUED
        self.error: BaseException | None = None  # why it was refused, if it was
        # While its thread holds the lead: what to write, what it wrote, whom to wake.
        # (Shared empty lists until it leads: they are replaced, never appended to.)
        self.batch: list[_Message] = _NONE
        self.written: list[_Message] = _NONE
        self.wake_next: list[_Message] = _NONE
        self._signal: threading.Lock | None = None  # see will_wait()

    def will_wait(self) -> None:
        """Its thread will sleep until it is woken: made, under the writer's lock, before
        the message is queued where others can wake it (a leader that writes at once
        never sleeps, and needs none)."""
        self._signal = threading.Lock()
        self._signal.acquire()

    def wake(self) -> None:
        """Wake its thread (after its state changed); waking twice is harmless. A message
        nobody waits for that failed tells its ``refused`` callback (once)."""
        if self._signal is not None:
            try:
                self._signal.release()
            except RuntimeError:
                pass
        elif self.state == _FAILED and self.refused is not None:
            refused, self.refused = self.refused, None
            refused(self.error)

    def wait(self, timeout: float | None) -> bool:
        assert self._signal is not None
        return self._signal.acquire(timeout=lock_timeout(timeout))


class Writer:
    """Writes whole messages to ``sock`` in order; safe from any thread.

    ``io_lock`` is held around each ``sendall``: in legacy mode it is the transport lock
    (a legacy reader changes the socket's timeout, so nobody may write meanwhile), in
    drainer mode a lock of its own that only TLS reads share (an ``SSLSocket`` may not
    be read and written at once). ``on_error`` turns a socket error into the
    connection's reason (ending the connection, which calls :meth:`fail`) and returns
    the error to raise. ``waiters``: the threads waiting for a reply (see "The
    interpreter lock" above).
    """

    def __init__(
        self,
        sock: socket.socket,
        io_lock: Any,
        on_error: Callable[[BaseException], BaseException],
        waiters: Sized = (),
    ) -> None:
        self.io_lock = io_lock
        self._sock = sock
        self._send_at_once = send_at_once(sock)
        self._waiters = waiters
        # One item per thread in _await_turn (appended and popped by it: a count that
        # needs no lock), so a write knows whether other threads wait for theirs.
        self._turn_waiters: deque[None] = deque()
        self._on_error = on_error
        # Guards _queue, _leading, _error, _yielded and every message's state (written;
        # _leading and _error are also read without it). Held to queue, take or remove a
        # message and to take or let go of the lead; never across a write or a wait.
        # Taken by every thread that sends and waits or leads; take callbacks run under it.
        self._lock = threading.Lock()
        self._queue: list[_Message] = []
        self._leading = False  # a thread holds the lead: it writes, or is about to
        # The thread that last let go of the lead to a waiter it woke; until another
        # thread leads, it queues rather than lead again (see _hand_over).
        self._yielded: int | None = None
        self._error: Callable[[], BaseException] | None = None  # set by fail() or a last send
        # Messages written behind, queued without the lock (see _queue_behind): appended
        # by their threads, moved to _queue, in order, under the lock (_gather) by any
        # thread that reads _queue.
        self._behind: deque[_Message] = deque()
        # Bytes written behind and not taken yet: added without the lock, so a bound to
        # within a message or two; zero again whenever the queue is taken.
        self._behind_bytes = 0
        # The flusher was woken to write what is queued. Set by any thread, lock or not;
        # cleared under the lock before the queue is read (so a message queued after
        # the read sees it cleared and wakes the flusher again).
        self._flush_owed = False
        #: Wakes the flusher (set by the connection when it has one); None: no flusher.
        self.flusher_wake: Callable[[], None] | None = None
        # The flusher's own state, touched by its thread only: its lead and what of its
        # batch the socket has not taken yet.
        self._flushing: _Message | None = None
        self._unsent = memoryview(b"")

    @property
    def busy(self) -> bool:
        """A leader is writing (so the connection is sending traffic)."""
        return self._leading

    def fail(self, error: Callable[[], BaseException]) -> None:
        """Refuse every later send with ``error()``; every queued message raises it."""
        with self._lock:
            self._error = error
            queued, self._queue = self._queue, []
            for message in queued:
                message.state = _FAILED
        for message in queued:
            message.wake()
        self._refuse_behind()

    def send(
        self,
        data: list[bytes | memoryview],
        *,
        take: Callable[[], Any] | None = None,
        timeout: float | None = None,
        block: bool = True,
        last: Callable[[], BaseException] | None = None,
        behind: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        """Write ``data`` (the frames of one message) after everything queued before it;
        return once it is written.

        ``take`` is called, under the writer's lock, as the message is taken into a batch
        that is written (see the module docstring); an exception from it refuses the
        message and is raised here. ``block=False``: return at once if another thread is
        writing (the message goes out with its batch). ``last``: refuse every later send
        with ``last()``. ``behind``: write it behind if the connection has a flusher (see
        the module docstring) and return at once; ``behind(error)`` is called, outside
        the lock, if the message is then refused or fails unwritten (``error`` is None:
        the connection's reason). Raises the connection's reason when it failed before the
        message was written, ``TimeoutError`` when the message waited ``timeout`` without being
        written (it was not, unless the error says it may have been) or when the write
        itself did not end in time (the connection then ends), or the socket's error
        when this thread's write failed.
        """
        if (
            behind is not None
            and self.flusher_wake is not None
            and self._queue_behind(data, take, behind)
        ):
            return
        if timeout is None and last is None and self._send_alone(data, take):
            return
        deadline = None if timeout is None else deadline_after(timeout)
        message = _Message(data, take)
        try:
            with self._lock:
                if self._error is not None:
                    raise self._error()
                if self._behind:  # this thread's messages written behind go first
                    self._gather()
                lead = not self._leading and (
                    not block or not self._queue or self._yielded != threading.get_ident()
                )
                if block and not lead:
                    message.will_wait()
                self._queue.append(message)  # from here on only a leader takes it
                if lead:  # with what waits before it (written behind, replies, waiters)
                    self._lead_queue(message)
                if last is not None and message.error is None:
                    self._error = last
            if message.state == _LEAD:
                self._lead(message, deadline)
            elif message.state == _FAILED:
                self._wake_owed(message)
            elif block:
                self._turn_waiters.append(None)
                try:
                    self._await_turn(message, deadline)
                finally:
                    self._turn_waiters.pop()
        except BaseException:
            self._withdraw(message, deadline)
            raise
        if message.error is not None:  # refused as it was taken
            raise message.error

    def _send_alone(self, data: list[bytes | memoryview], take: Callable[[], Any] | None) -> bool:
        """:meth:`send`'s common case, in fewer steps: nobody leads and nothing is queued,
        so the caller takes the lead for its message alone and writes it at once. False,
        with nothing done (``take`` not called), when that is not the case.

        The same steps as any lead (take, lead, write, let go), without a
        :class:`_Message` until one is needed: when another thread came meanwhile (it is
        handed over to as by any leader), or to carry on after a failed write or an
        interruption, as :meth:`send`'s clean-up does."""
        with self._lock:
            if self._leading or self._queue or self._behind or self._error is not None:
                return False
            if take is not None:
                take()  # a refusal raises: nothing was queued or written
            self._leading = True
            self._yielded = None
        try:
            self.io_lock.acquire()
        except BaseException:
            self._withdraw(self._lone_lead(data, written=False), None)  # it writes the message
            raise
        try:
            self._write(data[0] if len(data) == 1 else b"".join(data), None)
        except BaseException as exc:
            self._failed(self._lone_lead(data, written=False), exc)  # the connection ends
            raise
        leading, mine = True, None
        try:
            with self._lock:
                if not self._queue and not self._behind:
                    self._leading = leading = False
            if leading:  # other threads came meanwhile: hand over, as any leader
                mine = self._lone_lead(data, written=True)
                self._lead(mine, None)
        except BaseException:
            if leading:
                self._withdraw(mine or self._lone_lead(data, written=True), None)
            raise
        if not leading and self._behind and not self._leading and not self._flush_owed:
            self._flush_owed = True  # queued behind after the lead was let go
            self._wake_flusher()
        return True

    @staticmethod
    def _lone_lead(data: list[bytes | memoryview], written: bool) -> _Message:
        """The message :meth:`_send_alone` leads, made once it has to carry on as any
        leader: its batch still to write, or ``written``."""
        mine = _Message(data, None)
        mine.state = _LEAD
        if written:
            mine.written = [mine]
        else:
            mine.batch = [mine]
        return mine

    def _queue_behind(
        self,
        data: list[bytes | memoryview],
        take: Callable[[], Any] | None,
        refused: Callable[[BaseException | None], None],
    ) -> bool:
        """Queue a message to be written behind; False if ``UNWRITTEN_LIMIT`` is reached
        (the caller then sends it as any other).

        Without the writer's lock, so that publishing threads do not queue up behind
        each other on it: the message goes to ``_behind`` (a deque: an append is atomic),
        whence whoever next reads the queue under the lock moves it (:meth:`_gather`).
        Every step after the append is a check that another thread made before it, or
        will make after it: a leader checks ``_behind`` after it lets go of the lead
        (:meth:`_hand_over`), the flusher after it clears ``_flush_owed``, and
        :meth:`fail` after it sets ``_error``; each message leaves ``_behind`` once (a
        ``popleft``), so it is written or refused once."""
        if self._error is not None:
            raise self._error()
        size = sum(map(len, data))
        queued = self._behind_bytes
        if queued and queued + size > UNWRITTEN_LIMIT:
            return False
        self._behind.append(_Message(data, take, refused))
        self._behind_bytes += size
        if self._error is not None:  # it may have come after the last gather
            self._refuse_behind()
        elif not self._leading and not self._flush_owed:
            self._flush_owed = True
            self._wake_flusher()
        return True

    def _gather(self) -> None:
        """Under the lock: move what was queued behind to the end of ``_queue``; nothing
        once the writer refuses sends (what is behind then came after the last message
        or the failure: :meth:`_refuse_behind`)."""
        behind = self._behind
        if not behind or self._error is not None:
            return
        queue, pop = self._queue, behind.popleft
        try:
            while True:
                queue.append(pop())
        except IndexError:
            pass

    def _wake_flusher(self) -> None:
        flusher_wake = self.flusher_wake
        if flusher_wake is not None:
            flusher_wake()

    def _await_turn(self, message: _Message, deadline: float | None) -> None:
        """Sleep until ``message`` is written (return) or failed (raise); woken while it
        is still queued and nobody leads, lead the queue (write it as one batch)."""
        while True:
            if not message.wait(None if deadline is None else deadline - monotonic()):
                with self._lock:
                    unqueued = message.state == _QUEUED
                    flush = unqueued and self._unqueue(message)
                if flush:
                    self._wake_flusher()
                if unqueued:  # the turn it passed on is taken up by send's clean-up
                    raise TimeoutError("write timed out: the socket is not draining")
                if message.state == _TAKEN:
                    raise TimeoutError(
                        "write timed out while its batch was being written: it may have been"
                    )
            if message.state == _QUEUED:
                with self._lock:
                    if message.state == _QUEUED and not self._leading:
                        self._lead_queue(message)
            if message.state not in (_QUEUED, _TAKEN):
                break
        if message.state == _WRITTEN:
            with self._lock:  # set with its state, which it may have seen first
                owed = message.wake_next
            if owed:  # the others of its batch, left to it by the leader (_hand_over)
                self._wake_owed(message)
        if message.state == _FAILED:
            self._wake_owed(message)
            raise self._failure(message)
        if message.state == _LEAD:
            self._lead(message, deadline)

    def _lead_queue(self, mine: _Message) -> None:
        """Under the lock, nobody leading: take the queue (``mine`` in it) as ``mine``'s
        batch and lead it; refused messages are owed their wake-up."""
        if self._behind:
            self._gather()
        queued = self._queue
        self._take(queued)  # first: an interrupted take leaves the queue as it was
        self._queue, self._behind_bytes = [], 0
        if len(queued) == 1 and queued[0].state == _TAKEN:  # the common case
            batch = queued
        else:
            batch = [m for m in queued if m.state == _TAKEN]
            if len(batch) != len(queued):
                mine.wake_next = [m for m in queued if m.state == _FAILED and m is not mine]
        if batch:  # even if its own was refused: the batch is written
            self._yielded = None
            self._leading = True
            mine.batch = batch
            mine.state = _LEAD

    def _unqueue(self, message: _Message) -> bool:
        """Under the lock: ``message``, queued, leaves the queue unwritten. If nobody
        leads, the turn passes on: the first waiter left in the queue is owed a wake-up
        (to lead it), or, with nobody waiting in it, the flusher takes it (returns True:
        wake it), or this thread leads what is left (the caller writes it:
        :meth:`_withdraw`)."""
        queue = self._queue
        queue.remove(message)
        if self._leading or not queue:
            return False
        waiter = next((m for m in queue if m._signal is not None), None)
        if waiter is not None:
            message.wake_next = [waiter]
        elif self.flusher_wake is None:
            self._lead_queue(message)
        elif not self._flush_owed:
            self._flush_owed = True
            return True
        return False

    def _withdraw(self, message: _Message, deadline: float | None) -> None:
        """A call leaves early (a timeout, an interrupt): leave the writer as if it had
        never come. A message still queued leaves the queue (:meth:`_unqueue`); a lead
        it holds is carried out (its batch written, the lead let go) and the wake-ups
        owed are done. An interruption of that clean-up is taken up where it stopped."""
        flush = False
        with self._lock:
            if message.state == _QUEUED and message in self._queue:
                flush = self._unqueue(message)
            elif message.state == _TAKEN:  # it leaves: no wake-ups may be left to it
                message._signal = None
        if flush:
            self._wake_flusher()
        # An interrupted lead may still wait for the socket: not for ever.
        bound = monotonic() + CLEAN_UP_WAIT
        deadline = bound if deadline is None else min(deadline, bound)
        for _ in range(_CLEAN_UP_TRIES):
            try:
                self._lead(message, deadline)
                return
            except BaseException:  # noqa: BLE001, S112 - the caller raises its own error
                continue

    def _lead(self, mine: _Message, deadline: float | None) -> None:
        """Write ``mine.batch`` (taken already), then let go of the lead (or write the
        queue too, if nobody in it waits: :meth:`_hand_over`), then wake the threads
        that are owed it. Called again after an interruption, it carries on where it
        stopped."""
        while True:
            if mine.wake_next:
                self._wake_owed(mine)
            if mine.state != _LEAD:
                return
            if mine.batch:
                payload = self._joined(mine.batch)  # before the socket is taken
                self._take_socket(mine, deadline)  # interrupted: nothing written, still ours
                try:
                    self._write(payload, deadline)
                except BaseException as exc:
                    self._failed(mine, exc)
                    raise
                mine.written, mine.batch = mine.batch, []
            self._hand_over(mine)

    def _take_socket(self, mine: _Message, deadline: float | None) -> None:
        """Take ``io_lock`` for the write of ``mine.batch`` (in legacy mode a reader may
        hold it). An interrupt while waiting for it leaves the lead as it was: nothing
        is written, and the caller's clean-up (:meth:`_withdraw`) takes it up again. At
        ``deadline`` the batch, taken, is still unwritten: the connection ends, as when a
        write does not end in time."""
        if deadline is None:
            if self.io_lock.acquire():
                return
        elif self.io_lock.acquire(timeout=max(deadline - monotonic(), _IO_LOCK_GRACE)):
            return
        exc = TimeoutError("write timed out: another thread held the socket")
        error = self._on_error(exc)
        self._failed(mine, exc)
        raise error from exc

    def _hand_over(self, mine: _Message) -> None:
        """After ``mine.written`` is written: let go of the lead, owing a wake-up to each
        waiter written and to the first waiter still queued (it leads the queue next,
        unless a newcomer does first). A queue nobody in it waits for goes to the
        flusher, or this thread takes it as its next batch.

        A thread that let go to a waiter does not lead again before another thread has:
        its next send queues (``_yielded``). Otherwise a thread publishing in a loop,
        awake and holding the interpreter lock, would take the lead back each time,
        while the threads it woke wait for the interpreter: it would publish several
        times as often as each of them, their calls taking as long."""
        flush = False
        with self._lock:
            self._gather()
            queued = self._queue
            waiter = None
            write_too = False
            refused: list[_Message] = _NONE
            if queued:
                waiter = next((m for m in queued if m._signal is not None), None)
                write_too = waiter is None and (self.flusher_wake is None or mine is self._flushing)
                if write_too:  # first: an interrupted take leaves the queue as it was
                    self._lead_queue(mine)  # nobody in it waits: this thread writes it too
                    refused, mine.wake_next = mine.wake_next, _NONE
            written, mine.written = mine.written, []
            for message in written:
                message.state = _WRITTEN
            if len(written) == 1 and written[0] is mine and not queued:  # the common case
                owed = _NONE
            else:
                owed = [m for m in written if m._signal is not None and m is not mine]
                if len(owed) > 1:  # the first one woken wakes the others (_await_turn)
                    owed[0].wake_next, owed = owed[1:], owed[:1]
                if waiter is not None:
                    owed.append(waiter)
                owed += refused
            if mine.batch:
                mine.state = _LEAD
            else:
                mine.state = _WRITTEN
                self._leading = False
                if waiter is not None:
                    self._yielded = threading.get_ident()
                if queued and waiter is None and not write_too:  # only messages nobody
                    flush = not self._flush_owed  # waits for: the flusher writes them
                    self._flush_owed = True
            mine.wake_next = owed
        if not self._leading and self._behind and not self._flush_owed:
            flush = self._flush_owed = True  # queued behind after the lead was let go
        if flush:
            self._wake_flusher()

    def _refuse_behind(self) -> None:
        """Once the writer refuses sends: fail what is still queued behind."""
        refused = []
        with self._lock:
            pop = self._behind.popleft
            try:
                while True:
                    message = pop()
                    message.state = _FAILED
                    refused.append(message)
            except IndexError:
                pass
            self._behind_bytes = 0
        for message in refused:
            message.wake()

    def _failed(self, mine: _Message, exc: BaseException) -> None:
        """The write of ``mine.batch`` failed: it and the queue fail, the lead is
        released."""
        with self._lock:
            if self._error is None:  # on_error did not end the connection
                self._error = partial(ConnectionError, f"write failed: {exc!r}")
            self._leading = False
            failed = mine.batch + self._queue
            mine.batch, self._queue = [], []
            for message in failed:
                message.state = _FAILED
            mine.state = _FAILED
            mine.wake_next = [m for m in failed if m is not mine]
        self._wake_owed(mine)
        self._refuse_behind()

    # -- the flusher ---------------------------------------------------------------------
    def flush(self) -> bool:
        """The flusher's turn (its thread only): write, without blocking, what is queued
        behind, a batch at a time. Returns whether more waits to be written (call again
        when the socket is writable). Raises the connection's reason if a write fails."""
        mine = self._flushing
        if mine is None and self._flush_owed:  # set before the flusher is woken
            mine = self._start_flush()
        if mine is None:
            return False
        if not self._send_some(mine):
            return True
        mine.written, mine.batch = mine.batch, []
        self._hand_over(mine)
        if mine.state == _LEAD:  # the queue, nobody waiting in it: the next batch
            self._unsent = self._payload(mine.batch)
        else:
            self._flushing = None
        self._wake_owed(mine)
        return mine.state == _LEAD

    def _start_flush(self) -> _Message | None:
        mine = _Message([], None)
        with self._lock:
            self._flush_owed = False
            self._gather()
            if self._leading or self._error is not None or not self._queue:
                return None
            queued, self._queue, self._behind_bytes = self._queue, [], 0
            self._take(queued)
            mine.batch = [m for m in queued if m.state == _TAKEN]
            mine.wake_next = [m for m in queued if m.state == _FAILED]
            if mine.batch:
                self._leading = True
                mine.state = _LEAD
        self._wake_owed(mine)
        if mine.state != _LEAD:
            return None
        self._flushing = mine
        self._unsent = self._payload(mine.batch)
        return mine

    def _send_some(self, mine: _Message) -> bool:
        """Give the socket what it takes now of the flusher's batch; whether all of it."""
        sock = self._sock
        try:
            with self.io_lock:
                sent = self._send_at_once(self._unsent) if self._send_at_once else 0
                if not sent:  # nothing taken: see what the socket says
                    previous = sock.gettimeout()
                    sock.setblocking(False)
                    try:
                        sent = sock.send(self._unsent)
                    except BlockingIOError:
                        sent = 0
                    finally:
                        sock.settimeout(previous)
        except BaseException as exc:  # as _write: the stream may end mid-frame
            self._flushing, self._unsent = None, memoryview(b"")
            error = self._on_error(exc)
            self._failed(mine, exc)
            if isinstance(exc, OSError):
                raise error from exc
            raise
        self._unsent = self._unsent[sent:]
        return not self._unsent

    @staticmethod
    def _joined(batch: list[_Message]) -> bytes | memoryview:
        chunks = batch[0].chunks if len(batch) == 1 else [c for m in batch for c in m.chunks]
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    @staticmethod
    def _payload(batch: list[_Message]) -> memoryview:
        return memoryview(b"".join(chunk for message in batch for chunk in message.chunks))

    @staticmethod
    def _wake_owed(mine: _Message) -> None:
        while mine.wake_next:
            mine.wake_next[-1].wake()
            mine.wake_next.pop()

    @staticmethod
    def _take(queued: list[_Message]) -> None:
        """Under the lock: run the take callbacks of the messages of ``queued`` not taken
        yet, in order; a refused one fails, with its callback's error."""
        for message in queued:
            if message.state != _QUEUED:
                continue
            try:
                if message.take is not None:
                    message.take()
            except Exception as exc:  # noqa: BLE001 - the refusal is the sender's to raise
                message.error = exc
                message.state = _FAILED
            else:
                message.state = _TAKEN

    def _failure(self, message: _Message) -> BaseException:
        if message.error is not None:
            return message.error
        assert self._error is not None  # set before any message fails without its own error
        return self._error()

    def _write(self, payload: bytes | memoryview, deadline: float | None) -> None:
        """Write ``payload`` under ``io_lock`` (taken by :meth:`_take_socket`), and let go
        of it."""
        sock = self._sock
        try:
            try:
                if deadline is None:
                    at_once = self._send_at_once
                    keep = not self._waiters and not self._turn_waiters
                    sent = at_once(payload) if at_once and keep else 0
                    if sent < len(payload):
                        sock.sendall(payload[sent:] if sent else payload)
                else:
                    previous = sock.gettimeout()
                    sock.settimeout(max(deadline - monotonic(), 0.001))
                    try:
                        sock.sendall(payload)
                    finally:
                        sock.settimeout(previous)
            finally:
                self.io_lock.release()
        except OSError as exc:  # socket.timeout too: part of a frame may be on the wire
            raise self._on_error(exc) from exc
        except BaseException as exc:  # interrupted mid-write: the stream may end mid-frame
            self._on_error(exc)
            raise
