"""The data path: a proxied TCP connection and its two one-way links.

Threading contract
------------------
* Each :class:`Link` runs exactly one named daemon *pump* thread which reads the
  source socket, steps the toxic stages and writes the destination socket.
  Sockets are non-blocking and every wait is a ``select`` that also watches
  the link's wake-up socketpair, so a link can always be stopped promptly.
* ``add_toxic`` / ``update_toxic`` / ``remove_toxic`` / ``stop`` may be called
  from any thread.  They take the link's lock, which the pump only holds while
  stepping stages (never while blocked on I/O), so a toxic change is applied to
  the live chain before the call returns.
* A :class:`Connection` owns both sockets.  When either link ends (EOF, socket
  error, toxic-initiated close or ``stop``), the whole connection is torn down
  (as upstream does: no half-close).  The last pump thread to exit closes the
  sockets, so no socket is closed while another thread may still use it.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, MutableSequence, Sequence

from .specs import ToxicSpec
from .toxics import Chunk, Item, Stage, new_stage

__all__ = ["Connection", "Link"]

READ_SIZE = 32 * 1024
#: Upper bound for one select() wait; wake-ups normally arrive much sooner.
MAX_WAIT = 0.5


class Link:
    """One direction (``"upstream"``: client -> server, or ``"downstream"``)."""

    def __init__(
        self,
        conn: Connection,
        direction: str,
        src: socket.socket,
        dst: socket.socket,
        specs: Sequence[ToxicSpec],
    ) -> None:
        self.direction = direction
        self._conn = conn
        self._src = src
        self._dst = dst
        self._lock = threading.Lock()
        now = time.monotonic()
        self._stages: list[Stage] = [new_stage(spec, now) for spec in specs]
        self._input: list[Item] = []  # read from src, not yet stepped
        self._output: list[Item] = []  # past every stage, not yet written
        self._src_eof = False
        self._stopping = False
        self._wake_closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(
            target=self._run, name=f"{conn.name}-{direction}", daemon=True
        )

    # -- control (any thread) ----------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        self._wake()

    def add_toxic(self, spec: ToxicSpec) -> None:
        """Append a toxic; the previous last toxic is interrupted (flushed and re-run)."""
        with self._lock:
            now = time.monotonic()
            if self._stages:
                last = self._stages[-1]
                self._output.extend(last.restart(last.spec, now))
            self._stages.append(new_stage(spec, now))
        self._wake()

    def update_toxic(self, spec: ToxicSpec) -> None:
        with self._lock:
            index = self._index(spec.name)
            if index is not None:
                flushed = self._stages[index].restart(spec, time.monotonic())
                self._downstream_of(index).extend(flushed)
        self._wake()

    def remove_toxic(self, name: str) -> None:
        with self._lock:
            index = self._index(name)
            if index is not None:
                stage = self._stages.pop(index)
                if stage.closes_on_removal:
                    items: list[Item] = [] if stage.dead else [None]
                else:
                    items = stage.drain()
                    if index > 0:
                        prev = self._stages[index - 1]
                        items.extend(prev.restart(prev.spec, time.monotonic()))
                self._downstream_of(index - 1).extend(items)
        self._wake()

    # -- internals (lock held) ---------------------------------------------
    def _index(self, name: str) -> int | None:
        for i, stage in enumerate(self._stages):
            if stage.spec.name == name:
                return i
        return None

    def _downstream_of(self, index: int) -> MutableSequence[Item]:
        """Where items leaving stage ``index`` go (-1 means 'before the first stage')."""
        if index + 1 < len(self._stages):
            return self._stages[index + 1].inbox
        return self._output

    def _advance(self, now: float) -> float | None:
        items, self._input = self._input, []
        deadline: float | None = None
        for stage in self._stages:
            stage.inbox.extend(items)
            items = []
            wake = stage.step(now, items)
            if wake is not None and (deadline is None or wake < deadline):
                deadline = wake
        self._output.extend(items)
        return deadline

    def _take_output(self) -> tuple[bytes, bool]:
        data: list[bytes] = []
        eof = False
        for item in self._output:
            if item is None:
                eof = True
                break
            data.append(item.data)
        self._output = []
        return b"".join(data), eof

    def _want_read(self) -> bool:
        return not self._src_eof and not any(stage.full() for stage in self._stages)

    # -- pump thread -------------------------------------------------------
    def _wake(self) -> None:
        with self._lock:  # never write to a wake-up socket that may be closed
            if self._wake_closed:
                return
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass  # already woken (buffer full)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _run(self) -> None:
        try:
            self._pump()
        except OSError:
            pass
        finally:
            self._conn.link_finished(self)

    def _pump(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
                now = time.monotonic()
                deadline = self._advance(now)
                data, eof = self._take_output()
                want_read = self._want_read()
            if data and not self._send_all(data):
                return
            if eof:
                return
            if data:
                continue  # time has passed while writing; step again first
            timeout = MAX_WAIT if deadline is None else min(max(deadline - now, 0.0), MAX_WAIT)
            rlist = [self._wake_r, self._src] if want_read else [self._wake_r]
            readable, _, _ = select.select(rlist, [], [], timeout)
            if self._wake_r in readable:
                self._drain_wake()
            if self._src in readable:
                self._read_source()

    def _read_source(self) -> None:
        try:
            data = self._src.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""  # reset or error: treat like upstream (source terminated)
        with self._lock:
            if data:
                self._input.append(Chunk(data, time.monotonic()))
            else:
                self._src_eof = True
                self._input.append(None)

    def _send_all(self, data: bytes) -> bool:
        view = memoryview(data)
        while view:
            try:
                sent = self._dst.send(view)
                view = view[sent:]
                continue
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return False
            readable, _, _ = select.select([self._wake_r], [self._dst], [], MAX_WAIT)
            if readable:
                self._drain_wake()
                with self._lock:
                    if self._stopping:
                        return False
        return True

    def close_wakeup(self) -> None:
        """Close the wake-up pair; only after the pump thread has exited."""
        with self._lock:
            self._wake_closed = True
            self._wake_r.close()
            self._wake_w.close()


class Connection:
    """A client socket, an upstream socket and the two links between them."""

    def __init__(
        self,
        name: str,
        client: socket.socket,
        upstream: socket.socket,
        up_specs: Sequence[ToxicSpec],
        down_specs: Sequence[ToxicSpec],
        on_closed: Callable[[Connection], None],
    ) -> None:
        self.name = name
        self._client = client
        self._upstream = upstream
        self._on_closed = on_closed
        self._lock = threading.Lock()
        self._finished = 0
        self._reset = any(s.type == "reset_peer" for s in (*up_specs, *down_specs))
        for sock in (client, upstream):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._reset:  # like upstream link.go: SetLinger(0) at link start only
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.up = Link(self, "upstream", client, upstream, up_specs)
        self.down = Link(self, "downstream", upstream, client, down_specs)

    @property
    def links(self) -> tuple[Link, Link]:
        return self.up, self.down

    def start(self) -> None:
        self.up.start()
        self.down.start()

    def stop(self) -> None:
        """Tear the connection down (normal close unless linger 0 was set)."""
        for link in self.links:
            link.stop()

    def join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for link in self.links:
            link.join(max(end - time.monotonic(), 0.0))

    def is_alive(self) -> bool:
        return any(link.is_alive() for link in self.links)

    def link_finished(self, link: Link) -> None:
        """Called by each pump thread as it exits; the last one closes the sockets."""
        with self._lock:
            self._finished += 1
            last = self._finished == 2
        if not last:
            self.stop()
            return
        for link_ in self.links:
            link_.close_wakeup()
        for sock in (self._client, self._upstream):
            try:
                sock.close()
            except OSError as exc:  # pragma: no cover - close() rarely fails
                if exc.errno != errno.EBADF:
                    raise
        self._on_closed(self)
