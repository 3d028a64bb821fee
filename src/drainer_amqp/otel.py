"""OpenTelemetry metrics for every drainer-amqp connection in the process (``otel`` extra).

    from drainer_amqp.otel import instrument
    metrics = instrument()  # or instrument(meter_provider=provider); metrics.close() stops it

Nothing here is imported by the rest of the package: without ``instrument()`` there is no
cost and no OpenTelemetry import. The observable instruments read each live connection's
``drainer_stats()`` in the thread that collects (the SDK's reader); confirm durations are
recorded through ``Connection.on_confirm`` in the publishing thread. Counters stay
monotonic across connections that close or are collected: each collection adds what a
live connection counted since the previous one. See docs/metrics.md.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Histogram, MeterProvider, Observation

from . import __version__
from .connection import Connection, open_connections

__all__ = ["DrainerMetrics", "instrument"]

SYSTEM = {"messaging.system": "rabbitmq"}
PUBLISH = {**SYSTEM, "messaging.operation.name": "publish", "messaging.operation.type": "send"}
#: The messaging semantic conventions' advice for messaging.client.operation.duration.
DURATION_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10]

_Key = tuple[tuple[str, Any], ...]
_Read = Callable[[dict[str, Any]], float]
#: Sums over the open connections: name, unit, description, how to read drainer_stats().
_GAUGES: list[tuple[str, str, str, _Read]] = [
    ("drainer_amqp.connection.count", "{connection}", "Open connections.", lambda s: 1),
    (
        "drainer_amqp.connection.waiting_threads",
        "{thread}",
        "Threads waiting for a reply or a publisher confirm.",
        lambda s: s["waiting_threads"],
    ),
    (
        "drainer_amqp.connection.inbox.depth",
        "{callback}",
        "Callbacks (deliveries, returns, ...) queued for a drain_events() caller.",
        lambda s: s["pending_callbacks"],
    ),
    (
        "drainer_amqp.connection.blocked",
        "{connection}",
        "Connections the broker blocks (memory or disk alarm).",
        lambda s: int(bool(s["blocked"])),
    ),
    (
        "drainer_amqp.connection.confirms.outstanding",
        "{message}",
        "Deferred publishes awaiting the broker's confirm.",
        lambda s: s["confirms_outstanding"],
    ),
]
#: Monotonic sums over every connection seen: name, unit, description, (stat, attributes).
_COUNTERS: list[tuple[str, str, str, list[tuple[str, dict[str, str]]]]] = [
    (
        "messaging.client.sent.messages",
        "{message}",
        "Messages published (each Basic.Publish handed to a connection's writer).",
        [("messages_sent", PUBLISH)],
    ),
    (
        "drainer_amqp.connection.transport_lock.time",
        "s",
        "Seconds the drainer held the transport lock while dispatching frames.",
        [("lock_held_seconds", {})],
    ),
    (
        "drainer_amqp.connection.heartbeats",
        "{heartbeat}",
        "Heartbeat frames the drainer sent and received.",
        [
            ("heartbeats_sent", {"drainer_amqp.direction": "sent"}),
            ("heartbeats_received", {"drainer_amqp.direction": "received"}),
        ],
    ),
    (
        "drainer_amqp.connection.confirms",
        "{message}",
        "Deferred publishes settled, by outcome.",
        [
            (f"confirms_{outcome}", {"drainer_amqp.outcome": outcome})
            for outcome in ("acked", "nacked", "returned", "failed")
        ],
    ),
]
#: Counted by the drainer thread: none in legacy mode.
_DRAINER_ONLY = {"lock_held_seconds", "heartbeats_sent", "heartbeats_received"}


def _attributes(conn: Connection) -> _Key:
    host, _, port = str(conn.host).rpartition(":") if ":" in str(conn.host) else (conn.host, "", "")
    return (
        *SYSTEM.items(),
        ("server.address", host),
        ("server.port", int(port or 5672)),
        ("drainer_amqp.mode", "drainer" if conn.dedicated_drainer else "legacy"),
    )


class DrainerMetrics:
    """The instruments of one ``instrument()`` call. Callbacks run in the collecting
    thread; ``_lock`` guards ``_last`` and ``_totals`` (taken by those callbacks)."""

    def __init__(self, meter_provider: MeterProvider | None = None) -> None:
        meter = metrics.get_meter("drainer_amqp", __version__, meter_provider)
        self._lock = threading.Lock()
        self._last: weakref.WeakKeyDictionary[Connection, dict[str, float]] = (
            weakref.WeakKeyDictionary()
        )
        self._totals: dict[tuple[str, _Key], float] = {}
        self._active = True
        _instruments.add(self)
        for name, unit, description, read in _GAUGES:
            meter.create_observable_gauge(name, [self._gauge(read)], unit, description)
        for name, unit, description, stats in _COUNTERS:
            callbacks = [self._counter(stat, extra) for stat, extra in stats]
            meter.create_observable_counter(name, callbacks, unit, description)
        self.duration = meter.create_histogram(
            "messaging.client.operation.duration",
            "s",
            "Confirmed publishes: seconds from the publish to the broker's ack or nack.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        # Called in the publishing thread; a partial is not a function, so never bound.
        self._hook = functools.partial(_record_confirm, self.duration)
        self._previous_hook, Connection.on_confirm = Connection.on_confirm, self._hook

    def close(self) -> None:
        """Stop recording: the callbacks observe nothing, the confirm hook is removed."""
        self._active = False
        if Connection.on_confirm is self._hook:
            Connection.on_confirm = self._previous_hook

    def _connections(self) -> list[tuple[Connection, dict[str, Any]]]:
        return [(c, c.drainer_stats()) for c in open_connections()] if self._active else []

    def _gauge(self, read: _Read) -> Callable[..., Any]:
        """Sums over the open connections, by server and mode."""

        def observe(options: CallbackOptions) -> Iterable[Observation]:
            sums: dict[_Key, float] = {}
            for conn, stats in self._connections():
                if conn.reason is None and conn.connected:
                    key = _attributes(conn)
                    sums[key] = sums.get(key, 0) + read(stats)
            return [Observation(value, dict(key)) for key, value in sums.items()]

        return observe

    def _counter(self, stat: str, extra: dict[str, str]) -> Callable[..., Any]:
        """Monotonic sums over every connection seen, by server and mode."""

        def observe(options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                for conn, stats in self._connections():
                    if stat in _DRAINER_ONLY and not conn.dedicated_drainer:
                        continue
                    last = self._last.setdefault(conn, {})
                    key = (stat, _attributes(conn))
                    seen, value = last.get(stat, 0.0), float(stats[stat])
                    self._totals[key] = self._totals.get(key, 0.0) + max(value - seen, 0.0)
                    last[stat] = max(value, seen)  # a stat that resets is not counted back
                found = [(k, v) for (s, k), v in self._totals.items() if s == stat]
            return [Observation(v, {**dict(k), **extra}) for k, v in found]

        return observe


#: Every DrainerMetrics made, for the fork hook.
_instruments: weakref.WeakSet[DrainerMetrics] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for instruments in list(_instruments):
        instruments._lock = threading.Lock()  # the collecting thread may have held it


os.register_at_fork(after_in_child=_after_fork_in_child)


def _record_confirm(histogram: Histogram, seconds: float, acked: bool) -> None:
    histogram.record(seconds, PUBLISH if acked else {**PUBLISH, "error.type": "nack"})


def instrument(meter_provider: MeterProvider | None = None) -> DrainerMetrics:
    """Expose every drainer-amqp connection's stats as OpenTelemetry instruments, on
    ``meter_provider`` (default: the global one). Call once per process."""
    return DrainerMetrics(meter_provider)
