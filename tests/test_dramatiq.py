"""dramatiq through ``dramatiq-kombu-broker``'s ``ConnectionPooledKombuBroker`` with
``transport="drainer_amqp:Transport"``: a real ``Worker`` whose worker threads publish
(``send`` from inside an actor, pipelines) and consume through drainer connections, in
both modes; every message processed exactly once, a clean shutdown; and a publish to a
queue deleted behind the broker's back handled as with stock py-amqp (a returned
mandatory publish raises 312 NO_ROUTE, the broker re-declares and publishes again).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import kombu
import pytest
from amqp.exceptions import ChannelError
from dramatiq.worker import ConsumerThread, WorkerThread
from support.broker import BROKER_HOST, drainer_threads, sockets_to, unique_name

from drainer_amqp.connection import _connections

with warnings.catch_warnings():  # its use of a name dramatiq 2 deprecates
    warnings.simplefilter("ignore", DeprecationWarning)
    from dramatiq_kombu_broker import ConnectionPooledKombuBroker, ConnectionSharedKombuBroker

PORT = int(BROKER_HOST.rpartition(":")[2])
ROOTS = 40  # root messages sent by the test, each sending CHILDREN from its actor
CHILDREN = 20
PIPELINES = 40  # started from inside an actor, each with STAGES stages
STAGES = 3
WORKER_THREADS = 8
EXPECTED = ROOTS * (1 + CHILDREN) + PIPELINES * (1 + STAGES)
DONE_TIMEOUT = 120.0  # generous: 2 shared cores, the broker takes one


def make_broker(transport: str, options: dict[str, Any]) -> ConnectionPooledKombuBroker:
    """The recipe of docs/dramatiq.md, with a unique default queue."""
    return ConnectionPooledKombuBroker(
        kombu_connection_options={
            "hostname": f"amqp://guest:guest@{BROKER_HOST}//",
            "transport": transport,  # type: ignore[typeddict-unknown-key]
            "transport_options": options,  # type: ignore[typeddict-item]
        },
        default_queue_name=unique_name("dramatiq"),
    )


class Recorder(dramatiq.Middleware):
    """Counts each processed message by its id; sets ``done`` at ``expected``. Called in
    worker threads; ``_lock`` guards ``ids`` and ``failures``."""

    def __init__(self, expected: int) -> None:
        self._lock = threading.Lock()
        self.expected = expected
        self.ids: Counter[str] = Counter()
        self.failures: list[BaseException] = []
        self.done = threading.Event()

    def after_process_message(
        self,
        broker: dramatiq.Broker,
        message: dramatiq.MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        with self._lock:
            if exception is not None:
                self.failures.append(exception)
                self.done.set()
                return
            self.ids[message.message_id] += 1
            if self.ids.total() >= self.expected:
                self.done.set()

    def after_skip_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy) -> None:
        with self._lock:
            self.failures.append(RuntimeError(f"skipped {message}"))
        self.done.set()


@pytest.fixture
def clean_process() -> Iterator[None]:
    """After the test: no dramatiq thread, drainer thread, socket to the broker, or open
    drainer connection left behind by it."""
    threads_before = set(threading.enumerate())
    sockets_before = len(sockets_to(PORT))
    connections_before = set(_connections)
    yield
    dramatiq_threads = [
        t
        for t in set(threading.enumerate()) - threads_before
        if isinstance(t, (WorkerThread, ConsumerThread))
    ]
    assert not dramatiq_threads, f"dramatiq threads left: {dramatiq_threads}"
    assert not set(drainer_threads()) - threads_before, "drainer threads left"
    opened = set(_connections) - connections_before
    assert all(c.reason is not None for c in opened), "drainer connections left open"
    assert len(sockets_to(PORT)) <= sockets_before, "sockets to the broker left"


@pytest.mark.parametrize("dedicated_drainer", [True, False], ids=["drainer", "legacy"])
def test_worker_threads_publish_and_consume_every_message_once(
    dedicated_drainer: bool, clean_process: None
) -> None:
    broker = make_broker("drainer_amqp:Transport", {"dedicated_drainer": dedicated_drainer})
    recorder = Recorder(EXPECTED)
    broker.add_middleware(recorder)
    queue = unique_name("dramatiq")
    payload_lock = threading.Lock()  # guards payloads; taken by the actors (worker threads)
    payloads: Counter[tuple[Any, ...]] = Counter()

    def record(*key: Any) -> None:
        with payload_lock:
            payloads[key] += 1

    def declare(fn: Callable[..., None], name: str) -> Any:
        name = f"{queue}-{name}"
        return dramatiq.actor(actor_name=name, broker=broker, queue_name=queue, max_retries=0)(fn)

    def child(i: int, j: int) -> None:
        record("child", i, j)

    def root(i: int) -> None:
        record("root", i)
        for j in range(CHILDREN):
            child_actor.send(i, j)

    def stage(k: int, n: int) -> None:
        record("stage", k, n)

    def start_pipeline(k: int) -> None:
        record("pipeline", k)
        messages = [stage_actor.message_with_options(args=(k, n)) for n in range(STAGES)]
        for message in messages[1:]:
            message.options["pipe_ignore"] = True
        dramatiq.pipeline(messages, broker=broker).run()

    child_actor = declare(child, "child")
    root_actor = declare(root, "root")
    stage_actor = declare(stage, "stage")
    pipeline_actor = declare(start_pipeline, "pipeline")

    worker = dramatiq.Worker(broker, worker_threads=WORKER_THREADS, worker_timeout=100)
    connections_before = set(_connections)
    readers_before = set(drainer_threads())
    started = time.monotonic()
    try:
        worker.start()
        for i in range(ROOTS):
            root_actor.send(i)
        for k in range(PIPELINES):
            pipeline_actor.send(k)
        assert recorder.done.wait(DONE_TIMEOUT), (
            f"{recorder.ids.total()} of {EXPECTED} processed in {DONE_TIMEOUT}s"
        )
        elapsed = time.monotonic() - started
        readers = len(set(drainer_threads()) - readers_before)
    finally:
        worker.stop(timeout=30_000)
        try:
            leftover = broker.get_queue_message_counts(queue)
            used = set(_connections) - connections_before
            sent = sum(int(c.drainer_stats()["messages_sent"]) for c in used)
        finally:
            broker.delete_all(include_pending=True)
            broker.close()

    assert not recorder.failures, recorder.failures
    assert recorder.ids.total() == EXPECTED
    assert set(recorder.ids.values()) == {1}, "a message was processed twice"
    expected_payloads = (
        [("root", i) for i in range(ROOTS)]
        + [("child", i, j) for i in range(ROOTS) for j in range(CHILDREN)]
        + [("pipeline", k) for k in range(PIPELINES)]
        + [("stage", k, n) for k in range(PIPELINES) for n in range(STAGES)]
    )
    assert payloads == Counter(expected_payloads)
    assert leftover == (0, 0, 0), "messages left (or unacked and requeued) after the run"
    assert sent == EXPECTED, "every message published once, through drainer connections"
    assert all(c.dedicated_drainer is dedicated_drainer for c in used)
    assert bool(readers) is dedicated_drainer
    mode = "drainer" if dedicated_drainer else "legacy"
    print(
        f"\ndramatiq {mode}: {EXPECTED} messages, {WORKER_THREADS} worker threads, "
        f"{len(used)} connections, {elapsed:.2f}s"
    )


def _record_enqueue_errors(broker: ConnectionPooledKombuBroker) -> list[BaseException | None]:
    """Wrap the broker's one publish so the test sees each attempt's outcome."""
    outcomes: list[BaseException | None] = []
    publish: Callable[..., Any] = broker._enqueue_message

    def recorded(*args: Any, **kwargs: Any) -> Any:
        try:
            result = publish(*args, **kwargs)
        except BaseException as exc:
            outcomes.append(exc)
            raise
        outcomes.append(None)
        return result

    broker._enqueue_message = recorded  # type: ignore[method-assign]
    return outcomes


@pytest.mark.parametrize(
    ("transport", "options"),
    [
        ("pyamqp", {}),
        ("drainer_amqp:Transport", {"dedicated_drainer": True}),
        ("drainer_amqp:Transport", {"dedicated_drainer": False}),
    ],
    ids=["stock", "drainer", "legacy"],
)
def test_publish_to_a_deleted_queue_redeclares_it_as_with_stock(
    transport: str, options: dict[str, Any], clean_process: None
) -> None:
    broker = make_broker(transport, options)
    queue = unique_name("dramatiq")
    actor = dramatiq.actor(actor_name=queue, broker=broker, queue_name=queue)(lambda: None)
    try:
        actor.send()  # declares the queues, then publishes
        with kombu.Connection(f"amqp://guest:guest@{BROKER_HOST}//") as admin:
            admin.default_channel.queue_delete(queue)  # the broker still thinks it exists
        outcomes = _record_enqueue_errors(broker)
        actor.send()
        counts = broker.get_queue_message_counts(queue)
    finally:
        broker.delete_all(include_pending=True)
        broker.close()
    first, second = outcomes
    assert isinstance(first, ChannelError) and first.reply_code == 312, first
    assert second is None
    assert counts == (1, 0, 0)  # the first message went with the deleted queue


def test_the_shared_broker_refuses_our_transport() -> None:
    """``ConnectionSharedKombuBroker`` swaps in kombu-pyamqp-threadsafe's own transport and
    refuses any other (docs/dramatiq.md): use the pooled broker."""
    with pytest.raises(RuntimeError, match="Unsupported transport"):
        broker = ConnectionSharedKombuBroker(
            kombu_connection_options={
                "hostname": f"amqp://guest:guest@{BROKER_HOST}//",
                "transport": "drainer_amqp:Transport",  # type: ignore[typeddict-unknown-key]
            }
        )
        broker.close()
