"""One failover run against a :class:`~support.rabbit_nodes.RabbitCluster`: publisher
threads with confirms and a consumer with manual acks, through kombu's failover URL list,
while the node the clients are on is stopped (``stop_app``) or killed.

Shared by ``tests/test_cluster.py`` (which asserts on the outcome) and
``tests/benchmarks/bench_failover.py`` (which reports the times).

Clients:

``drainer``
    One ``kombu.Connection`` (``drainer-amqp://`` URLs, ``dedicated_drainer``) shared by
    every publisher thread and the consumer thread, as the library is meant to be used.
``stock``
    Stock kombu (``pyamqp://`` URLs). Stock py-amqp cannot share a connection between a
    consumer and publishers waiting for confirms (they read the same socket), so each
    thread gets its own ``kombu.Connection``: the way stock users stay safe.

Threading: :func:`run_failover` runs in the test's thread; it starts the publisher
threads (``failover-publisher-<n>``) and the consumer thread (``failover-consumer``),
stops them with an event, and joins each within ``JOIN`` seconds.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import amqp
import kombu

from .broker import drainer_threads, thread_stacks, wait_until
from .rabbit_nodes import RabbitCluster, RabbitNode

__all__ = [
    "CLIENTS",
    "FAULTS",
    "RETRY_POLICY",
    "FailoverResult",
    "declare_quorum_queue",
    "delete_queue",
    "run_failover",
]

CLIENTS = ("drainer", "stock")
FAULTS = ("stop_app", "kill")
PUBLISHERS = 4
JOIN = 30.0  # seconds: a thread not done by then hangs
#: Up to ~40 s of retrying: far more than a node loss should take.
RETRY_POLICY: dict[str, Any] = {
    "max_retries": 60,
    "interval_start": 0,
    "interval_step": 0.2,
    "interval_max": 1.0,
}
BEFORE = 40  # confirms wanted before the fault
AFTER = 40  # confirms wanted on the new node after it
DEADLINE = 60.0  # seconds for each phase


@dataclass
class FailoverResult:
    client: str
    fault: str
    old_port: int = 0
    t_fault: float = 0.0  #: monotonic time the stop/kill command was issued
    t_first_error: float | None = None  #: first error any client thread saw after it
    t_resumed: float | None = None  #: first confirm through another node after it
    confirmed: dict[str, int] = field(default_factory=dict)  #: body -> port confirmed on
    consumed: Counter[str] = field(default_factory=Counter)
    #: confirmed but not consumed, and still in the queue at the end (the consumer ended)
    left_in_queue: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)  #: what a thread raised (retries exhausted)
    error_types: Counter[str] = field(default_factory=Counter)  #: errors kombu retried
    hung: list[str] = field(default_factory=list)
    stacks: str = ""
    old_drainer_left: bool = False
    drainers_after_release: int = 0
    new_ports: set[int] = field(default_factory=set)

    @property
    def unconsumed(self) -> set[str]:
        return set(self.confirmed) - set(self.consumed)

    @property
    def lost(self) -> set[str]:
        """Confirmed, never consumed, and not in the queue either."""
        return self.unconsumed - self.left_in_queue

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in self.consumed.values() if n > 1)

    @property
    def failover_s(self) -> float | None:
        """Fault command issued -> first confirm on another node."""
        return None if self.t_resumed is None else self.t_resumed - self.t_fault

    @property
    def after_error_s(self) -> float | None:
        """First error seen -> first confirm on another node."""
        if self.t_resumed is None or self.t_first_error is None:
            return None
        return self.t_resumed - self.t_first_error

    def summary(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1000:.0f} ms"

        return (
            f"{self.client}/{self.fault}: failover {ms(self.failover_s)} after the command, "
            f"{ms(self.after_error_s)} after the first error; confirmed {len(self.confirmed)}, "
            f"consumed {len(self.consumed)} distinct, {self.duplicates} duplicates, "
            f"unconsumed {len(self.unconsumed)} (of them lost {len(self.lost)}, "
            f"left in the queue {len(self.left_in_queue)}); "
            f"retried errors {dict(self.error_types)}; raised {len(self.errors)}"
        )


def _url_list(cluster: RabbitCluster, client: str) -> str:
    return cluster.failover_url("drainer-amqp" if client == "drainer" else "pyamqp")


def _open(cluster: RabbitCluster, client: str) -> kombu.Connection:
    options: dict[str, Any] = {"confirm_publish": True}
    if client == "drainer":
        options["dedicated_drainer"] = True
    conn = kombu.Connection(_url_list(cluster, client), transport_options=options)
    conn.ensure_connection(max_retries=3)
    return conn


def _port_of(channel: Any) -> int:
    """The broker port ``channel`` is on; 0 if it was closed meanwhile."""
    host = getattr(getattr(channel, "connection", None), "host", None)
    return 0 if host is None else int(str(host).rpartition(":")[2])


def declare_quorum_queue(node: RabbitNode, name: str) -> kombu.Queue:
    """Declare a quorum queue through ``node`` (its leader starts there)."""
    queue = kombu.Queue(
        name, durable=True, auto_delete=False, queue_arguments={"x-queue-type": "quorum"}
    )
    with kombu.Connection(node.url, transport="pyamqp") as conn:
        queue.bind(conn.default_channel).declare()
    return queue


def delete_queue(cluster: RabbitCluster, name: str) -> set[str]:
    """Delete ``name`` through any node that is up; return the (raw) bodies left in it."""
    for node in cluster.nodes:
        try:
            conn = amqp.Connection(f"127.0.0.1:{node.port}", connect_timeout=5)
            conn.connect()
        except (OSError, amqp.AMQPError):
            continue
        try:
            channel = conn.channel()
            left: set[str] = set()
            while (message := channel.basic_get(name, no_ack=True)) is not None:
                body = message.body.decode() if isinstance(message.body, bytes) else message.body
                left.add(body)
            channel.queue_delete(name)
            return left
        finally:
            conn.close()
    return set()


def _format(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}"


def run_failover(
    cluster: RabbitCluster,
    client: str,
    fault: str,
    on_node_lost: Callable[[RabbitNode], None] | None = None,
) -> FailoverResult:
    """Publish and consume through the failover URL list, fail the clients' node, and
    keep going until ``AFTER`` confirms went through another node; then drain the queue.
    Returns what happened; asserts nothing. The failed node stays down: the caller
    brings it back (``cluster.ensure_running()``)."""
    if client not in CLIENTS or fault not in FAULTS:
        raise ValueError((client, fault))
    result = FailoverResult(client, fault)
    lock = threading.Lock()  # guards result's counters and lists
    stop_publishing = threading.Event()
    stop_consuming = threading.Event()
    fault_issued = threading.Event()
    name = f"drainer-cluster-{client}-{fault}-{uuid.uuid4().hex[:8]}"
    # The queue's leader is on the second node, the clients start on the first: losing
    # their node moves the connections, not the leader (RabbitMQ 3.10 can crash the
    # channel of a publish that races a leader election, closing the connection with
    # 541 INTERNAL_ERROR, which py-amqp deems irrecoverable: a broker matter).
    leader = cluster.nodes[1]
    queue = declare_quorum_queue(leader, name)
    opened: list[kombu.Connection] = []
    drainers_before = set(drainer_threads())
    shared = _open(cluster, client) if client == "drainer" else None
    if shared is not None:
        opened.append(shared)

    def connection() -> kombu.Connection:
        if shared is not None:
            return shared
        conn = _open(cluster, client)
        with lock:
            opened.append(conn)
        return conn

    def errback(exc: BaseException, interval: float) -> None:
        now = time.monotonic()
        with lock:
            result.error_types[type(exc).__name__] += 1
            if fault_issued.is_set():
                first = result.t_first_error
                result.t_first_error = now if first is None else min(first, now)

    policy = {**RETRY_POLICY, "errback": errback}

    def publisher(n: int) -> None:
        conn = connection()
        producer = kombu.Producer(conn)
        i = 0
        while not stop_publishing.is_set():
            body = f"{n}-{i}"
            i += 1
            try:
                producer.publish(
                    body,
                    routing_key=queue.name,
                    serializer="json",
                    retry=True,
                    retry_policy=policy,
                )
            except Exception as exc:  # noqa: BLE001 - reported: the retries gave up
                with lock:
                    result.errors.append(f"publisher-{n}: {_format(exc)}")
                return
            now = time.monotonic()
            port = _port_of(producer.channel)
            with lock:
                result.confirmed[body] = port
                if fault_issued.is_set() and port != result.old_port and result.t_resumed is None:
                    result.t_resumed = now

    def on_message(body: str, message: Any) -> None:
        message.ack()
        with lock:
            result.consumed[body] += 1

    def consume(channel: Any = None) -> None:
        with kombu.Consumer(channel, queues=[queue], callbacks=[on_message], accept=["json"]):
            while not stop_consuming.is_set():
                try:
                    channel.connection.drain_events(timeout=0.5)
                except TimeoutError:
                    continue

    def consumer() -> None:
        conn = connection()
        retrying = conn.autoretry(consume, channel=conn.channel(), **policy)
        try:
            retrying()
        except Exception as exc:  # noqa: BLE001 - reported: the retries gave up
            with lock:
                result.errors.append(f"consumer: {_format(exc)}")

    threads = [
        threading.Thread(target=publisher, args=(n,), name=f"failover-publisher-{n}")
        for n in range(PUBLISHERS)
    ]
    consumer_thread = threading.Thread(target=consumer, name="failover-consumer")
    try:
        for t in [consumer_thread, *threads]:
            t.start()
        if not wait_until(lambda: len(result.consumed) >= BEFORE or bool(result.errors), DEADLINE):
            result.errors.append("no traffic before the fault")
            return result
        with lock:
            ports = set(result.confirmed.values())
        if len(ports) != 1:
            result.errors.append(f"clients on several nodes before the fault: {ports}")
            return result
        result.old_port = ports.pop()
        old = cluster.node_on_port(result.old_port)
        if old is leader:
            result.errors.append(f"clients on the queue leader's node {old}")
            return result
        with lock:
            result.t_fault = time.monotonic()
            fault_issued.set()
        if fault == "stop_app":
            old.stop_app()
        else:
            old.kill()
        if on_node_lost is not None:
            on_node_lost(old)

        def resumed() -> bool:
            with lock:
                after = [p for p in result.confirmed.values() if p not in (0, result.old_port)]
            return len(after) >= AFTER or bool(result.errors)

        if not wait_until(resumed, DEADLINE):
            result.errors.append(f"no {AFTER} confirms on another node within {DEADLINE}s")
        stop_publishing.set()
        for t in threads:
            t.join(JOIN)
        with lock:
            confirmed = set(result.confirmed)
            result.new_ports = set(result.confirmed.values()) - {0, result.old_port}
        wait_until(lambda: confirmed <= set(result.consumed) or bool(result.errors), DEADLINE)
        if client == "drainer":
            old_name = f"drainer-amqp-127.0.0.1:{result.old_port}"
            result.old_drainer_left = not wait_until(
                lambda: all(t.name != old_name for t in drainer_threads()), 10
            )
    finally:
        stop_publishing.set()
        stop_consuming.set()
        for t in [*threads, consumer_thread]:
            t.join(JOIN)
        result.hung = [t.name for t in [*threads, consumer_thread] if t.is_alive()]
        result.stacks = thread_stacks([*threads, consumer_thread])
        with lock:
            to_close = list(opened)
        for conn in to_close:
            conn.release()
        if shared is not None:
            wait_until(lambda: not (set(drainer_threads()) - drainers_before), 10)
            result.drainers_after_release = len(set(drainer_threads()) - drainers_before)
        result.left_in_queue = {json.loads(body) for body in delete_queue(cluster, name)}
    return result
