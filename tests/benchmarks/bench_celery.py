"""Benchmark L: a Celery worker consuming no-op tasks, stock kombu against the drainer.

A ``celery worker`` subprocess consumes a queue of its own, prefilled with ``N`` task
messages before the worker starts. The messages are Celery's own (headers, properties and
body from ``app.amqp.as_task_v2``, a fresh task id each; json, persistent, to Celery's
durable queue), written by ``basic_publish`` on a stock kombu (py-amqp) channel, then a
wait until the broker reports ``N`` ready; the prefill is not timed. The worker runs with
``-Q <queue> --without-gossip --without-mingle --without-heartbeat -l WARNING``, no result
backend (``task_ignore_result=True``), early acks (Celery's default), remote control off,
the same ``worker_prefetch_multiplier`` for both clients, and its broker either

* stock kombu: ``pyamqp://`` with no transport options (Celery's default transport), or
* the drainer: ``broker_transport="drainer_amqp:Transport"``,
  ``broker_transport_options={"dedicated_drainer": True}`` (drainer mode);

for two pools: ``--pool=threads --concurrency=8`` and ``--pool=prefork --concurrency=2``.

The task appends one byte to a counter file (``O_APPEND``, the descriptor opened when the
worker imports its app, inherited by prefork children), so completions in threads and in
children alike are counted by the file's size, which this process polls every ``POLL``
seconds. Tasks/s = ``N - 1`` over the time from the first byte to the ``N``-th. CPU
µs/task = the worker process tree's CPU time (psutil: parent and children, user + system)
sampled when the first byte and the ``N``-th are seen, per task; the broker's CPU and this
process's are not counted. One round (``ROUNDS``), the runs in the order stock, drainer
(threads), drainer, stock (prefork); with more rounds the order is reversed each round.

Hard checks only, no ratio asserted: exactly ``N`` completions within ``RUN_TIMEOUT``, the
worker exits 0 on SIGTERM (warm shutdown) within ``SHUTDOWN_TIMEOUT``, the queue empty
at the end. Every wait is bounded; on failure the worker's process group is killed and its
log printed; every queue and exchange is deleted.

Run: ``pytest tests/benchmarks/bench_celery.py -m benchmark -s -o python_files='bench_*.py'``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import amqp
import kombu
import psutil
import pytest
from celery import Celery
from kombu.utils.json import dumps
from support.broker import BROKER_HOST, unique_name

from benchmarks import QUICK
from benchmarks.report import Collector, Section, fmt_ratio

pytestmark = pytest.mark.benchmark

N = 1_000 if QUICK else 20_000  # tasks per run
#: One round in full mode too: the four 20,000-task runs take about 50 s on the project's
#: 2-core machine, and a second round would put the main job over its ten minutes.
ROUNDS = 1
PREFETCH_MULTIPLIER = 4  # Celery's default, the same for both clients
TASK = "drainer_bench.noop"
URL = f"amqp://guest:guest@{BROKER_HOST}//"
STOCK_URL = f"pyamqp://guest:guest@{BROKER_HOST}//"
POOLS = {  # pool -> its worker arguments
    "threads x8": ["--pool=threads", "--concurrency=8"],
    "prefork x2": ["--pool=prefork", "--concurrency=2"],
}
CLIENTS = {"stock": "stock kombu (pyamqp)", "drainer": "drainer mode"}
POLL = 0.003  # seconds between two looks at the counter file's size
PREFILL_TIMEOUT = 60.0  # seconds the broker may take to report N ready
RUN_TIMEOUT = 120.0  # seconds from the worker's start to the N-th completion
SHUTDOWN_TIMEOUT = 30.0  # seconds a warm shutdown may take
LOG_MARKERS = ("WARNING/", "ERROR/", "CRITICAL/", "Traceback")

#: The worker's app module, written to the run's directory (``celery -A bench_worker``).
WORKER_APP = '''\
"""Benchmark L's worker app: one no-op task that appends a byte to a counter file."""
import os

from celery import Celery

app = Celery("drainer_bench", set_as_current=False)
app.conf.update({settings!r})

# Opened on import, in the worker's main process; prefork children inherit it.
_COUNTER = os.open({counter!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT)


@app.task(name={task!r})
def noop():
    os.write(_COUNTER, b"x")
'''


def _settings(client: str, queue: str) -> dict[str, Any]:
    """The Celery settings of the worker's app (and of the prefill's) for ``client``."""
    settings: dict[str, Any] = {
        "broker_url": STOCK_URL,
        "broker_connection_retry_on_startup": True,
        "task_default_queue": queue,
        "task_ignore_result": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "worker_prefetch_multiplier": PREFETCH_MULTIPLIER,
        "worker_enable_remote_control": False,  # no pidbox queue on the shared broker
        # No heartbeat timer: with one, the worker's event loop polls for up to 10 s and a
        # threads-pool worker takes that long to see SIGTERM.
        "broker_heartbeat": 0,
    }
    if client == "drainer":
        settings.update(
            broker_url=URL,
            broker_transport="drainer_amqp:Transport",
            broker_transport_options={"dedicated_drainer": True},
        )
    return settings


@contextlib.contextmanager
def filled_queue() -> Iterator[tuple[str, amqp.Channel]]:
    """A new queue (declared as Celery declares it) holding ``N`` task messages; yields its
    name and a channel to inspect it; deletes the queue and its exchange on exit."""
    name = unique_name("drainer-bench-celery")
    app = Celery("drainer_bench_prefill", set_as_current=False)
    app.conf.update(_settings("stock", name))
    conn = kombu.Connection(STOCK_URL, connect_timeout=30)
    try:
        channel = conn.default_channel  # kombu's pyamqp Channel: a py-amqp Channel
        try:
            app.amqp.queues[name].bind(channel).declare()  # the worker's declare matches
            template = app.amqp.as_task_v2("-", TASK, ignore_result=True)
            body = dumps(template.body).encode()
            # what kombu's Producer adds to Celery's properties: json, persistent
            properties = {
                **template.properties,
                "content_type": "application/json",
                "content_encoding": "utf-8",
                "delivery_mode": 2,
                "priority": 0,
            }
            for _ in range(N):
                task_id = str(uuid.uuid4())
                headers = {**template.headers, "id": task_id, "root_id": task_id}
                message = amqp.Message(
                    body, application_headers=headers, **{**properties, "correlation_id": task_id}
                )
                channel.basic_publish(message, exchange="", routing_key=name)
            deadline = time.monotonic() + PREFILL_TIMEOUT
            while (ready := _ready(channel, name)) != N:
                assert ready < N, f"prefill: {ready:,} messages ready, expected {N:,}"
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"prefill: {ready:,} of {N:,} ready after {PREFILL_TIMEOUT:g} s"
                    )
                time.sleep(0.02)
            yield name, channel
        finally:
            channel.queue_delete(name)
            channel.exchange_delete(name)
    finally:
        conn.release()
        app.close()


def _ready(channel: amqp.Channel, queue: str) -> int:
    """Messages ready in ``queue``, as the broker reports them."""
    return int(channel.queue_declare(queue, passive=True).message_count)


def _tree_cpu(proc: psutil.Process) -> tuple[float, float]:
    """CPU seconds (user + system) of ``proc``, and of its children: the live ones' plus
    the reaped ones'."""
    times = proc.cpu_times()
    children = times.children_user + times.children_system
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child_times = child.cpu_times()
            children += child_times.user + child_times.system
    return times.user + times.system, children


class Worker:
    """A ``celery worker`` subprocess in its own process group; output in ``log_path``."""

    def __init__(self, run_dir: Path, client: str, pool: str, queue: str, counter: Path) -> None:
        self.children: list[psutil.Process] = []  # the pool's processes, once seen
        (run_dir / "bench_worker.py").write_text(
            WORKER_APP.format(settings=_settings(client, queue), counter=str(counter), task=TASK)
        )
        self.log_path = run_dir / "worker.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(run_dir), env.get("PYTHONPATH")]))
        argv = [
            *(sys.executable, "-m", "celery", "-A", "bench_worker", "worker"),
            *POOLS[pool],
            *("-Q", queue, "-n", f"{queue}@%h"),
            *("--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING"),
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=run_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: pool children die with it
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        code = self.proc.poll()
        assert code is None, f"worker exited early with code {code}"

    def terminate(self) -> tuple[int | None, float]:
        """SIGTERM (Celery's warm shutdown); return (exit code or None, seconds taken)."""
        start = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(SHUTDOWN_TIMEOUT)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.perf_counter() - start

    def kill(self) -> None:
        """SIGKILL the worker's process group if the worker still runs, and any of its
        children seen earlier that outlived it (psutil checks a pid was not reused)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        for child in self.children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def _count(counter: Path) -> int:
    return counter.stat().st_size


def run_worker(run_dir: Path, client: str, pool: str) -> dict[str, Any]:
    """One run: prefill a queue, start the worker, time its ``N`` tasks, stop it."""
    run_dir.mkdir()
    counter = run_dir / "done"
    counter.touch()
    with filled_queue() as (queue, channel):
        began = time.perf_counter()
        worker = Worker(run_dir, client, pool, queue, counter)
        ok = False
        try:
            ps = psutil.Process(worker.proc.pid)
            deadline = time.monotonic() + RUN_TIMEOUT
            while _count(counter) == 0:
                worker.check_alive()
                assert time.monotonic() < deadline, f"no task done after {RUN_TIMEOUT:g} s"
                time.sleep(POLL)
            first, cpu_first = time.perf_counter(), _tree_cpu(ps)
            worker.children = ps.children(recursive=True)
            while (done := _count(counter)) < N:
                worker.check_alive()
                assert time.monotonic() < deadline, (
                    f"{done:,} of {N:,} tasks done after {RUN_TIMEOUT:g} s, "
                    f"{_ready(channel, queue):,} messages ready on the broker"
                )
                time.sleep(POLL)
            last, cpu_last = time.perf_counter(), _tree_cpu(ps)
            code, took = worker.terminate()
            assert code == 0, f"worker exit code {code} after {took:.1f} s of warm shutdown"
            assert _count(counter) == N, f"{_count(counter):,} tasks done, expected {N:,}"
            assert _ready(channel, queue) == 0, "messages left in the queue"
            ok = True
        finally:
            worker.kill()
            if not ok:
                print(f"---- worker log ({worker.log_path}) ----\n{worker.log()}", flush=True)
    log_lines = [ln for ln in worker.log().splitlines() if any(m in ln for m in LOG_MARKERS)]
    if log_lines:
        print(f"{pool}, {CLIENTS[client]}: worker log:\n" + "\n".join(log_lines[:20]), flush=True)
    return {
        "tasks_s": (N - 1) / (last - first),
        "cpu_us": 1e6 * (sum(cpu_last) - sum(cpu_first)) / (N - 1),
        "cpu_us_parent": 1e6 * (cpu_last[0] - cpu_first[0]) / (N - 1),
        "cpu_us_children": 1e6 * (cpu_last[1] - cpu_first[1]) / (N - 1),
        "first_task_s": first - began,  # worker start to first completion
        "shutdown_s": took,
        "run_s": time.perf_counter() - began,
        "log_lines": log_lines[:20],
    }


def test_celery_worker(bench_report: Collector, tmp_path: Path) -> None:
    began = time.perf_counter()
    # Round 0: stock, drainer for one pool, drainer, stock for the other; reversed each round.
    runs = [
        (pool, client)
        for j, pool in enumerate(POOLS)
        for client in (list(CLIENTS) if j % 2 == 0 else list(CLIENTS)[::-1])
    ]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for i in range(ROUNDS):
        for pool, client in runs if i % 2 == 0 else runs[::-1]:
            run_dir = tmp_path / f"{i}-{pool.split()[0]}-{client}"
            result = run_worker(run_dir, client, pool)
            results.setdefault(pool, {}).setdefault(client, []).append(result)
    rate = {
        pool: {client: max(r["tasks_s"] for r in by[client]) for client in CLIENTS}
        for pool, by in results.items()
    }
    cpu = {
        pool: {client: statistics.median(r["cpu_us"] for r in by[client]) for client in CLIENTS}
        for pool, by in results.items()
    }
    rows = [
        [
            pool,
            label,
            f"{rate[pool][client]:,.0f}",
            fmt_ratio(rate[pool][client] / rate[pool]["stock"]),
            f"{cpu[pool][client]:,.0f}",
        ]
        for pool in POOLS
        for client, label in CLIENTS.items()
    ]
    bench_report.add(
        Section(
            key="celery",
            title=f"L. Celery worker, {N:,} no-op tasks from a prefilled queue",
            headers=["pool", "client", "tasks/s", "over stock kombu", "CPU µs/task"],
            rows=rows,
            notes=[
                f"Each run: a queue of its own prefilled with {N:,} Celery task messages "
                "(json, persistent, durable queue) before the worker starts; then `celery "
                "worker -Q <queue> --without-gossip --without-mingle --without-heartbeat`, "
                "no result backend, early acks, remote control off, "
                f"worker_prefetch_multiplier={PREFETCH_MULTIPLIER} (Celery's default) for both "
                "clients.",
                "stock kombu: pyamqp://, no transport options. drainer mode: "
                'broker_transport="drainer_amqp:Transport", dedicated_drainer=True.',
                "Tasks/s: tasks over the time from the first completion to the last (the "
                "task appends a byte to a file; this process polls its size every "
                f"{POLL * 1000:g} ms); the best of {ROUNDS} round(s), in the order stock, "
                "drainer (threads), drainer, stock (prefork), reversed each further round. "
                "One round in full mode too (a second would put the main job over its ten "
                "minutes): one run per row, noisy on a 2-core machine shared with the broker.",
                "CPU µs/task: the worker process tree's CPU time (parent and pool children, "
                "user + system) over the same span, per task; the median of rounds. The "
                "broker's CPU and the prefill's are not counted.",
                "Over stock kombu: this row's rate over the stock kombu row's, same pool.",
                "SIGTERM right after the last completion; the warm shutdown is checked (exit "
                "0, the queue empty, no task run twice) but not timed. broker_heartbeat=0 for "
                "both clients: with Celery's heartbeat timer, its event loop polls for up to "
                "10 s and a threads-pool worker takes that long to see SIGTERM.",
            ],
            raw={
                "tasks": N,
                "prefetch_multiplier": PREFETCH_MULTIPLIER,
                "pools": POOLS,
                "tasks_s": rate,
                "cpu_us_per_task": cpu,
                "rounds": results,
            },
            seconds=time.perf_counter() - began,
            order=20,
        )
    )
