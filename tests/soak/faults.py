"""The soak's faults: one at a time, at random moments, from a seeded RNG.

Every fault is undone before the next one starts (and in a ``finally``): toxics are
removed, the proxy re-enabled, the memory watermark restored. The memory alarm is only
ever raised on a broker the soak owns (``Broker.owned``).

Threading contract: a :class:`FaultInjector` runs in one thread of its own
(``soak-faults``), started by :meth:`start` and joined by :meth:`stop` within the
longest fault's duration plus the proxy API's timeouts. ``records`` is written by that
thread only; read it after :meth:`stop`.
"""

from __future__ import annotations

import random
import re
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from time import monotonic
from typing import Any

__all__ = ["KINDS", "Broker", "FaultInjector", "FaultRecord"]

#: Every fault the soak knows, in the order of the brief.
KINDS = (
    "reset_peer",
    "disable",
    "latency",
    "bandwidth",
    "slicer",
    "timeout",
    "close_connection",
    "memory_alarm",
)
DEFAULT_WATERMARK = 0.4  # RabbitMQ's default vm_memory_high_watermark
ALARM_WATERMARK = 0.000_001  # far below any node's use: the alarm goes off at once


@dataclass
class Broker:
    """Where the soak's connections go, and how to control that broker.

    ``owned`` is true only for a node the soak started itself: only then may a fault
    change its settings (the memory alarm)."""

    host: str
    port: int
    ctl: Callable[..., str]  # rabbitmqctl with the node's own options
    owned: bool = False
    default_watermark: float = DEFAULT_WATERMARK  # restored after every run (owned only)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@{self.host}:{self.port}//"

    def close_named_connections(self, name: str) -> int:
        """Close, from the broker's side, every connection whose client called itself
        ``name`` (the ``connection_name`` client property). The soak's connections
        reach the broker through the proxy, so their peer port is the proxy's: the
        name is what tells the soak's own connections from everybody else's."""
        out = self.ctl("list_connections", "pid", "client_properties")
        marker = f'{{"connection_name","{name}"}}'
        pids = [line.split("\t", 1)[0] for line in out.splitlines() if marker in line]
        for pid in pids:
            try:
                self.ctl("close_connection", pid, "soak: close_connection fault")
            except (RuntimeError, subprocess.SubprocessError):
                pass  # it closed on its own meanwhile
        return len(pids)

    def watermark(self) -> float:
        out = self.ctl("eval", "vm_memory_monitor:get_vm_memory_high_watermark().")
        match = re.search(r"[0-9.]+(e-?[0-9]+)?", out)
        return float(match.group(0)) if match else DEFAULT_WATERMARK

    def set_watermark(self, fraction: float) -> None:
        assert self.owned, "the memory alarm is only raised on a broker the soak owns"
        self.ctl("set_vm_memory_high_watermark", repr(float(fraction)))


def default_broker_ctl(*args: str, timeout: float = 60.0) -> str:
    """``rabbitmqctl`` for the shared default broker (read and close_connection only)."""
    result = subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


@dataclass
class FaultRecord:
    kind: str
    start: float  # seconds since the soak started
    duration: float  # seconds from applying the fault to undoing it
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["start"] = round(self.start, 2)
        out["duration"] = round(self.duration, 2)
        return out


class FaultInjector:
    """Waits ``interval`` (uniform, seconds), applies a fault drawn from ``kinds``,
    undoes it, and again, until stopped. Same seed, same draws."""

    def __init__(
        self,
        proxy: Any,
        broker: Broker,
        rng: random.Random,
        kinds: Sequence[str],
        *,
        interval: tuple[float, float] = (5.0, 20.0),
        heartbeat: float = 2.0,
        connection_name: str = "",
        start: float | None = None,
    ) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown faults: {sorted(unknown)}")
        if "memory_alarm" in kinds and not broker.owned:
            raise ValueError("memory_alarm needs a broker the soak owns (--own-node)")
        if not kinds:
            raise ValueError("no fault to draw from")
        self.proxy = proxy
        self.broker = broker
        self.rng = rng
        self.kinds = list(kinds)
        self.interval = interval
        self.heartbeat = heartbeat
        self.connection_name = connection_name
        self.start_time = monotonic() if start is None else start
        self.records: list[FaultRecord] = []
        self.errors: list[str] = []  # a fault that could not be applied or undone
        self.last_end = self.start_time  # monotonic time the last fault was undone
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> bool:
        """Stop drawing; wait for the fault in progress to be undone. False on a hang."""
        self._stop.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def longest(self) -> float:
        return max((r.duration for r in self.records), default=0.0)

    def _run(self) -> None:
        while not self._stop.wait(self.rng.uniform(*self.interval)):
            kind = self.rng.choice(self.kinds)
            hold = self._hold(kind)
            begin = monotonic()
            detail: dict[str, Any] = {}
            try:
                detail = self._apply(kind, hold) or {}
            except Exception as exc:  # noqa: BLE001 - reported in the run's result
                self.errors.append(f"{kind}: {exc!r}")
            finally:
                self._undo(kind)
                self.last_end = monotonic()
            self.records.append(
                FaultRecord(kind, begin - self.start_time, self.last_end - begin, detail)
            )

    def _hold(self, kind: str) -> float:
        """How long the fault stays on: one draw per fault, whatever its kind."""
        u = self.rng.random()
        if kind == "reset_peer":
            return 0.3 + 0.9 * u  # the reset comes with the next bytes: heartbeats, 1 s
        if kind == "disable":
            return 0.5 + 2.5 * u
        if kind == "timeout":
            return 2.5 * self.heartbeat + 0.5
        if kind == "memory_alarm":
            return 3.0 + 3.0 * u
        return 3.0 + 5.0 * u

    def _wait(self, seconds: float) -> None:
        threading.Event().wait(seconds)  # a fault is held whole, even while stopping

    def _apply(self, kind: str, hold: float) -> dict[str, Any] | None:
        proxy = self.proxy
        if kind == "reset_peer":
            for stream in ("downstream", "upstream"):
                proxy.add_toxic(
                    name=f"soak_reset_{stream}",
                    type="reset_peer",
                    stream=stream,
                    attributes={"timeout": 0},
                )
        elif kind == "disable":
            proxy.disable()
        elif kind == "latency":
            proxy.add_toxic(name="soak_latency", type="latency", attributes={"latency": 200})
        elif kind == "bandwidth":
            proxy.add_toxic(name="soak_bandwidth", type="bandwidth", attributes={"rate": 32})
        elif kind == "slicer":
            proxy.add_toxic(
                name="soak_slicer",
                type="slicer",
                attributes={"average_size": 64, "size_variation": 32, "delay": 200},
            )
        elif kind == "timeout":
            # Nothing passes for longer than two heartbeat intervals; then the proxy
            # closes the link (its timeout), unless a heartbeat check ended it first.
            for stream in ("downstream", "upstream"):
                proxy.add_toxic(
                    name=f"soak_timeout_{stream}",
                    type="timeout",
                    stream=stream,
                    attributes={"timeout": int((hold - 0.5) * 1000)},
                )
        elif kind == "close_connection":
            closed = self.broker.close_named_connections(self.connection_name)
            return {"closed": closed}
        elif kind == "memory_alarm":
            self._watermark = self.broker.watermark()
            self.broker.set_watermark(ALARM_WATERMARK)
        self._wait(hold)
        return {"hold": round(hold, 2)}

    def _undo(self, kind: str) -> None:
        proxy = self.proxy
        try:
            if kind == "disable":
                proxy.enable()
            elif kind == "memory_alarm":
                self.broker.set_watermark(getattr(self, "_watermark", DEFAULT_WATERMARK))
            elif kind in ("reset_peer", "timeout"):
                for stream in ("downstream", "upstream"):
                    self._destroy(f"soak_{kind.split('_')[0]}_{stream}")
            elif kind in ("latency", "bandwidth", "slicer"):
                self._destroy(f"soak_{kind}")
        except Exception as exc:  # noqa: BLE001 - reported; the run's finally retries
            self.errors.append(f"undo {kind}: {exc!r}")

    def _destroy(self, name: str) -> None:
        if name in self.proxy.toxics():
            self.proxy.destroy_toxic(name)
