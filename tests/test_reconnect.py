"""Many threads, one kombu connection, repeated faults: kombu's own retry paths.

A failure stays a failure for every thread that used the failed connection (kombu's
``collect()`` after an error must not turn it into ``ConnectionClosedIntentionally``),
concurrent reconnects converge on one live connection, and after ``release()`` nothing
is left running.
"""

from __future__ import annotations

import random
import sys
import threading
import traceback
from collections import Counter
from typing import Any

import kombu
import psutil
import pytest
from support.broker import JOIN, drainer_threads, unique_name, wait_until

from drainer_amqp import ConnectionClosedIntentionally

THREADS = 8
FAULTS = 6
RETRY_POLICY = {
    "max_retries": 30,
    "interval_start": 0.05,
    "interval_step": 0.1,
    "interval_max": 0.5,
}


def _stacks(threads: list[threading.Thread]) -> str:
    frames = sys._current_frames()
    return "\n".join(
        f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}"
        for t in threads
        if t.is_alive() and t.ident in frames
    )


def _sockets_to(port: int) -> list[Any]:
    return [
        c
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    ]


@pytest.mark.parametrize("api", ["publish_retry", "ensure", "autoretry"])
def test_eight_threads_one_connection_repeated_resets(proxied_broker: Any, api: str) -> None:
    queue = kombu.Queue(unique_name(), auto_delete=False)
    conn = kombu.Connection(
        proxied_broker.url,
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": True, "confirm_publish": True},
    )
    threads_before = set(drainer_threads())
    queue.bind(conn.default_channel).declare()
    stop = threading.Event()
    confirmed: list[str] = []
    raised: Counter[str] = Counter()
    lock = threading.Lock()  # guards confirmed and raised

    def publisher(n: int) -> None:
        # A producer on a channel of its own, for autoretry; the others use the default
        # channel, where kombu's retry revives them (see the failover test below).
        producer = kombu.Producer(conn.channel() if api == "autoretry" else conn)
        publish: Any = producer.publish
        if api == "ensure":
            publish = conn.ensure(producer, producer.publish, **RETRY_POLICY)
        elif api == "autoretry":

            def send(body: str, routing_key: str, channel: Any = None) -> None:
                kombu.Producer(channel).publish(body, routing_key=routing_key)

            # autoretry hands the function a revived channel after each reconnect.
            publish = conn.autoretry(send, channel=producer.channel, **RETRY_POLICY)
        i = 0
        while not stop.is_set():
            body = f"{n}-{i}"
            i += 1
            try:
                if api == "publish_retry":
                    publish(body, routing_key=queue.name, retry=True, retry_policy=RETRY_POLICY)
                else:
                    publish(body, routing_key=queue.name)
            except Exception as exc:  # noqa: BLE001 - counted by type, asserted below
                with lock:
                    raised[type(exc).__name__] += 1
                continue
            with lock:
                confirmed.append(body)

    workers = [
        threading.Thread(target=publisher, args=(n,), name=f"publisher-{n}") for n in range(THREADS)
    ]
    rng = random.Random(11)

    def progressed() -> bool:
        start = len(confirmed)
        return wait_until(lambda: len(confirmed) > start + 20, 30)

    try:
        for w in workers:
            w.start()
        for i in range(FAULTS):
            assert progressed(), f"no progress; raised so far: {raised}"
            if i % 2:
                proxied_broker.proxy.disable()
                threading.Event().wait(rng.uniform(0.05, 0.3))
                proxied_broker.proxy.enable()
            else:
                proxied_broker.proxy.add_toxic(
                    name="reset", type="reset_peer", attributes={"timeout": 0}
                )
                threading.Event().wait(0.05)
                proxied_broker.proxy.destroy_toxic("reset")
        assert progressed(), f"no progress; raised so far: {raised}"
    finally:
        stop.set()
        for w in workers:
            w.join(JOIN)
    assert not any(w.is_alive() for w in workers), "a publisher hung"
    assert "ConnectionClosedIntentionally" not in raised, raised
    # Every confirmed message is in the queue (more may be: at-least-once).
    with kombu.Connection("amqp://guest:guest@127.0.0.1:5672//") as direct:
        channel = direct.channel()
        got: set[str] = set()
        while (message := channel.basic_get(queue.name, no_ack=True)) is not None:
            got.add(message.body.decode() if isinstance(message.body, bytes) else message.body)
        channel.queue_delete(queue.name)
    got = {g.strip('"') for g in got}
    lost = set(confirmed) - got
    assert not lost, f"{len(lost)} confirmed messages lost, e.g. {sorted(lost)[:5]}"
    conn.release()
    assert wait_until(lambda: not (set(drainer_threads()) - threads_before), 5), (
        f"drainer threads left after release(): {set(drainer_threads()) - threads_before}"
    )
    assert wait_until(lambda: not _sockets_to(proxied_broker.port), 5), (
        f"sockets to the broker left after release(): {_sockets_to(proxied_broker.port)}"
    )


def test_release_is_intentional_for_every_thread(proxied_broker: Any) -> None:
    """After the user's release(), threads still on the connection are told it was closed
    on purpose, so kombu does not reconnect for them."""
    conn = kombu.Connection(
        proxied_broker.url,
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": True},
    )
    channel = conn.channel()
    name = channel.queue_declare(queue="", exclusive=True).queue
    channel.basic_consume(name, callback=lambda m: None)
    outcome: list[BaseException] = []

    def drain() -> None:
        try:
            conn.connection.drain_events(timeout=30)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome.append(exc)

    t = threading.Thread(target=drain, name="drainer-user")
    t.start()
    assert wait_until(lambda: conn.connection.drainer_stats()["running"], 5)
    conn.release()
    t.join(JOIN)
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ConnectionClosedIntentionally), outcome


def test_failover_to_the_next_url_keeps_every_thread_retrying(toxiproxy: Any) -> None:
    """kombu's failover (``Connection.switch()``) closes the failed connection; threads
    still on it must get a recoverable error and follow to the next URL, not be told the
    connection was closed on purpose."""
    proxies = []
    for _ in range(2):
        proxy = toxiproxy.create(
            upstream="127.0.0.1:5672", name=unique_name("failover"), listen="127.0.0.1:0"
        )
        proxies.append(proxy)
    ports = [int(p.listen.rsplit(":", 1)[1]) for p in proxies]
    # The scheme names the transport: kombu's switch() takes it from the next URL.
    urls = ";".join(f"drainer-amqp://guest:guest@127.0.0.1:{port}//" for port in ports)
    queue = kombu.Queue(unique_name(), auto_delete=False)
    conn = kombu.Connection(
        urls,
        transport_options={"dedicated_drainer": True, "confirm_publish": True},
    )
    threads_before = set(drainer_threads())
    queue.bind(conn.default_channel).declare()
    stop = threading.Event()
    confirmed: list[str] = []
    raised: Counter[str] = Counter()
    first: dict[str, str] = {}  # the first traceback of each type raised
    lock = threading.Lock()  # guards confirmed and raised

    def publisher(n: int) -> None:
        # kombu's retry revives a producer on the connection's default channel; one made
        # on a channel of its own loses it to another thread's collect() (channel.connection
        # becomes None and Producer.connection raises AttributeError), as with stock kombu.
        producer = kombu.Producer(conn)
        i = 0
        while not stop.is_set():
            body = f"{n}-{i}"
            i += 1
            try:
                producer.publish(
                    body, routing_key=queue.name, retry=True, retry_policy=RETRY_POLICY
                )
            except Exception as exc:  # noqa: BLE001 - counted by type, asserted below
                with lock:
                    if not raised[type(exc).__name__]:
                        first[type(exc).__name__] = "".join(traceback.format_exception(exc))
                    raised[type(exc).__name__] += 1
                continue
            with lock:
                confirmed.append(body)

    def progressed() -> bool:
        start = len(confirmed)
        return wait_until(lambda: len(confirmed) > start + 20, 30)

    workers = [
        threading.Thread(target=publisher, args=(n,), name=f"publisher-{n}") for n in range(THREADS)
    ]
    try:
        for w in workers:
            w.start()
        assert progressed(), f"no progress; raised so far: {raised}"
        for down, up in ((0, 1), (1, 0)):
            proxies[up].enable()
            proxies[down].disable()  # closes the live link and refuses new ones
            assert progressed(), f"no progress after losing {ports[down]}; raised: {raised} {first}"
    finally:
        stop.set()
        for w in workers:
            w.join(JOIN)
    assert not any(w.is_alive() for w in workers), f"a publisher hung: {_stacks(workers)}"
    assert "ConnectionClosedIntentionally" not in raised, raised
    with kombu.Connection("amqp://guest:guest@127.0.0.1:5672//") as direct:
        channel = direct.channel()
        got: set[str] = set()
        while (message := channel.basic_get(queue.name, no_ack=True)) is not None:
            body = message.body.decode() if isinstance(message.body, bytes) else message.body
            got.add(body.strip('"'))
        channel.queue_delete(queue.name)
    lost = set(confirmed) - got
    assert not lost, f"{len(lost)} confirmed messages lost, e.g. {sorted(lost)[:5]}"
    conn.release()
    assert wait_until(lambda: not (set(drainer_threads()) - threads_before), 5), (
        f"drainer threads left after release(): {set(drainer_threads()) - threads_before}"
    )
    assert wait_until(lambda: not any(_sockets_to(port) for port in ports), 5), [
        _sockets_to(port) for port in ports
    ]


def test_a_reconnect_racing_another_threads_collect_is_recoverable() -> None:
    """Thread A is inside kombu's reconnect with ``conn.transport`` when thread B's
    ``ensure()`` calls ``conn.collect()``, which detaches that transport. A's reconnect
    raises an error kombu's retry loop retries (with a fresh transport), not an
    AttributeError that reaches the caller."""
    conn = kombu.Connection(
        "amqp://guest:guest@127.0.0.1:5672//",
        transport="drainer_amqp:Transport",
        transport_options={"dedicated_drainer": True},
    )
    try:
        conn.ensure_connection(max_retries=3)
        transport = conn.transport  # thread A, inside kombu's _establish_connection
        conn.collect()  # thread B
        with pytest.raises(tuple(conn.recoverable_connection_errors)):
            transport.establish_connection()
        conn.ensure_connection(max_retries=3)  # kombu's retry: a fresh transport connects
        assert conn.connected
    finally:
        conn.release()
