"""The soak's user threads, written as a kombu user would write them.

* :class:`Publisher`: a confirmed publish of a unique id at a steady rate, in one of
  kombu's retry styles: ``Producer(conn).publish(retry=True)``, ``conn.ensure(producer,
  producer.publish)`` on a channel of its own, or ``conn.autoretry``.
* :class:`Consumer`: a channel and a ``kombu.Consumer`` of its own (manual ack),
  draining the shared connection; after an error it reconnects as ``ConsumerMixin``
  does (``ensure_connection``) and consumes again. A consumer whose connection was
  replaced by another thread's reconnect subscribes again on the new one.
* :class:`Declarer`: ``queue_declare``/``queue_delete`` of its own exclusive temporary
  queues on a channel of its own.

Threading contract: each worker is one named daemon thread, owned by the run that
starts it. Workers share one ``kombu.Connection``; in the ``stock`` mode every call on it
is made under the run's one ``RLock`` (``Shared.guard``), as a user of stock kombu would
have to. Every worker checks ``Shared.stop`` at least once a second (a drain's timeout,
a retry policy's interval) and returns soon after it is set; :meth:`Worker.join` is
bounded.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kombu
from kombu.exceptions import OperationalError

from .ledger import Ledger, Progress, Raised

__all__ = ["Consumer", "Declarer", "Publisher", "Shared", "Worker", "recoverable_errors"]

#: kombu's retry policy for publishes and reconnects: about 30 s of retries at most.
RETRY_POLICY: dict[str, Any] = {
    "max_retries": 60,
    "interval_start": 0.05,
    "interval_step": 0.1,
    "interval_max": 0.5,
}
PREFETCH = 50
DRAIN_TIMEOUT = 1.0  # ConsumerMixin's safety interval
PUBLISH_STYLES = ("retry", "ensure", "autoretry")


def recoverable_errors(conn: kombu.Connection) -> tuple[type[BaseException], ...]:
    """What a kombu user's code is told to expect and retry on this connection."""
    return (
        tuple(conn.recoverable_connection_errors)
        + tuple(conn.recoverable_channel_errors)
        + tuple(conn.connection_errors)
        + tuple(conn.channel_errors)
        + (OperationalError,)  # kombu's wrapper once a retry policy gives up
    )


@dataclass
class Shared:
    """What every worker of one run shares."""

    conn: kombu.Connection
    ledger: Ledger
    progress: Progress
    raised: Raised
    queues: list[str]
    rate: float  # publishes per second per publisher; 0 for as fast as it goes
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.RLock | None = None  # stock mode: every call on conn under it

    def guard(self) -> contextlib.AbstractContextManager[Any]:
        return self.lock if self.lock is not None else contextlib.nullcontext()


class Worker:
    """One named thread looping :meth:`step` until ``shared.stop``; an exception out of
    a step is recorded under the worker's role and followed by :meth:`recover`."""

    role = "worker"

    def __init__(self, shared: Shared, name: str) -> None:
        self.shared = shared
        self.name = name
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.expected = recoverable_errors(shared.conn)
        shared.progress.register(name)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def beat(self) -> None:
        self.shared.progress.beat(self.name)

    def _main(self) -> None:
        stop = self.shared.stop
        while not stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - counted by type in the result
                self.shared.raised.add(self.role, exc, isinstance(exc, self.expected))
                if stop.wait(0.05):
                    return
                self.recover()

    def step(self) -> None:
        raise NotImplementedError

    def recover(self) -> None:
        """After an error: reconnect as ``ConsumerMixin`` does (``ensure_connection``)."""
        shared = self.shared
        try:
            with shared.guard():
                shared.conn.ensure_connection(
                    max_retries=RETRY_POLICY["max_retries"],
                    interval_start=RETRY_POLICY["interval_start"],
                    interval_step=RETRY_POLICY["interval_step"],
                    interval_max=RETRY_POLICY["interval_max"],
                )
        except Exception as exc:  # noqa: BLE001 - counted; the next step tries again
            shared.raised.add(f"{self.role}-reconnect", exc, isinstance(exc, self.expected))


class Publisher(Worker):
    """Publishes ``{"id": ...}`` with a confirm, one at a time, at ``shared.rate``."""

    role = "publish"

    def __init__(self, shared: Shared, index: int, style: str) -> None:
        super().__init__(shared, f"soak-publisher-{index}-{style}")
        self.index = index
        self.style = style
        self.queue = shared.queues[index % len(shared.queues)]
        self._publish: Callable[[dict[str, str]], None] | None = None
        self._interval = 1.0 / shared.rate if shared.rate > 0 else 0.0

    def _make(self) -> Callable[[dict[str, str]], None]:
        conn, queue = self.shared.conn, self.queue
        if self.style == "retry":
            producer = kombu.Producer(conn)
            return lambda body: producer.publish(
                body, routing_key=queue, retry=True, retry_policy=RETRY_POLICY
            )
        if self.style == "ensure":
            own = kombu.Producer(conn.channel())
            ensured = conn.ensure(own, own.publish, **RETRY_POLICY)
            return lambda body: ensured(body, routing_key=queue)

        def send(body: dict[str, str], channel: Any = None) -> None:
            kombu.Producer(channel).publish(body, routing_key=queue)

        retried = conn.autoretry(send, channel=conn.channel(), **RETRY_POLICY)
        return lambda body: retried(body)

    def step(self) -> None:
        shared = self.shared
        if self._interval and shared.stop.wait(self._interval):
            return
        if self._publish is None:
            try:
                with shared.guard():
                    self._publish = self._make()
            except Exception as exc:  # noqa: BLE001 - counted; no message was involved
                shared.raised.add("publish-setup", exc, isinstance(exc, self.expected))
                shared.stop.wait(0.1)
                return
        message_id = shared.ledger.new_id(self.index)
        try:
            with shared.guard():
                self._publish({"id": message_id})
        except Exception:
            shared.ledger.raised(message_id)
            self._publish = None  # as a user would: a fresh producer for the next one
            raise
        shared.ledger.confirmed(message_id)
        self.beat()

    def recover(self) -> None:
        pass  # the retry policy reconnected, or gave up: the next publish tries again


class Consumer(Worker):
    """Consumes its queue with manual acks, draining the shared connection; every
    delivery it runs (its own or another consumer's) counts its id as consumed."""

    role = "consume"

    def __init__(self, shared: Shared, index: int) -> None:
        super().__init__(shared, f"soak-consumer-{index}")
        self.queue = kombu.Queue(
            shared.queues[index % len(shared.queues)], durable=False, auto_delete=False
        )

    def on_message(self, body: Any, message: Any) -> None:
        self.shared.ledger.consumed(body.get("id") if isinstance(body, dict) else None)
        message.ack()

    def step(self) -> None:
        shared = self.shared
        conn = shared.conn
        with shared.guard():
            owner = conn.connection
            channel = conn.channel()
            channel.basic_qos(0, PREFETCH, False)
            consumer = kombu.Consumer(
                channel, queues=[self.queue], callbacks=[self.on_message], accept=["json"]
            )
            consumer.consume()
        self.beat()
        while not shared.stop.is_set():
            with shared.guard():
                if conn.connection is not owner:
                    return  # another thread reconnected: subscribe on the new connection
                try:
                    conn.drain_events(timeout=DRAIN_TIMEOUT)
                except TimeoutError:
                    conn.heartbeat_check()
            self.beat()


class Declarer(Worker):
    """Declares and deletes exclusive temporary queues on a channel of its own (the
    broker deletes one left behind by a failure with its connection)."""

    role = "declare"

    def __init__(self, shared: Shared, index: int = 0) -> None:
        super().__init__(shared, f"soak-declarer-{index}")
        self._prefix = f"soak-tmp-{uuid.uuid4().hex[:8]}"

    def step(self) -> None:
        shared = self.shared
        conn = shared.conn
        with shared.guard():
            owner = conn.connection
            channel = conn.channel()
        n = 0
        while not shared.stop.wait(0.05):
            name = f"{self._prefix}-{n}"
            n += 1
            with shared.guard():
                if conn.connection is not owner:
                    return
                channel.queue_declare(queue=name, exclusive=True, auto_delete=False)
                channel.queue_delete(queue=name)
            self.beat()
