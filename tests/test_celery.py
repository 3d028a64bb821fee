"""Celery in real use with ``broker_transport="drainer_amqp:Transport"`` and
``broker_transport_options={"dedicated_drainer": True}``: settings only, real worker
subprocesses (prefork and threads pools), producers from many threads through Celery's
connection pool, broker-link kill through the proxy, broker-side close of a pooled
connection.

The worker runs ``celery -A celery_app.app worker`` (``tests/celery_app``) with its result
backend ``rpc://``: results travel back over AMQP, so they too go through the drainer
transport (worker side: the result producers; test side: the result consumers).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import billiard.pool
import kombu
import kombu.pools
import pytest
from amqp.exceptions import ChannelError
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery_app import build_app
from kombu.utils.collections import eqhash
from support.broker import (
    broker_connection_names,
    close_broker_connections,
    drainer_threads,
    unique_name,
    wait_until,
)

import drainer_amqp
from drainer_amqp.connection import DRAINER_HEARTBEAT

TESTS_DIR = Path(__file__).resolve().parent
DRAINER_OPTIONS = {"dedicated_drainer": True}
RESULT_TIMEOUT = 60.0  # generous: 2 cores, the broker takes one
SHUTDOWN_TIMEOUT = 20.0
#: What a prefork pool's warm shutdown may add: a child that ran its last task waits,
#: before it exits, until the parent has counted that task's result (billiard's
#: ``_ensure_messages_consumed``, up to 30 s). Seen about once in a hundred runs under
#: load: the parent in its pool's ``join()``, the child in that wait, this library's
#: threads idle.
CHILD_EXIT_WAIT = getattr(billiard.pool, "GUARANTEE_MESSAGE_CONSUMPTION_RETRY_LIMIT", 0) * getattr(
    billiard.pool, "GUARANTEE_MESSAGE_CONSUMPTION_RETRY_INTERVAL", 0.0
)
#: The Hub's thread reads the socket itself from kombu 5.7, whose Hub wakes for
#: callbacks other threads schedule (drainer_amqp.transport).
HUB_READS = tuple(kombu.VERSION[:2]) >= (5, 7)


# -- helpers ---------------------------------------------------------------------------------
def _local_port(conn: drainer_amqp.Connection) -> int:
    return int(conn.sock.getsockname()[1])


def _run_threads(target: Callable[[int], Any], count: int, timeout: float) -> list[Any]:
    """Run ``target(i)`` in ``count`` threads; join each with a timeout; re-raise errors."""
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = target(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"producer-{i}") for i in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads still running after {timeout}s: {alive}"
    if errors:
        raise errors[0]
    return results


def _close_app(app: Celery) -> None:
    """Close every broker connection ``app`` opened through kombu's global pools.

    ``Celery.close()`` closes none: the producer and connection pools live in
    ``kombu.pools``, keyed by the connection's settings, so also drop them from there
    (a later app with the same settings would otherwise get a closed pool)."""
    conn = app.connection_for_write()
    key = eqhash(conn)
    for group in (kombu.pools.producers, kombu.pools.connections):
        pool = dict.get(group, key)
        if pool is not None:
            pool.force_close_all()
            dict.pop(group, key, None)
    _stop_result_consumer(app)  # this thread's; other threads stop their own
    app._pool = None
    with suppress(AttributeError):
        app.amqp._producer_pool = None
    app.close()


def _stop_result_consumer(app: Celery) -> None:
    """Stop this thread's rpc:// result consumer (its connection) if it was started."""
    backend = app._local.__dict__.get("backend")
    consumer = getattr(backend, "result_consumer", None)
    if consumer is not None and consumer._consumer is not None:
        try:
            consumer.stop()
        finally:
            consumer._consumer = consumer._connection = None


def _queue_depth(broker_url: str, queue: str) -> int:
    with drainer_amqp.Connection(host=_hostport(broker_url), dedicated_drainer=True) as conn:
        channel = conn.channel()
        _, count, _ = channel.queue_declare(queue, passive=True)
        return int(count)


def _hostport(url: str) -> str:
    return kombu.Connection(url).host


def _delete_broker_objects(
    broker_url: str, queues: list[str], exchanges: list[str] | None = None
) -> None:
    with drainer_amqp.Connection(host=_hostport(broker_url), dedicated_drainer=True) as conn:
        channel = conn.channel()
        for queue in queues:
            try:
                channel.queue_delete(queue)
            except ChannelError:  # already gone (auto-delete) on brokers that say so
                channel = conn.channel()
        for exchange in exchanges or []:
            try:
                channel.exchange_delete(exchange)
            except ChannelError:
                channel = conn.channel()


def _consume_task_ids(broker_url: str, queue: str, expected: int, timeout: float) -> list[str]:
    """Consume (and ack) Celery task messages from ``queue`` until ``expected`` arrived,
    then for one more short while to catch extras; return their task ids."""
    ids: list[str] = []

    def on_message(body: Any, message: Any) -> None:
        ids.append(message.headers["id"])
        message.ack()

    with kombu.Connection(
        broker_url, transport="drainer_amqp:Transport", transport_options=DRAINER_OPTIONS
    ) as conn:
        consumer = kombu.Consumer(
            conn, [kombu.Queue(queue, no_declare=True)], callbacks=[on_message], accept=["json"]
        )
        with consumer:
            deadline = time.monotonic() + timeout
            while len(ids) < expected and time.monotonic() < deadline:
                with suppress(TimeoutError):
                    conn.drain_events(timeout=0.5)
            # nothing more may come: drain until the queue has been quiet for a moment
            with suppress(TimeoutError):
                while len(ids) <= expected * 2:
                    conn.drain_events(timeout=0.5)
    return ids


def _process_group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (Linux ``/proc``)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rindex(")") + 2 :].split()[2]) == pgid:
                    members.append(int(entry.name))
    return members


class Worker:
    """A ``celery worker`` subprocess; output in ``log_path``, probe lines in ``probe_path``."""

    def __init__(self, tmp_path: Path, broker_url: str, queue: str, pool_args: list[str]) -> None:
        self.log_path = tmp_path / "worker.log"
        self.probe_path = tmp_path / "probe.jsonl"
        env = dict(os.environ)
        env.update(
            DRAINER_TEST_BROKER_URL=broker_url,
            DRAINER_TEST_QUEUE=queue,
            DRAINER_TEST_BACKEND="rpc://",
            DRAINER_TEST_PROBE=str(self.probe_path),
            PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")])),
        )
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "celery_app.app",
            "worker",
            *pool_args,
            "-Q",
            queue,
            "-n",
            f"{queue}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "info",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=TESTS_DIR,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: pool children die with it
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def probes(self) -> list[dict[str, Any]]:
        if not self.probe_path.exists():
            return []
        lines = self.probe_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def wait_for_log(self, text: str, timeout: float) -> bool:
        return wait_until(lambda: text in self.log() or self.proc.poll() is not None, timeout) and (
            text in self.log()
        )

    def terminate(self, timeout: float) -> tuple[int | None, float]:
        """SIGTERM (Celery's warm shutdown); return (exit code or None, seconds taken)."""
        start = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
            self.dump_stacks()
        return code, time.perf_counter() - start

    def dump_stacks(self) -> None:
        """Have every process of the worker write each thread's stack to the log (the
        app's SIGUSR2 handler, which the pool's children inherit), for the log of a
        worker that did not stop in time."""
        for pid in _process_group(self.proc.pid):  # one at a time: their dumps interleave
            done = self.log().count("Current thread") + 1  # once per process dump
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2)
            wait_until(lambda: self.log().count("Current thread") >= done, 2.0)  # noqa: B023

    def kill(self) -> None:
        if self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this test started
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)


@contextmanager
def running_worker(
    tmp_path: Path, broker_url: str, queue: str, pool_args: list[str]
) -> Iterator[Worker]:
    worker = Worker(tmp_path, broker_url, queue, pool_args)
    ok = False
    try:
        yield worker
        ok = True
    finally:
        worker.kill()
        if not ok:
            print(f"---- worker log ({worker.log_path}) ----\n{worker.log()}")


@contextmanager
def celery_app(broker_url: str, queue: str, **kwargs: Any) -> Iterator[Celery]:
    app = build_app(broker_url, queue, **kwargs)
    try:
        yield app
    finally:
        _close_app(app)


def _markers(markers_dir: Path) -> dict[str, list[str]]:
    return {
        p.name: p.read_text().split()
        for p in markers_dir.iterdir()
        if not p.name.endswith(".started")
    }


def _publish_and_collect(
    app: Celery, markers_dir: Path, tokens: list[str], reply_queues: list[str]
) -> list[dict[str, Any]]:
    """In the calling thread: ``apply_async`` a ``record`` per token, then ``get()`` them."""
    record = app.tasks["drainer_test.record"]
    try:
        reply_queues.append(app.thread_oid)
        pending = [record.apply_async((token, str(markers_dir))) for token in tokens]
        results = []
        for token, result in zip(tokens, pending, strict=True):
            try:
                results.append(result.get(timeout=RESULT_TIMEOUT))
            except CeleryTimeoutError:
                # Say which half was lost: the task (it never ran) or its result.
                ran = (markers_dir / token).exists()
                raise AssertionError(
                    f"no result for {token} (task {result.id}) in {RESULT_TIMEOUT:g}s: "
                    f"the task {'ran' if ran else 'never ran'}; "
                    f"{len(results)} of this thread's {len(tokens)} results came"
                ) from None
        return results
    finally:
        _stop_result_consumer(app)


# -- 1. settings alone ------------------------------------------------------------------------
def test_settings_alone_give_drainer_connections(broker_url: str, no_leaks: None) -> None:
    queue = unique_name("drainer-celery-settings")
    threads_before = set(drainer_threads())
    with celery_app(broker_url, queue) as app:
        assert app.conf.broker_transport == "drainer_amqp:Transport"
        for factory in (app.connection_for_write, app.connection_for_read):
            with factory() as conn:
                conn.ensure_connection(max_retries=1)
                assert isinstance(conn.connection, drainer_amqp.Connection)
                assert conn.connection.drainer_stats()["running"] is True
                drainer = set(drainer_threads()) - threads_before
                assert len(drainer) == 1, drainer
            assert wait_until(lambda: not (set(drainer_threads()) - threads_before), 5)
        # the connections apply_async uses: Celery's producer pool
        with app.producer_or_acquire() as producer:
            pooled = producer.connection.connection
            assert isinstance(pooled, drainer_amqp.Connection)
            assert pooled.drainer_stats()["running"] is True

    # The option is what opts in: the same settings without it give legacy connections.
    with celery_app(broker_url, queue, transport_options={}) as legacy:
        with legacy.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
            assert isinstance(conn.connection, drainer_amqp.Connection)
            assert conn.connection.drainer_stats()["running"] is False
            assert not (set(drainer_threads()) - threads_before)


# -- 2. a real worker, prefork and threads ------------------------------------------------------
POOLS = {
    # --max-tasks-per-child: children are re-forked while the parent's consumer
    # connection (and its drainer thread) is live, which exercises the fork handling.
    "prefork": ["--pool=prefork", "--concurrency=2", "--max-tasks-per-child=10"],
    "threads": ["--pool=threads", "--concurrency=4"],
}


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_worker_runs_every_task_once_and_shuts_down_warm(
    pool: str, broker_url: str, tmp_path: Path, no_leaks: None
) -> None:
    queue = unique_name(f"drainer-celery-{pool}")
    markers_dir = tmp_path / "markers"
    markers_dir.mkdir()
    reply_queues: list[str] = []
    n_threads, per_thread = 5, 10
    tokens = [
        [f"t{i}-{j}-{uuid.uuid4().hex[:6]}" for j in range(per_thread)] for i in range(n_threads)
    ]
    try:
        with (
            running_worker(tmp_path, broker_url, queue, POOLS[pool]) as worker,
            celery_app(broker_url, queue, result_backend="rpc://") as app,
        ):
            results = _run_threads(
                lambda i: _publish_and_collect(app, markers_dir, tokens[i], reply_queues),
                n_threads,
                timeout=RESULT_TIMEOUT + 30,
            )
            flat = [r for per in results for r in per]
            all_tokens = sorted(t for per in tokens for t in per)
            assert sorted(r["token"] for r in flat) == all_tokens

            # Inside the worker: the consumer's connection is a drainer connection, and
            # kombu's Hub watches its inbox descriptor, and from kombu 5.7 its socket.
            probes = worker.probes()
            assert probes, worker.log()
            start = probes[0]
            assert start["event"] == "consumer_start" and start["pid"] == worker.pid
            assert start["connection_class"] == "drainer_amqp.connection.Connection"
            assert start["drainer_stats"]["running"] is True
            assert start["hub_watches_inbox"] is True
            assert start["hub_watches_socket"] is HUB_READS
            assert start["drainer_threads"]

            pids = {r["pid"] for r in flat}
            if pool == "threads":
                # tasks run in the worker's main process, next to its drainer threads
                assert pids == {worker.pid}
                assert all(r["drainer_threads"] for r in flat)
            else:
                # tasks run in children; each runs at most 10, so 50 needed >= 5 children,
                # forked while the parent's drainer connection was live
                assert worker.pid not in pids
                assert len(pids) >= len(flat) // 10
                # children publish their results through their own drainer connections
                assert any(r["drainer_threads"] for r in flat)

            # warm shutdown: a task in progress at SIGTERM completes, the worker exits 0
            reply_queues.append(app.thread_oid)
            slow = app.tasks["drainer_test.slow_record"].apply_async(
                ("slow", str(markers_dir), 2.0)
            )
            assert wait_until(lambda: (markers_dir / "slow.started").exists(), RESULT_TIMEOUT)
            bound = SHUTDOWN_TIMEOUT + (CHILD_EXIT_WAIT if pool == "prefork" else 0.0)
            code, took = worker.terminate(bound)
            assert code == 0, f"exit code {code} after {took:.1f}s\n{worker.log()}"
            assert "Warm shutdown" in worker.log()
            assert slow.get(timeout=10)["token"] == "slow"
            _stop_result_consumer(app)

            # The Hub's thread read deliveries itself (the drainer reads too, after an
            # idle spell of DEFER_FOR, or while a thread waits: tests/test_event_loop.py).
            shutdown = worker.probes()[-1]
            assert shutdown["event"] == "consumer_shutdown", worker.probes()
            loop_reads = shutdown["drainer_stats"]["loop_reads"]
            assert (loop_reads > 0) is HUB_READS, shutdown["drainer_stats"]

            # exactly once: one marker line per task, nothing left in the queue
            markers = _markers(markers_dir)
            assert sorted(markers) == sorted([*all_tokens, "slow"])
            assert {k: v for k, v in markers.items() if len(v) != 1} == {}
            assert _queue_depth(broker_url, queue) == 0
    finally:
        _delete_broker_objects(broker_url, [queue, *reply_queues], [queue])


def test_worker_keeps_consuming_a_long_stream(
    broker_url: str, tmp_path: Path, no_leaks: None
) -> None:
    """Thousands of deliveries, read by the Hub's thread or by the drainer and handed over
    through the inbox descriptor: the worker must never stop consuming with messages
    waiting (a lost wake-up would stall it for good)."""
    queue = unique_name("drainer-celery-stream")
    markers_dir = tmp_path / "markers"
    markers_dir.mkdir()
    n_threads, per_thread = 4, 500
    total = n_threads * per_thread
    try:
        with (
            running_worker(tmp_path, broker_url, queue, POOLS["threads"]) as worker,
            celery_app(broker_url, queue) as app,
        ):
            record = app.tasks["drainer_test.record"]

            def produce(i: int) -> None:
                for j in range(per_thread):
                    record.apply_async((f"s{i}-{j}", str(markers_dir)), ignore_result=True)

            _run_threads(produce, n_threads, timeout=120)
            done = 0
            while done < total:  # fail on a stall, not on a slow machine

                def more_done(done: int = done) -> bool:
                    return len(os.listdir(markers_dir)) > done

                progressed = wait_until(more_done, 15, interval=0.2)
                now = len(os.listdir(markers_dir))
                assert progressed, (
                    f"worker stopped consuming: {now}/{total} tasks ran, no progress for 15s, "
                    f"{_queue_depth(broker_url, queue)} messages ready on the broker"
                )
                done = now
            code, took = worker.terminate(SHUTDOWN_TIMEOUT)
            assert code == 0, f"exit code {code} after {took:.1f}s\n{worker.log()}"
            markers = _markers(markers_dir)
            assert len(markers) == total
            assert {k: v for k, v in markers.items() if len(v) != 1} == {}
    finally:
        _delete_broker_objects(broker_url, [queue], [queue])


# -- 3. broker link killed under the worker ----------------------------------------------------
def _unacked(queue: str) -> int:
    out = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "name", "messages_unacknowledged"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return sum(
        int(n)
        for name, _, n in (line.partition("\t") for line in out.splitlines())
        if name == queue
    )


def test_worker_reconnects_after_broker_link_is_killed(
    broker_url: str, proxied_broker: Any, tmp_path: Path, no_leaks: None
) -> None:
    queue = unique_name("drainer-celery-linkkill")
    markers_dir = tmp_path / "markers"
    markers_dir.mkdir()
    reply_queues: list[str] = []
    try:
        with (
            running_worker(tmp_path, proxied_broker.url, queue, POOLS["threads"]) as worker,
            celery_app(broker_url, queue, result_backend="rpc://") as app,
        ):
            record = app.tasks["drainer_test.record"]
            reply_queues.append(app.thread_oid)
            before = [record.apply_async((f"before-{i}", str(markers_dir))) for i in range(5)]
            assert [r.get(timeout=RESULT_TIMEOUT)["token"] for r in before] == [
                f"before-{i}" for i in range(5)
            ]
            first = worker.probes()
            assert len(first) == 1 and first[0]["drainer_stats"]["running"] is True
            # Their acks reach the broker before the link dies: kombu < 5.7's Hub sends an
            # ack from a pool thread only when its poll next returns (docs/versions.md),
            # and an unacked task is redelivered after the reconnect (at least once).
            assert wait_until(lambda: _unacked(queue) == 0, 30, interval=0.5)

            proxied_broker.proxy.disable()  # closes the worker's connections, refuses new ones
            assert worker.wait_for_log("Connection to broker lost", 30), worker.log()
            assert worker.wait_for_log("Cannot connect to", 30), worker.log()
            during = [record.apply_async((f"during-{i}", str(markers_dir))) for i in range(5)]
            proxied_broker.proxy.enable()

            after = [record.apply_async((f"after-{i}", str(markers_dir))) for i in range(5)]
            got = [r.get(timeout=RESULT_TIMEOUT)["token"] for r in during + after]
            assert got == [f"during-{i}" for i in range(5)] + [f"after-{i}" for i in range(5)]

            probes = worker.probes()
            assert len(probes) >= 2, probes
            again = probes[-1]
            assert again["event"] == "consumer_start"
            assert again["drainer_stats"]["running"] is True
            assert again["hub_watches_inbox"] is True
            assert again["local_port"] != first[0]["local_port"]

            code, took = worker.terminate(SHUTDOWN_TIMEOUT)
            assert code == 0, f"exit code {code} after {took:.1f}s\n{worker.log()}"
            _stop_result_consumer(app)
            markers = _markers(markers_dir)
            assert len(markers) == 15
            assert {k: v for k, v in markers.items() if len(v) != 1} == {}
    finally:
        _delete_broker_objects(broker_url, [queue, *reply_queues], [queue])


# -- 4. producers: many threads through Celery's pool -----------------------------------------
def test_apply_async_from_many_threads_through_the_pool(broker_url: str, no_leaks: None) -> None:
    queue = unique_name("drainer-celery-producers")
    n_threads, per_thread, limit = 20, 10, 4
    threads_before = set(drainer_threads())
    peak_drainers = 0
    try:
        with celery_app(
            broker_url,
            queue,
            transport_options={"dedicated_drainer": True, "confirm_publish": True},
            broker_pool_limit=limit,
        ) as app:
            add = app.tasks["drainer_test.add"]
            first_id = add.apply_async((0, 0)).id  # declares the queue
            seen: set[drainer_amqp.Connection] = set()
            seen_lock = threading.Lock()

            def produce(i: int) -> list[str]:
                nonlocal peak_drainers
                ids = []
                for j in range(per_thread):
                    ids.append(add.apply_async((i, j)).id)
                    with app.producer_or_acquire() as producer:
                        conn = producer.connection.connection
                        assert conn.confirm_publish is True
                        with seen_lock:
                            seen.add(conn)
                    with seen_lock:
                        peak_drainers = max(
                            peak_drainers, len(set(drainer_threads()) - threads_before)
                        )
                return ids

            ids = [i for per in _run_threads(produce, n_threads, timeout=120) for i in per]
            assert len(ids) == n_threads * per_thread
            assert len(seen) <= limit, seen
            assert peak_drainers <= limit
            # confirmed: every message is on the broker once apply_async has returned
            assert _queue_depth(broker_url, queue) == len(ids) + 1
            received = _consume_task_ids(broker_url, queue, len(ids) + 1, timeout=30)
            assert sorted(received) == sorted([first_id, *ids])
    finally:
        _delete_broker_objects(broker_url, [queue], [queue])


# -- 4b. heartbeats on pooled producer connections ---------------------------------------------
def test_producer_connections_get_the_drainers_heartbeat_though_celery_gives_none(
    broker_url: str, no_leaks: None
) -> None:
    """Celery passes ``broker_heartbeat`` only to the worker's consumer connection;
    ``app.pool`` connections are made by ``connection_for_write()`` with heartbeat=None.
    With the drainer they still get heartbeats (``DRAINER_HEARTBEAT``), so an idle pooled
    producer connection is kept alive and a dead one is noticed."""
    queue = unique_name("drainer-celery-hb-setting")
    with celery_app(broker_url, queue, broker_heartbeat=2) as app:
        with app.producer_or_acquire() as producer:
            producer.connection.ensure_connection(max_retries=1)
            conn = producer.connection.connection
            assert conn.drainer_stats()["running"] is True
            assert conn.heartbeat == DRAINER_HEARTBEAT


def test_pooled_connection_keeps_heartbeats_while_idle(broker_url: str, no_leaks: None) -> None:
    queue = unique_name("drainer-celery-hb")
    heartbeat = 2
    try:
        with celery_app(
            broker_url,
            queue,
            transport_options={
                "dedicated_drainer": True,
                "confirm_publish": True,
                "heartbeat": heartbeat,
            },
            broker_pool_limit=1,
        ) as app:
            add = app.tasks["drainer_test.add"]
            add.apply_async((1, 1))
            with app.producer_or_acquire() as producer:
                conn = producer.connection.connection
            assert conn.heartbeat == heartbeat
            port = _local_port(conn)
            assert len(broker_connection_names(port)) == 1

            # idle in the pool for 4 heartbeat intervals: without heartbeats from us the
            # broker drops the connection after two missed ones
            threading.Event().wait(4 * heartbeat)

            assert len(broker_connection_names(port)) == 1
            stats = conn.drainer_stats()
            assert stats["running"] is True
            assert stats["heartbeats_sent"] > 0
            assert stats["heartbeats_received"] > 0
            add.apply_async((2, 2))  # the same pooled connection, still good
            with app.producer_or_acquire() as producer:
                assert producer.connection.connection is conn
            assert _queue_depth(broker_url, queue) == 2
    finally:
        _delete_broker_objects(broker_url, [queue], [queue])


# -- 5. broker-side close of an idle pooled connection -----------------------------------------
def test_broker_closing_idle_pooled_connection_is_noticed_and_replaced(
    broker_url: str, no_leaks: None
) -> None:
    queue = unique_name("drainer-celery-brokerclose")
    try:
        with celery_app(
            broker_url,
            queue,
            transport_options={"dedicated_drainer": True, "confirm_publish": True},
            broker_pool_limit=1,
        ) as app:
            add = app.tasks["drainer_test.add"]
            add.apply_async((1, 1))
            with app.producer_or_acquire() as producer:
                conn = producer.connection.connection
            port = _local_port(conn)
            assert conn.connected

            assert close_broker_connections(port, "closed by test_celery") == 1
            # noticed while idle in the pool, before anyone publishes again: the drainer
            # ends and releases its socket; the next publish is told and retries
            assert wait_until(
                lambda: conn.reason is not None and not conn.drainer_stats()["running"], 10
            )

            add.apply_async((2, 2))
            with app.producer_or_acquire() as producer:
                fresh = producer.connection.connection
            assert fresh is not conn
            assert fresh.connected and fresh.drainer_stats()["running"] is True
            assert _local_port(fresh) != port
            assert _queue_depth(broker_url, queue) == 2
            # The drainer released its socket and wake-up pair itself when the link
            # failed, which the no_leaks fixture checks.
    finally:
        _delete_broker_objects(broker_url, [queue], [queue])
