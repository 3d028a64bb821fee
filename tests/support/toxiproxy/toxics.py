"""Per-connection toxic state machines ("stages") for one direction of a link.

Upstream Toxiproxy runs one goroutine per toxic and connects them with channels.
Here a single pump thread per direction drives a list of :class:`Stage` objects
in a time-stepped way: the pump calls :meth:`Stage.step` with the current
monotonic time, the stage consumes what it can from ``inbox``, appends what it
emits to ``out`` and returns the next time it wants to be stepped again.

Stream items are :class:`Chunk` objects; ``None`` is the end-of-stream marker
(upstream closes the stub's output channel).  A stage that has emitted ``None``
is *dead* and silently drops further input.

Threading contract: a stage is owned by one ``Link`` and is only touched while
that link's lock is held (by its pump thread or by an API thread applying a
toxic change), so stages need no locking of their own.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from .specs import ToxicSpec

__all__ = ["Chunk", "Item", "Stage", "new_stage"]

#: How many chunks a latency toxic buffers (upstream ``GetBufferSize`` is 1024).
LATENCY_BUFFER = 1024


@dataclass
class Chunk:
    """Bytes read from the source socket; ``ts`` is when (monotonic seconds)."""

    data: bytes
    ts: float


Item = Chunk | None


class Stage:
    """Base stage: a no-op that passes everything through immediately."""

    #: Removing a toxic of this type closes the link (upstream ``CleanupToxic``).
    closes_on_removal = False

    def __init__(self, spec: ToxicSpec, now: float) -> None:
        self.inbox: deque[Item] = deque()
        self.dead = False
        self.spec = spec
        self.active = True
        self._begin(spec, now)

    # -- lifecycle -------------------------------------------------------
    def _begin(self, spec: ToxicSpec, now: float) -> None:
        """(Re)start the toxic, like upstream ``ToxicStub.Run``: re-roll toxicity."""
        self.spec = spec
        self.active = random.random() < spec.toxicity
        self._reset_run(now)

    def _reset_run(self, now: float) -> None:
        """Reset per-run (not per-connection) state."""

    def _in_hand(self) -> list[Item]:
        """Items the running toxic holds that upstream flushes on interrupt."""
        return []

    def restart(self, spec: ToxicSpec, now: float) -> list[Item]:
        """Interrupt and re-run with ``spec``; returns the flushed in-hand items."""
        flushed = [] if self.dead else self._in_hand()
        self._begin(spec, now)
        return flushed

    def drain(self) -> list[Item]:
        """Everything still held, in order, for splicing this stage out of the chain."""
        if self.dead:
            return []
        items = self._in_hand() + list(self.inbox)
        self.inbox.clear()
        return items

    # -- data path ---------------------------------------------------------
    def full(self) -> bool:
        """True when the source should stop being read (backpressure)."""
        return False

    def step(self, now: float, out: list[Item]) -> float | None:
        """Consume/emit at time ``now``; return the next wake-up time or None."""
        if self.dead:
            self.inbox.clear()
            return None
        if not self.active:
            return self._pass_all(out)
        return self._step(now, out)

    def _step(self, now: float, out: list[Item]) -> float | None:
        return self._pass_all(out)

    def _pass_all(self, out: list[Item]) -> float | None:
        while self.inbox:
            item = self.inbox.popleft()
            out.append(item)
            if item is None:
                self._close()
                break
        return None

    def _close(self) -> None:
        self.dead = True
        self.inbox.clear()

    def attr(self, key: str) -> int:
        return int(self.spec.attributes.get(key, 0))


class LatencyStage(Stage):
    """Delays each chunk by latency ± jitter ms, measured from when it was read."""

    def _reset_run(self, now: float) -> None:
        self._release: float | None = None

    def _delay(self) -> float:
        delay = self.attr("latency")
        jitter = self.attr("jitter")
        if jitter > 0:
            delay += random.randrange(-jitter, jitter)
        return delay / 1000.0

    def _in_hand(self) -> list[Item]:
        if self._release is not None and self.inbox:
            self._release = None
            return [self.inbox.popleft()]
        return []

    def full(self) -> bool:
        return len(self.inbox) >= LATENCY_BUFFER

    def _step(self, now: float, out: list[Item]) -> float | None:
        while self.inbox:
            head = self.inbox[0]
            if head is None:
                return self._pass_all(out)
            if self._release is None:
                self._release = head.ts + self._delay()
            if now < self._release:
                return self._release
            self.inbox.popleft()
            out.append(Chunk(head.data, max(self._release, head.ts)))
            self._release = None
        return None


class BandwidthStage(Stage):
    """Limits throughput to ``rate`` KB/s (1 KB = 1000 bytes, i.e. rate bytes/ms).

    Like upstream: a chunk is released once its transmission time has elapsed;
    chunks larger than 100 ms worth of data are sent in 100 ms pieces, and the
    accumulated sleep error is carried over to the next chunk.
    """

    def _reset_run(self, now: float) -> None:
        self._cur: Chunk | None = None
        self._t0 = now
        self._sleep = 0.0

    def _in_hand(self) -> list[Item]:
        cur, self._cur = self._cur, None
        return [cur] if cur is not None else []

    def full(self) -> bool:
        return self._cur is not None or bool(self.inbox)

    def _step(self, now: float, out: list[Item]) -> float | None:
        rate = self.attr("rate")
        while True:
            if self._cur is None:
                if not self.inbox:
                    return None
                item = self.inbox.popleft()
                if item is None or rate <= 0:
                    self._sleep = 0.0
                    out.append(item)
                    if item is None:
                        self._close()
                        return None
                    continue
                self._sleep += len(item.data) / (rate * 1000.0)
                self._cur = Chunk(item.data, item.ts)
                self._t0 = now
            piece = rate * 100  # bytes per 100 ms
            if len(self._cur.data) > piece:
                deadline = self._t0 + 0.1
                if now < deadline:
                    return deadline
                out.append(Chunk(self._cur.data[:piece], self._cur.ts))
                self._cur.data = self._cur.data[piece:]
                self._sleep -= 0.1
                self._t0 = now
                continue
            deadline = self._t0 + self._sleep
            if now < deadline:
                return deadline
            self._sleep -= now - self._t0
            out.append(self._cur)
            self._cur = None


class SlicerStage(Stage):
    """Splits chunks into pieces of about ``average_size`` ± ``size_variation``
    bytes, waiting ``delay`` µs after each piece (as upstream does)."""

    def _reset_run(self, now: float) -> None:
        self._pieces: deque[Chunk] = deque()
        self._next_at = now

    def _in_hand(self) -> list[Item]:
        if not self._pieces:
            return []
        rest = b"".join(p.data for p in self._pieces)
        ts = self._pieces[0].ts
        self._pieces.clear()
        return [Chunk(rest, ts)]

    def full(self) -> bool:
        return bool(self._pieces) or bool(self.inbox)

    def _offsets(self, start: int, end: int) -> list[tuple[int, int]]:
        avg = self.attr("average_size")
        var = max(self.attr("size_variation"), 0)
        if avg <= 0 or (end - start) - avg <= var or end - start <= 1:
            return [(start, end)]
        jitter = random.randrange(-var, var) if var > 0 else 0
        mid = min(max(start + (end - start) // 2 + jitter, start + 1), end - 1)
        return self._offsets(start, mid) + self._offsets(mid, end)

    def _step(self, now: float, out: list[Item]) -> float | None:
        delay = max(self.attr("delay"), 0) / 1_000_000.0
        while True:
            if now < self._next_at:
                return self._next_at
            if self._pieces:
                out.append(self._pieces.popleft())
                self._next_at = now + delay
                continue
            if not self.inbox:
                return None
            item = self.inbox.popleft()
            if item is None:
                out.append(None)
                self._close()
                return None
            for a, b in self._offsets(0, len(item.data)):
                self._pieces.append(Chunk(item.data[a:b], item.ts))


class TimeoutStage(Stage):
    """Drops all data; closes the link after ``timeout`` ms (0 = never).

    The timer starts when the toxic starts running on this link (link start,
    toxic added, toxic updated).  Removing the toxic closes the link, as
    upstream's ``TimeoutToxic.Cleanup`` does.
    """

    closes_on_removal = True

    def _reset_run(self, now: float) -> None:
        self._started = now

    def _step(self, now: float, out: list[Item]) -> float | None:
        while self.inbox:
            if self.inbox.popleft() is None:  # drop data, but honour EOF
                out.append(None)
                self._close()
                return None
        timeout = self.attr("timeout")
        if timeout <= 0:
            return None
        deadline = self._started + timeout / 1000.0
        if now >= deadline:
            out.append(None)
            self._close()
            return None
        return deadline


class ResetPeerStage(Stage):
    """On the first item, drop it, wait ``timeout`` ms, then close the link.

    The TCP RST itself comes from SO_LINGER=0, which (like upstream ``link.go``)
    is only set on connections whose chain contained ``reset_peer`` when they
    started; otherwise the close is a normal FIN.
    """

    def _reset_run(self, now: float) -> None:
        if not hasattr(self, "_triggered"):
            self._triggered: float | None = None

    def full(self) -> bool:
        return self._triggered is not None

    def _step(self, now: float, out: list[Item]) -> float | None:
        if self._triggered is None:
            if not self.inbox:
                return None
            self.inbox.popleft()
            self._triggered = now
        deadline = self._triggered + self.attr("timeout") / 1000.0
        if now < deadline:
            return deadline
        out.append(None)
        self._close()
        return None


class LimitDataStage(Stage):
    """Passes at most ``bytes`` bytes, then closes the link.

    The byte count is per connection and survives toxic updates (upstream's
    stateful ``LimitDataToxicState``).
    """

    def _reset_run(self, now: float) -> None:
        if not hasattr(self, "_sent"):
            self._sent = 0

    def _step(self, now: float, out: list[Item]) -> float | None:
        limit = self.attr("bytes")
        while self.inbox:
            item = self.inbox.popleft()
            if item is None:
                out.append(None)
                self._close()
                return None
            data = item.data[: max(limit - self._sent, 0)]
            if data:
                out.append(Chunk(data, item.ts))
                self._sent += len(data)
            if limit - self._sent <= 0:
                out.append(None)
                self._close()
                return None
        return None


_STAGES: dict[str, type[Stage]] = {
    "latency": LatencyStage,
    "bandwidth": BandwidthStage,
    "slicer": SlicerStage,
    "timeout": TimeoutStage,
    "reset_peer": ResetPeerStage,
    "limit_data": LimitDataStage,
}


def new_stage(spec: ToxicSpec, now: float) -> Stage:
    """Create the per-link state machine for ``spec``."""
    return _STAGES.get(spec.type, Stage)(spec, now)
