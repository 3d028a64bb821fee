"""A three-node RabbitMQ cluster loses the node the clients are on, mid-stream.

Publisher threads with confirms (``Producer.publish(retry=True)``) and a consumer with
manual acks (``Connection.autoretry``) go through kombu's failover URL list to a quorum
queue; the node they are on is stopped (``rabbitmqctl stop_app``) or killed (SIGKILL of
its Erlang VM). What users rely on: traffic resumes on another node within the retry
policy, every confirmed message is consumed (duplicates are allowed and reported), no
thread hangs, and (drainer) the old connection's drainer thread is gone.

``drainer``: one kombu connection shared by all threads. ``stock``: stock kombu, one
connection per thread (the baseline; see :mod:`support.failover`). The failover times
are printed (``-s``), not asserted; ``tests/benchmarks/bench_failover.py`` records them.

The cluster starts once per module; each case first restarts the node the previous one
stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import kombu.pools
import pytest
from celery_app import build_app
from support.broker import unique_name, wait_until
from support.failover import (
    CLIENTS,
    FAULTS,
    JOIN,
    RETRY_POLICY,
    FailoverResult,
    declare_quorum_queue,
    delete_queue,
    run_failover,
)
from support.rabbit_nodes import RabbitCluster


@pytest.fixture
def cluster(rabbit_cluster: RabbitCluster) -> RabbitCluster:
    rabbit_cluster.ensure_running()
    return rabbit_cluster


def _check(result: FailoverResult) -> None:
    print(f"\n{result.summary()}")
    for error in result.errors:
        print(error)
    assert not result.hung, f"threads hung: {result.hung}\n{result.stacks}"
    assert not result.errors, result.errors
    assert result.t_resumed is not None, "no confirm through another node"
    assert result.new_ports and result.old_port not in result.new_ports
    unconsumed = sorted(result.unconsumed)
    assert not unconsumed, (
        f"{len(unconsumed)} confirmed messages not consumed, e.g. {unconsumed[:5]}; "
        f"{len(result.lost)} of them not in the queue either"
    )
    assert not result.old_drainer_left, "the old connection's drainer thread is still alive"
    assert result.drainers_after_release == 0, "drainer threads left after release()"


CASES = [(client, fault) for client in CLIENTS for fault in FAULTS]


@pytest.mark.parametrize(("client", "fault"), CASES)
def test_losing_the_clients_node_moves_traffic_to_another(
    cluster: RabbitCluster, client: str, fault: str
) -> None:
    _check(run_failover(cluster, client, fault))


# -- Celery ---------------------------------------------------------------------------------
TESTS_DIR = Path(__file__).resolve().parent
CELERY_OPTIONS = {"dedicated_drainer": True, "confirm_publish": True}
TASKS = 60  # tasks sent after the fault


@contextmanager
def celery_worker(broker_url: str, queue: str, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A ``celery worker`` (threads pool) on ``queue``, in its own process group."""
    env = dict(os.environ)
    env.update(
        DRAINER_TEST_BROKER_URL=broker_url,
        DRAINER_TEST_QUEUE=queue,
        DRAINER_TEST_BACKEND="disabled",
        DRAINER_TEST_QUEUE_TYPE="quorum",
        PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")])),
    )
    argv = [
        sys.executable, "-m", "celery", "-A", "celery_app.app", "worker",
        "--pool=threads", "--concurrency=2", "-Q", queue, "-n", f"{queue}@%h",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            cwd=TESTS_DIR,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
        proc.wait(JOIN)


def test_celery_worker_and_apply_async_survive_the_loss_of_a_node(
    cluster: RabbitCluster, tmp_path: Path
) -> None:
    """A worker and ``apply_async`` (confirmed, ``retry=True``) on the failover list,
    both on the first node; it is killed while tasks flow. Every task whose
    ``apply_async`` returned runs (at least once), through the other nodes."""
    queue = unique_name("drainer-cluster-celery")
    markers = tmp_path / "markers"
    markers.mkdir()
    url = cluster.failover_url("drainer-amqp")
    declare_quorum_queue(cluster.nodes[1], queue)  # its leader away from the lost node
    log_path = tmp_path / "worker.log"
    sent: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    app = build_app(
        url,
        queue,
        transport_options=CELERY_OPTIONS,
        result_backend="disabled",
        task_default_queue_type="quorum",
    )
    record = app.tasks["drainer_test.record"]

    def produce(n: int) -> None:
        i = 0
        while not stop.is_set():
            token = f"p{n}-{i}"
            i += 1
            try:
                record.apply_async((token, str(markers)), retry=True, retry_policy=RETRY_POLICY)
            except Exception as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)
                return
            sent.append(token)
            stop.wait(0.01)  # a steady stream, not a flood

    producers = [
        threading.Thread(target=produce, args=(n,), name=f"celery-producer-{n}") for n in range(2)
    ]
    try:
        with celery_worker(url, queue, log_path) as worker:
            for t in producers:
                t.start()
            ran = lambda: {p.name for p in markers.iterdir()}  # noqa: E731
            assert wait_until(lambda: len(ran()) >= 20 or bool(errors), 60), log_path.read_text()
            lost = cluster.nodes[0]
            assert lost.connection_ports(), "nobody on the first node"
            before = len(sent)
            lost.kill()
            assert wait_until(lambda: len(sent) >= before + TASKS or bool(errors), 60)
            stop.set()
            for t in producers:
                t.join(JOIN)
            assert not any(t.is_alive() for t in producers), "apply_async hung"
            assert not errors, errors
            expected = set(sent)
            if not wait_until(lambda: expected <= ran(), 60):
                missing = sorted(expected - ran())
                pytest.fail(
                    f"{len(missing)} sent tasks never ran, e.g. {missing[:5]}\n"
                    f"{log_path.read_text()[-5000:]}"
                )
            runs = {p.name: len(p.read_text().split()) for p in markers.iterdir()}
            print(
                f"\ncelery: {len(expected)} tasks sent, each ran; "
                f"{sum(n - 1 for n in runs.values())} extra runs (redeliveries)"
            )
            assert worker.poll() is None, "the worker exited"
    finally:
        stop.set()
        for t in producers:
            if t.is_alive():
                t.join(JOIN)
        with suppress(Exception):
            app.close()
        kombu.pools.reset()  # the producer pool's connections, with their drainers
        delete_queue(cluster, queue)
