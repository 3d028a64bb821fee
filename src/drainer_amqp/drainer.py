"""The drainer: drainer mode's reader, one thread that owns the reading side of a socket.

* It sleeps in ``select`` on the socket and a wake-up socketpair, reads what is there
  without blocking, and assembles frames itself (:mod:`.framing`). Complete frames go to
  ``sink.dispatch_frames``, which holds the transport lock while it dispatches them; no
  read happens under that lock. (TLS: an ``SSLSocket`` may not be read and written at
  once, so a TLS read is a non-blocking read under the writer's ``io_lock``.)
* It sends a heartbeat when nothing was written for half the interval, and fails the
  connection when the broker was silent for two.
* It writes what the connection's writer queued behind (:meth:`Writer.flush
  <drainer_amqp.writer.Writer.flush>`, deferred publishes), without blocking: while the
  socket does not take it all, it also waits in ``select`` for the socket to be writable.
* It never runs user code, but for the done callbacks of deferred publishes' futures,
  which run where the future settles. While the inbox is full
  (``sink.reading_paused()``) it stops reading, so TCP back-pressure reaches the broker;
  :meth:`Drainer.wake` resumes it.
* :meth:`Drainer.stop` wakes the ``select`` at once; the thread exits and reports to
  ``sink.drainer_exited``. It holds its connection weakly: a connection dropped without
  ``close()`` is collected as a stock one is, and its thread then exits and closes the
  socket.
* **A waiting thread may read its own reply.** While the thread sleeps in ``select``, a
  caller's thread that waits for a reply or a confirm (:meth:`Drainer.wait`) takes the
  right to read (``_reading``), takes the socket out of the thread's ``select``, and
  reads and dispatches frames itself, as stock py-amqp's caller does, for at most
  ``BORROW_FOR``; then it gives both back and, if its reply has not come, sleeps as any
  waiter does. One thread switch per reply instead of two. Only while no other thread
  waits for a reply or a confirm: a borrower keeps the right to read while it waits for
  the interpreter lock after each system call, and among many threads that want that
  lock the wait can be long, with every other waiter's reply stuck behind it; the
  drainer thread reads for several waiters. Not the main thread (a
  ``KeyboardInterrupt`` between a read and its dispatch would lose frames), nor TLS,
  nor ``drain_events()``, nor while the inbox is full.
* **It reads deliveries a batch at a time.** While the consumer has deliveries queued
  and no thread waits for anything else (a reply, a confirm, the close), the thread
  leaves the socket unread, for at most ``DEFER_FOR``: what comes meanwhile is read in
  one batch once the consumer has caught up (the inbox empties) or a thread starts to
  wait, so a consumer that acks each delivery costs one hand-over per batch, not one
  per delivery.
* **An event loop's thread reads for itself.** While an event loop (kombu's Hub, the
  Celery worker's) watches the socket and no thread waits for anything else, the thread
  leaves the socket unread in the same way, and the loop's thread reads it
  (:meth:`Drainer.read_for_loop`) and runs the deliveries, as stock py-amqp's loop
  does: no hand-over at all. The loop's thread is often the main thread, which a
  ``KeyboardInterrupt`` between a read and its dispatch would desynchronise, as it
  would stock's; Celery's signal handlers only set flags.
"""

from __future__ import annotations

import math
import select
import selectors
import socket
import ssl
import threading
import weakref
from dataclasses import asdict, dataclass
from time import monotonic
from typing import Any, Protocol

from .errors import ConnectionLost, HeartbeatTimeout, MalformedFrame
from .framing import Frame, FrameAssembler
from .reading import refuse_wait_in_dispatch
from .sync import Awaitable, SelfPipe
from .waits import Waiters

__all__ = ["Drainer", "DrainerStats", "DrainerSink"]

READ_SIZE = 256 * 1024
#: How often an idle drainer checks that its socket still exists (seconds).
CHECK_CLOSED = 2.0
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
#: How long a waiting caller's thread reads the socket itself before it gives it back
#: to the drainer thread and sleeps (seconds): a confirm or a reply from a healthy
#: broker comes well within it.
BORROW_FOR = 0.02
#: How long the thread may leave the socket unread while the consumer is behind (see
#: ``Drainer._defer_reading``): a broker's close or a dead link is still seen within it
#: (seconds).
DEFER_FOR = 0.05


class DrainerSink(Protocol):
    """What the drainer needs from its connection."""

    bytes_sent: int
    dispatching_thread: int | None  # the thread in dispatch_frames, if any

    @property
    def io_lock(self) -> Any: ...
    @property
    def waiters(self) -> Waiters: ...  # the threads that wait for a reply or a confirm

    def dispatch_frames(self, frames: list[Frame]) -> None: ...
    def flush_writes(self) -> bool: ...
    def try_send_heartbeat(self) -> bool: ...
    def reading_paused(self) -> bool: ...
    def consumer_behind(self) -> bool: ...
    def watch_inbox_empty(self, watch: bool) -> None: ...
    def drainer_exited(self, error: BaseException | None) -> None: ...


@dataclass
class DrainerStats:
    """Plain counters, written by whoever holds the right to read (reads may be a frame
    stale)."""

    frames_read: int = 0
    bytes_read: int = 0
    reads: int = 0
    heartbeats_sent: int = 0
    heartbeats_received: int = 0
    dispatches: int = 0
    loop_reads: int = 0  # of reads, those an event loop's thread made (read_for_loop)


class Drainer:
    """Drainer mode's :class:`~drainer_amqp.reading.Reader`: once started, reads ``sock``
    in a thread of its own, owned by ``sink``; ``inbox_limit`` callbacks may wait for
    ``drain_events()`` before it pauses reading."""

    owns_socket = True
    reading = False  # no caller's thread ever reads, so none can hold up a close()

    def __init__(self, sink: DrainerSink, inbox_limit: int) -> None:
        self._sink: DrainerSink = weakref.proxy(sink)  # type: ignore[assignment]
        # Collected unclosed: the thread exits (at exit, the exit hook closes the rest).
        weakref.finalize(sink, self.stop_reading).atexit = False
        self.inbox_limit = inbox_limit
        self._wake: SelfPipe | None = None  # from start(): makes the select return
        self._stopping = False  # set once by stop_reading(), read by the thread
        self._counts = DrainerStats()  # written by the reader of the moment
        self.thread: threading.Thread | None = None
        # The right to read the socket (its assembler, the counts): the thread holds it
        # except while it sleeps in select, when a waiting caller may take it (_borrow).
        self._reading = threading.Lock()
        # Guards the socket's registration with the thread's selector: _selector,
        # _wanted, _watching, _lent, _deferring. Taken by the thread as it registers what
        # it wants, by a borrower as it takes reading away and gives it back, and by
        # resume_reading().
        self._watch_lock = threading.Lock()
        self._selector: selectors.BaseSelector | None = None  # the thread's, while it runs
        self._wanted = 0  # the events the thread wants the socket watched for
        self._watching = 0  # the events it is registered for
        self._lent = False  # a borrower reads: the thread does not watch for reading
        self._deferring = False  # the consumer is behind: nobody watches for reading
        self._last_recv = monotonic()  # when bytes last came, whoever read them
        self._borrows = 0  # how many times a caller took the reading (under _reading)
        self._borrow_error: BaseException | None = None  # a borrower's read failed
        # Bytes were read and not all dispatched yet (set and cleared by whoever reads,
        # under _reading): see _borrow.
        self._mid_read = False

    # -- owner API ---------------------------------------------------------------
    def new_locks(self) -> tuple[Any, Any]:
        """The transport lock (held per batch of frames dispatched) and the writer's own
        io_lock (shared only by TLS reads)."""
        return threading.RLock(), threading.Lock()

    def start(self, sock: socket.socket, *, name: str, frame_max: int, heartbeat: float) -> None:
        """Start reading ``sock`` in a thread named ``name`` (once)."""
        if self.thread is None:
            self._sock, self._tls = sock, isinstance(sock, ssl.SSLSocket)
            self._wake = SelfPipe()  # the thread closes it as it exits
            self._assembler = FrameAssembler(frame_max)
            self._heartbeat = float(heartbeat or 0)
            self.thread = threading.Thread(target=self._run, name=name, daemon=True)
            try:
                self.thread.start()
            except BaseException:  # RuntimeError at interpreter shutdown (Python 3.12)
                self.thread = None
                self.close()  # no thread will close the wake-up pair
                raise

    def before_publish(self) -> None:
        """Nothing to do: the thread sees the broker end the connection at once."""

    def wake(self) -> None:
        """Make the thread's ``select`` return now (safe from any thread)."""
        if self._wake is not None:
            self._wake.set()

    def resume_reading(self) -> None:
        """Watch the socket for reading again if the thread left it unread (the consumer
        caught up, or a thread waits): the thread's ``select`` returns when bytes are
        there, and not before (safe from any thread)."""
        with self._watch_lock:
            if self._deferring:
                self._deferring = False
                self._register()

    def stop_reading(self) -> None:
        """Ask the thread to exit soon (it then closes the socket); do not wait (safe from
        any thread)."""
        self._stopping = True
        self.wake()

    def stop(self, timeout: float) -> bool:
        """Ask the thread to exit and join it for at most ``timeout`` seconds; whether it
        has ended (or, called from the thread itself, will at once)."""
        self.stop_reading()
        if self.thread is None or threading.current_thread() is self.thread:
            return True
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def close(self) -> None:
        """Release the wake-up pair (the thread does, as it exits). A later :meth:`wake`
        is a no-op."""
        if self._wake is not None:
            self._wake.close()

    def after_fork(self) -> None:
        self._reading = threading.Lock()
        self._watch_lock = threading.Lock()
        if self._wake is not None:
            self._wake.after_fork()
        self.close()

    def stats(self) -> dict[str, float | int | bool]:
        running = self.thread is not None and self.thread.is_alive()
        return {"running": running, **asdict(self._counts)}

    def wait(self, awaitable: Awaitable, deadline: float | None, closing: bool = False) -> None:
        """The :class:`~drainer_amqp.reading.Reader` seam: return once ``awaitable`` is
        ready; ``TimeoutError`` at ``deadline``. The caller reads its own reply while the
        thread is idle (see the module docstring), else sleeps until the thread's read
        fills it. In the thread that is dispatching what it read (a done callback), it
        raises ``CannotWaitInReadingThread`` at once: that wait would be for itself."""
        if awaitable.ready():
            return
        if not closing:
            refuse_wait_in_dispatch(self._sink.dispatching_thread)
        if self.thread is not None and self._sock.fileno() == -1 and self.thread.is_alive():
            self.wake()  # someone closed the socket under us: the thread reports it
        if not closing and self._borrow(awaitable, deadline):
            return
        timeout = None if deadline is None else deadline - monotonic()
        if not awaitable.wait(timeout):
            raise TimeoutError()

    def _may_borrow(self, awaitable: Awaitable) -> bool:
        return (
            BORROW_FOR > 0
            and getattr(awaitable, "waiter_reads", True)
            and self.thread is not None  # started: _sock and _tls are set
            and not self._tls
            and not self._stopping
            and threading.current_thread() is not threading.main_thread()
            and not self._sink.waiters.besides(awaitable)  # no other thread waits
        )

    def _borrow(self, awaitable: Awaitable, deadline: float | None) -> bool:
        """Read the socket in this thread, while the thread sleeps, until ``awaitable`` is
        ready (True) or for ``BORROW_FOR``, at most until ``deadline``. False when it may
        not, or its reply did not come in time: the caller then sleeps (or, at its
        deadline, raises)."""
        if not self._may_borrow(awaitable) or not self._reading.acquire(blocking=False):
            return False
        self._borrows += 1
        try:
            with self._watch_lock:
                if self._selector is None:  # the thread has exited
                    return False
                self._lent = True
                self._register()
            poller = select.poll()
            poller.register(self._sock, select.POLLIN)
            until = monotonic() + BORROW_FOR
            while not awaitable.ready():
                if self._stopping or self._sink.reading_paused():
                    return False
                now = monotonic()
                left = until - now if deadline is None else min(until, deadline) - now
                if left <= 0:
                    return False
                if not poller.poll(math.ceil(left * 1000)):
                    continue
                try:
                    if self._read():
                        self._last_recv = monotonic()
                except Exception as exc:  # noqa: BLE001 - the thread reports it, as its own
                    if not self._stopping:
                        self._borrow_error = exc
                        self.wake()
                    return False
                except BaseException as exc:
                    # Raised into this thread (an asynchronous exception) between a recv
                    # and the dispatch of what it read: that is lost, and the stream may
                    # be out of step. The thread ends the connection, and every waiter
                    # learns why at once.
                    if self._mid_read and not self._stopping:
                        lost = ConnectionLost(f"a read was interrupted ({exc!r}): data lost")
                        lost.__cause__ = exc
                        self._borrow_error = lost
                        self.wake()
                    raise
            return True
        except (OSError, ValueError):  # the socket was closed meanwhile: the thread reports
            return False
        finally:
            try:
                with self._watch_lock:
                    self._lent = False
                    if self._selector is not None:
                        self._register()
            finally:
                self._reading.release()

    def may_lend_to_loop(self) -> bool:
        """Whether an event loop's thread may read the socket (:meth:`read_for_loop`):
        started, and not TLS."""
        return self.thread is not None and not self._tls

    def read_for_loop(self) -> bool:
        """An event loop's thread (kombu's Hub) saw the socket readable: read what is
        there and dispatch it in that thread, as stock py-amqp's loop does, unless the
        thread or a borrower reads now (they take what is there). False when the read
        failed: the thread reports it, as its own, and ends the connection; the loop
        should stop watching the socket, which may stay readable until then."""
        if not self.may_lend_to_loop() or not self._reading.acquire(blocking=False):
            return True
        self._borrows += 1
        try:
            if self._stopping:
                return True
            if self._read():
                self._last_recv = monotonic()
                self._counts.loop_reads += 1
            return True
        except Exception as exc:  # noqa: BLE001 - the thread reports it, as its own
            if not self._stopping:
                self._borrow_error = exc
                self.wake()
            return False
        finally:
            self._reading.release()

    def _register(self) -> None:
        """Under ``_watch_lock``: watch the socket for what the thread wants, less reading
        while a borrower reads or the thread defers reading."""
        unread = self._lent or self._deferring
        events = self._wanted & ~selectors.EVENT_READ if unread else self._wanted
        if events == self._watching or self._selector is None:
            return
        if not self._watching:
            self._selector.register(self._sock, events)
        elif not events:
            self._selector.unregister(self._sock)
        else:
            self._selector.modify(self._sock, events)
        self._watching = events

    # -- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        error: BaseException | None = None
        selector = selectors.DefaultSelector()
        self._reading.acquire()
        try:
            assert self._wake is not None
            selector.register(self._wake, selectors.EVENT_READ)
            with self._watch_lock:
                self._selector = selector
            self._loop(selector, self._wake)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported to the owner
            error = exc
        finally:
            with self._watch_lock:
                self._selector = None
            selector.close()
        try:
            self._sink.drainer_exited(None if self._stopping else error)
        except ReferenceError:  # the connection was dropped unclosed, and collected
            self._sock.close()
        finally:
            self.close()  # the wake-up pair goes with the thread, whoever stopped it

    def _loop(self, selector: selectors.BaseSelector, wake: SelfPipe) -> None:
        """Runs holding ``_reading`` except in ``select``; without it after a ``select``
        (a borrower reads), it does all but reading."""
        now = monotonic()
        self._last_recv = last_sent = now
        seen_sent = self._sink.bytes_sent
        interval = self._heartbeat
        flushing = False  # bytes written behind wait for the socket to take them
        holding = True  # this thread holds _reading
        deferred_since: float | None = None  # when reading was last left for the consumer
        while not self._stopping:
            paused = self._sink.reading_paused()
            expired = deferred_since is not None and monotonic() - deferred_since >= DEFER_FOR
            if self._defer_reading(not paused and not expired):
                deferred_since = deferred_since or monotonic()
            elif not expired:
                deferred_since = None
            wanted = (0 if paused else selectors.EVENT_READ) | (
                selectors.EVENT_WRITE if flushing else 0
            )
            if wanted != self._wanted:  # only this thread changes it
                with self._watch_lock:
                    self._wanted = wanted
                    self._register()
            if paused:
                self._last_recv = monotonic()  # the silence is ours, not the broker's
            # A socket closed by someone else vanishes from the selector without an
            # event, so an idle drainer also looks at it every CHECK_CLOSED seconds.
            timeout = CHECK_CLOSED
            if interval:
                due = min(last_sent + interval / 2, self._last_recv + 2 * interval)
                timeout = min(timeout, max(0.0, due - monotonic()))
            if self._deferring and deferred_since is not None:
                timeout = min(timeout, max(0.0, deferred_since + DEFER_FOR - monotonic()))
            if not paused and self._tls and self._tls_pending():
                readable = True  # decrypted bytes that select cannot see
            else:
                readable = False
                trusted, borrows = holding, self._borrows  # no borrow under way now
                if holding and not self._tls:
                    self._reading.release()  # a waiting caller may read meanwhile
                    holding = False
                for key, ready in selector.select(timeout):
                    if key.fileobj is wake:
                        wake.clear()
                    elif ready & selectors.EVENT_READ:
                        readable = True
                holding = holding or self._reading.acquire(blocking=False)
                # A caller that read meanwhile (or was reading) may have taken what
                # select saw: the next select tells.
                readable = readable and trusted and holding and self._borrows == borrows
            if self._stopping:
                return
            if self._borrow_error is not None:
                raise self._borrow_error
            if self._sock.fileno() == -1:
                raise ConnectionLost("the socket was closed under the drainer")
            now = monotonic()
            if readable and self._read():
                self._last_recv = now
                deferred_since = None
            flushing = self._sink.flush_writes()
            if interval:
                sent = self._sink.bytes_sent
                if sent != seen_sent:
                    seen_sent, last_sent = sent, now
                elif now - last_sent >= interval / 2:
                    # A busy lock means a writer is mid-frame: that is traffic too.
                    if self._sink.try_send_heartbeat():
                        self._counts.heartbeats_sent += 1
                    seen_sent, last_sent = self._sink.bytes_sent, now
                if now - self._last_recv > 2 * interval:
                    raise HeartbeatTimeout(
                        f"no frame from the broker for {now - self._last_recv:.1f}s "
                        f"(heartbeat {interval:g}s)"
                    )

    def _defer_reading(self, allowed: bool) -> bool:
        """Whether to leave the socket unread now: ``allowed`` and the consumer is behind
        (``sink.consumer_behind()``). The flag is set before the question is asked, and
        the inbox told to resume reading when it empties, so a consumer that catches up
        (or a thread that starts to wait) meanwhile is never missed."""
        sink = self._sink
        if not (allowed and sink.consumer_behind()):
            if self._deferring:
                with self._watch_lock:
                    self._deferring = False
                    self._register()
                sink.watch_inbox_empty(False)
            return False
        with self._watch_lock:
            self._deferring = True  # from here on, resume_reading() undoes it
        sink.watch_inbox_empty(True)
        behind = sink.consumer_behind()
        with self._watch_lock:
            if not behind:
                self._deferring = False
            self._register()
            deferring = self._deferring
        if not deferring:
            sink.watch_inbox_empty(False)
        return deferring

    def _read(self) -> bool:
        """Read what is available without blocking; dispatch complete frames."""
        try:  # never blocks: a readiness may be stale (see _loop)
            data = self._recv_tls() if self._tls else self._sock.recv(READ_SIZE, _DONTWAIT)
        except BlockingIOError:
            return False
        if data is None:  # TLS record not complete yet
            return False
        if not data:
            self._assembler.check_eof()
            raise ConnectionLost("the broker closed the connection (end of stream)")
        self._mid_read = True
        stats = self._counts
        stats.reads += 1
        stats.bytes_read += len(data)
        try:
            frames = self._assembler.feed(data)
        except MalformedFrame as exc:
            # What came before the bad frame was sound: deliver it, then fail.
            frames, exc.frames = exc.frames, []
            if frames:
                self._sink.dispatch_frames(frames)
            raise
        if frames:
            stats.frames_read += len(frames)
            stats.heartbeats_received += sum(1 for f in frames if f[0] == 8)
            stats.dispatches += 1
            self._sink.dispatch_frames(frames)
        self._mid_read = False
        return True

    def _tls_pending(self) -> int:
        with self._sink.io_lock:  # SSL_pending beside a writer's SSL_write is unsafe
            return self._sock.pending()  # type: ignore[attr-defined, no-any-return]

    def _recv_tls(self) -> bytes | None:
        sock = self._sock
        chunks = []
        with self._sink.io_lock:
            previous = sock.gettimeout()
            sock.setblocking(False)
            try:
                while True:
                    try:
                        chunk = sock.recv(READ_SIZE)
                    except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                        break
                    chunks.append(chunk)
                    if not chunk or not sock.pending():  # type: ignore[attr-defined]
                        break
            finally:
                sock.settimeout(previous)
        if not chunks:
            return None
        return b"".join(chunks)
