"""What a soak run published, confirmed, consumed and raised, and which thread stalled.

Ids are ``"<publisher>:<sequence>"``. The state of every id is one byte in a
per-publisher ``bytearray`` (and one more for how often it was consumed), so a long run's
own bookkeeping adds about two bytes per message to the RSS the soak measures.

Threading contract: every method may be called from any thread; each class guards its
state with one lock of its own, held only for a few assignments.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from dataclasses import dataclass
from time import monotonic
from typing import Any

__all__ = ["Ledger", "Progress", "Raised"]

_PENDING, _CONFIRMED, _RAISED = 0, 1, 2


class Ledger:
    """Message ids by state: published (pending), confirmed, raised; consumed counts."""

    def __init__(self, publishers: int) -> None:
        self._lock = threading.Lock()  # guards _state, _seen, foreign
        self._state = [bytearray() for _ in range(publishers)]
        self._seen = [bytearray() for _ in range(publishers)]
        self.foreign = 0  # consumed bodies that are no id of this run

    def new_id(self, publisher: int) -> str:
        with self._lock:
            state = self._state[publisher]
            state.append(_PENDING)
            self._seen[publisher].append(0)
            return f"{publisher}:{len(state) - 1}"

    def _slot(self, message_id: str) -> tuple[int, int] | None:
        try:
            publisher, seq = (int(part) for part in message_id.split(":"))
        except (AttributeError, ValueError):
            return None
        if not 0 <= publisher < len(self._state) or not 0 <= seq < len(self._state[publisher]):
            return None
        return publisher, seq

    def confirmed(self, message_id: str) -> None:
        self._set(message_id, _CONFIRMED)

    def raised(self, message_id: str) -> None:
        self._set(message_id, _RAISED)

    def _set(self, message_id: str, state: int) -> None:
        with self._lock:
            slot = self._slot(message_id)
            assert slot is not None, message_id
            self._state[slot[0]][slot[1]] = state

    def consumed(self, message_id: Any) -> None:
        with self._lock:
            slot = self._slot(message_id)
            if slot is None:
                self.foreign += 1
                return
            seen = self._seen[slot[0]]
            seen[slot[1]] = min(seen[slot[1]] + 1, 255)

    def confirmed_count(self) -> int:
        with self._lock:
            return sum(state.count(_CONFIRMED) for state in self._state)

    def totals(self) -> dict[str, Any]:
        """The accounting: ``lost`` is confirmed but never consumed."""
        with self._lock:
            published = confirmed = raised = unique = total = lost = 0
            lost_sample: list[str] = []
            unconfirmed_arrived = 0
            for p, (state, seen) in enumerate(zip(self._state, self._seen, strict=True)):
                published += len(state)
                confirmed += state.count(_CONFIRMED)
                raised += state.count(_RAISED)
                for seq, (s, n) in enumerate(zip(state, seen, strict=True)):
                    if n:
                        unique += 1
                        total += n
                        if s != _CONFIRMED:
                            unconfirmed_arrived += 1
                    elif s == _CONFIRMED:
                        lost += 1
                        if len(lost_sample) < 10:
                            lost_sample.append(f"{p}:{seq}")
            return {
                "published": published,
                "confirmed": confirmed,
                "publish_raised": raised,
                "consumed_unique": unique,
                "duplicates": total - unique,
                "unconfirmed_arrived": unconfirmed_arrived,
                "lost": lost,
                "lost_sample": lost_sample,
                "foreign": self.foreign,
            }


class Raised:
    """Exceptions the soak's threads caught, by role and type, with the first traceback
    of each type."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards counts and first
        self.counts: Counter[tuple[str, str]] = Counter()
        self.unexpected: Counter[str] = Counter()  # types no kombu user is told to expect
        self.first: dict[str, str] = {}

    def add(self, role: str, exc: BaseException, expected: bool = True) -> None:
        kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
        with self._lock:
            self.counts[role, kind] += 1
            if not expected:
                self.unexpected[f"{role}: {kind}"] += 1
            if kind not in self.first:
                self.first[kind] = "".join(traceback.format_exception(exc))[-4000:]

    def by_type(self, role: str | None = None) -> dict[str, int]:
        with self._lock:
            out: Counter[str] = Counter()
            for (r, kind), n in self.counts.items():
                if role is None or r == role:
                    out[kind] += n
            return dict(out)

    def by_role(self) -> dict[str, dict[str, int]]:
        with self._lock:
            out: dict[str, dict[str, int]] = {}
            for (role, kind), n in self.counts.items():
                out.setdefault(role, {})[kind] = n
            return out


@dataclass
class _Track:
    last: float
    beats: int = 0
    worst: float = 0.0
    worst_at: float = 0.0  # when the worst gap ended, seconds since the start


class Progress:
    """When each thread last made progress (a confirm, a delivery or a clean drain
    timeout, a declare): the longest gap per thread is how long it was stuck."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _tracks, start
        self._tracks: dict[str, _Track] = {}
        self.start = monotonic()

    def register(self, name: str) -> None:
        with self._lock:
            self._tracks[name] = _Track(monotonic())

    def beat(self, name: str) -> None:
        now = monotonic()
        with self._lock:
            track = self._tracks[name]
            gap = now - track.last
            if gap > track.worst:
                track.worst, track.worst_at = gap, now - self.start
            track.last = now
            track.beats += 1

    def beats_since(self, when: float) -> dict[str, bool]:
        """Whether each thread made progress after ``when`` (monotonic)."""
        with self._lock:
            return {name: track.last > when for name, track in self._tracks.items()}

    def worst(self, until: float) -> tuple[float, str, float]:
        """The longest gap of any thread up to ``until`` (its open gap included):
        seconds, the thread's name, and when the gap ended (seconds since start)."""
        with self._lock:
            best = (0.0, "", 0.0)
            for name, track in self._tracks.items():
                open_gap = until - track.last
                gap, at = (
                    (open_gap, until - self.start)
                    if open_gap > track.worst
                    else (track.worst, track.worst_at)
                )
                if gap > best[0]:
                    best = (gap, name, at)
            return best
