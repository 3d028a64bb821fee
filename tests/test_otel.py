"""``drainer_amqp.otel`` against the real broker, read with the OpenTelemetry SDK's
``InMemoryMetricReader``: published and confirmed message counts, the confirm-duration
histogram (acks and nacks), the connection's own gauges and counters, ``close()``, and no
OpenTelemetry import or hook without ``instrument()``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import amqp
import pytest
from amqp.exceptions import MessageNacked
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support.broker import unique_name, wait_until

import drainer_amqp
from drainer_amqp.otel import DrainerMetrics, instrument

N = 50  # confirmed publishes
WAIT = 15.0
Points = dict[str, list[Any]]


@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics = instrument(meter_provider=provider)
    yield reader
    metrics.close()
    provider.shutdown()


def collect(reader: InMemoryMetricReader) -> Points:
    """Every metric's data points, by metric name."""
    data = reader.get_metrics_data()
    points: Points = {}
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points.setdefault(metric.name, []).extend(metric.data.data_points)
    return points


def of(conn: drainer_amqp.Connection, points: Points, name: str, **attrs: Any) -> float:
    """The value of ``name`` for ``conn``'s server and mode (and ``attrs``)."""
    host, _, port = conn.host.rpartition(":")
    want = {
        "server.address": host,
        "server.port": int(port),
        "drainer_amqp.mode": "drainer" if conn.dedicated_drainer else "legacy",
        **attrs,
    }
    found = [p.value for p in points.get(name, []) if want.items() <= dict(p.attributes).items()]
    return sum(found)


@pytest.mark.parametrize("mode", ["drainer", "legacy"])
def test_sent_messages_and_confirm_durations(
    mode: str, reader: InMemoryMetricReader, connect: Callable[..., drainer_amqp.Connection]
) -> None:
    conn = connect(mode, confirm_publish=True)
    channel = conn.channel()
    queue = unique_name("otel")
    channel.queue_declare(queue, auto_delete=False)
    try:
        sent_before = of(conn, collect(reader), "messaging.client.sent.messages")
        for i in range(N):
            channel.basic_publish(amqp.Message(f"{i}"), routing_key=queue)  # waits for the ack
        points = collect(reader)
    finally:
        channel.queue_delete(queue)

    assert of(conn, points, "messaging.client.sent.messages") - sent_before == N
    (histogram,) = points["messaging.client.operation.duration"]
    assert histogram.count == N
    assert dict(histogram.attributes) == {
        "messaging.system": "rabbitmq",
        "messaging.operation.name": "publish",
        "messaging.operation.type": "send",
    }
    assert 0 < histogram.sum < N * WAIT
    assert of(conn, points, "drainer_amqp.connection.count") >= 1
    assert of(conn, points, "drainer_amqp.connection.waiting_threads") == 0
    if mode == "drainer":
        assert of(conn, points, "drainer_amqp.connection.transport_lock.time") > 0
    print(f"\n{mode}: " + "; ".join(_summary(points)))


def _summary(points: Points) -> list[str]:
    lines = []
    for name, found in sorted(points.items()):
        for p in found:
            value = f"count={p.count} sum={p.sum:.4f}s" if hasattr(p, "count") else f"{p.value:g}"
            short = {k: v for k, v in p.attributes.items() if k not in ("messaging.system",)}
            lines.append(f"{name}{short} = {value}")
    return lines


def test_a_nacked_publish_is_recorded_with_its_error_type(
    reader: InMemoryMetricReader, connect: Callable[..., drainer_amqp.Connection]
) -> None:
    conn = connect("drainer", confirm_publish=True)
    channel = conn.channel()
    queue = unique_name("otel-full")
    args = {"x-max-length": 0, "x-overflow": "reject-publish"}  # the broker nacks publishes
    channel.queue_declare(queue, auto_delete=False, arguments=args)
    try:
        with pytest.raises(MessageNacked):
            channel.basic_publish(amqp.Message("x"), routing_key=queue)
    finally:
        channel.queue_delete(queue)
    (histogram,) = collect(reader)["messaging.client.operation.duration"]
    assert histogram.count == 1 and histogram.attributes["error.type"] == "nack"


def test_inbox_depth_is_the_callbacks_waiting_for_drain_events(
    reader: InMemoryMetricReader, connect: Callable[..., drainer_amqp.Connection]
) -> None:
    conn = connect("drainer")
    channel = conn.channel()
    queue = unique_name("otel-inbox")
    channel.queue_declare(queue, auto_delete=False)
    try:
        channel.basic_consume(queue, consumer_tag="c", callback=lambda message: None, no_ack=True)
        for i in range(5):
            channel.basic_publish(amqp.Message(f"{i}"), routing_key=queue)
        # Nobody drains: the drainer queues the deliveries in the inbox.
        assert wait_until(lambda: conn.drainer_stats()["pending_callbacks"] == 5, WAIT)
        assert of(conn, collect(reader), "drainer_amqp.connection.inbox.depth") == 5
        while conn.drainer_stats()["pending_callbacks"]:
            conn.drain_events(timeout=WAIT)
        assert of(conn, collect(reader), "drainer_amqp.connection.inbox.depth") == 0
    finally:
        channel.queue_delete(queue)


def test_heartbeats_and_transport_lock_time_count_the_drainers_work(
    reader: InMemoryMetricReader, connect: Callable[..., drainer_amqp.Connection]
) -> None:
    conn = connect("drainer", heartbeat=1)
    stats = conn.drainer_stats
    both = ("heartbeats_sent", "heartbeats_received")
    assert wait_until(lambda: all(stats()[key] for key in both), WAIT)
    points = collect(reader)
    heartbeats = "drainer_amqp.connection.heartbeats"
    assert of(conn, points, heartbeats, **{"drainer_amqp.direction": "sent"}) >= 1
    assert of(conn, points, heartbeats, **{"drainer_amqp.direction": "received"}) >= 1
    assert of(conn, points, "drainer_amqp.connection.transport_lock.time") > 0
    legacy = connect("legacy")
    assert not [p for p in points[heartbeats] if p.attributes["drainer_amqp.mode"] == "legacy"]
    assert legacy.drainer_stats()["messages_sent"] == 0


def test_close_removes_the_hook_and_observes_nothing() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics = DrainerMetrics(provider)
    assert drainer_amqp.Connection.on_confirm is not None
    metrics.close()
    assert drainer_amqp.Connection.on_confirm is None
    assert not [p for points in collect(reader).values() for p in points]
    provider.shutdown()


def test_no_opentelemetry_without_instrument() -> None:
    code = (
        "import sys, kombu, drainer_amqp, drainer_amqp.transport\n"
        "kombu.Connection('amqp://', transport='drainer_amqp:Transport')\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "assert drainer_amqp.Connection.on_confirm is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("mode", ["drainer", "legacy"])
def test_deferred_confirms_are_counted_by_outcome(
    mode: str, reader: InMemoryMetricReader, connect: Callable[..., drainer_amqp.Connection]
) -> None:
    conn = connect(mode)
    channel = conn.channel()
    queue = channel.queue_declare("", exclusive=True).queue
    futures = [
        channel.basic_publish_deferred(amqp.Message(b"x"), routing_key=queue) for _ in range(5)
    ]
    returned = channel.basic_publish_deferred(
        amqp.Message(b"x"), routing_key=queue + "-nowhere", mandatory=True
    )
    assert all(f.result(WAIT) for f in futures)
    assert returned.exception(WAIT) is not None
    points = collect(reader)
    confirms = "drainer_amqp.connection.confirms"
    assert of(conn, points, confirms, **{"drainer_amqp.outcome": "acked"}) == 5
    assert of(conn, points, confirms, **{"drainer_amqp.outcome": "returned"}) == 1
    assert of(conn, points, "drainer_amqp.connection.confirms.outstanding") == 0
