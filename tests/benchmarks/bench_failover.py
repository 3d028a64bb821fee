"""Benchmark F: failover time when a cluster node is lost.

A three-node cluster of our own (``rabbit_cluster``); per round and client, the
scenario of ``tests/test_cluster.py`` (:func:`support.failover.run_failover`): four
publisher threads with confirms and a manual-ack consumer on the failover URL list, then
the node they are on is stopped (``rabbitmqctl stop_app``) or killed (SIGKILL). Reported
per client and fault: the time from the command to the first confirmed publish through
another node, and from the first error a client thread saw to that confirm (the
client's own share: ``stop_app`` spends about a second in ``rabbitmqctl`` itself).

``drainer``: one connection shared by all threads; ``stock``: stock kombu, one
connection per thread. Nothing is asserted but that each round ran; rounds that raised
(see the xfail marks in ``tests/test_cluster.py``) are counted and reported.

Run: ``pytest tests/benchmarks/bench_failover.py -m benchmark -s``.
"""

from __future__ import annotations

import time

import pytest
from support.failover import CLIENTS, FAULTS, FailoverResult, run_failover
from support.rabbit_nodes import RabbitCluster

from benchmarks import QUICK
from benchmarks.report import Collector, Section, fmt_ms, percentile

pytestmark = pytest.mark.benchmark

ROUNDS = 1 if QUICK else 3  # per client and fault


def test_failover_time(rabbit_cluster: RabbitCluster, bench_report: Collector) -> None:
    began = time.perf_counter()
    results: list[FailoverResult] = []
    for _ in range(ROUNDS):
        for fault in FAULTS:
            for client in CLIENTS:
                rabbit_cluster.ensure_running()
                result = run_failover(rabbit_cluster, client, fault)
                print(f"\n{result.summary()}", flush=True)
                results.append(result)
    rows = []
    for fault in FAULTS:
        for client in CLIENTS:
            mine = [r for r in results if r.client == client and r.fault == fault]
            total = [r.failover_s for r in mine if r.failover_s is not None]
            own = [r.after_error_s for r in mine if r.after_error_s is not None]
            rows.append(
                [
                    client,
                    fault,
                    str(len(mine)),
                    fmt_ms(percentile(total, 50)) if total else "-",
                    fmt_ms(max(total)) if total else "-",
                    fmt_ms(percentile(own, 50)) if own else "-",
                    fmt_ms(max(own)) if own else "-",
                    str(sum(bool(r.errors) for r in mine)),
                    str(sum(len(r.unconsumed) for r in mine)),
                    str(sum(len(r.lost) for r in mine)),
                    str(sum(r.duplicates for r in mine)),
                ]
            )
    bench_report.add(
        Section(
            key="failover",
            title="F. Losing a cluster node: time to the first confirm on another node",
            headers=[
                "client",
                "fault",
                "rounds",
                "command->resumed p50",
                "max",
                "first error->resumed p50",
                "max",
                "rounds with errors",
                "confirmed not consumed",
                "of them not in the queue",
                "duplicates",
            ],
            rows=rows,
            notes=[
                "Three local nodes, a quorum queue led by the second node, clients on the "
                "first; 4 publisher threads (Producer.publish(retry=True), confirms) and one "
                "consumer (autoretry, manual acks). drainer: one shared kombu connection; "
                "stock: one stock kombu connection per thread.",
            ],
            raw={"results": [r.summary() for r in results]},
            seconds=time.perf_counter() - began,
        )
    )
    assert len(results) == ROUNDS * len(FAULTS) * len(CLIENTS)
