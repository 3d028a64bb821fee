"""Benchmark 6: a publish-only connection with heartbeats, idle longer than the timeout.

Heartbeat 2 s (the broker gives up on a client that sent nothing for about two
intervals); the connection publishes nothing for ``IDLE`` seconds and no thread calls
``drain_events`` or ``heartbeat_tick``. Then it publishes one message with a publisher
confirm. Reported per mode: did the connection survive (the confirm came back), and
did the message arrive in its queue (checked with ``basic_get`` on a separate, direct
connection).

Checked: the drainer survives and delivers every time (its thread sends heartbeats by
itself). Legacy is reported, not asserted: py-amqp leaves heartbeats to the caller.
Both modes' trials run at the same time (independent connections), to save time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import amqp
import pytest
from support.broker import BROKER_HOST, unique_name, wait_until

from benchmarks import MODES, QUICK, connect
from benchmarks.report import Collector, Section, Target

pytestmark = pytest.mark.benchmark

HEARTBEAT = 2
IDLE = 6.0 if QUICK else 10.0
TRIALS = 2 if QUICK else 3  # per mode, all concurrent
CONFIRM_TIMEOUT = 5.0


@dataclass
class Trial:
    mode: str
    queue: str
    marker: bytes
    outcome: str = "not run"  # "confirmed" or the exception
    survived: bool = False
    arrived: bool = False
    heartbeats_sent: int | None = None


def run_trial(trial: Trial, start: threading.Event) -> None:
    try:
        conn = connect(trial.mode, host=BROKER_HOST, heartbeat=HEARTBEAT)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        trial.outcome = f"connect failed: {exc!r}"
        return
    try:
        channel = conn.channel()
        channel.confirm_select()
        start.wait(30)
        threading.Event().wait(IDLE)  # the idle period itself: the point of the test
        try:
            channel.basic_publish_confirm(
                amqp.Message(trial.marker),
                exchange="",
                routing_key=trial.queue,
                confirm_timeout=CONFIRM_TIMEOUT,
            )
            trial.outcome = "confirmed"
            trial.survived = True
        except BaseException as exc:  # noqa: BLE001 - the outcome we report
            trial.outcome = f"{type(exc).__name__}: {exc}"[:120]
        if trial.mode == "drainer":
            trial.heartbeats_sent = int(conn.drainer_stats().get("heartbeats_sent", 0))
    finally:
        conn.collect()


def test_publish_only_connection_survives_idle(bench_report: Collector) -> None:
    began = time.perf_counter()
    admin = amqp.Connection(host=BROKER_HOST)
    admin.connect()
    trials = [
        Trial(mode, unique_name(f"bench-hb-{mode}"), unique_name("marker").encode())
        for _ in range(TRIALS)
        for mode in MODES
    ]
    threads: list[threading.Thread] = []
    try:
        admin_channel = admin.channel()
        for trial in trials:
            admin_channel.queue_declare(trial.queue, auto_delete=False)
        start = threading.Event()
        threads = [
            threading.Thread(target=run_trial, args=(t, start), name=f"bench-hb-{t.mode}-{i}")
            for i, t in enumerate(trials)
        ]
        for thread in threads:
            thread.start()
        start.set()
        for thread in threads:
            thread.join(IDLE + CONFIRM_TIMEOUT + 60)
        assert not any(t.is_alive() for t in threads), "a trial did not finish"

        for trial in trials:

            def arrived(trial: Trial = trial) -> bool:
                message = admin_channel.basic_get(trial.queue, no_ack=True)
                if message is not None and message.body == trial.marker:
                    trial.arrived = True
                return trial.arrived

            wait_until(arrived, 2.0 if trial.survived else 0.5)
    finally:
        for thread in threads:
            thread.join(5)
        try:
            channel = admin.channel()
            for trial in trials:
                channel.queue_delete(trial.queue)
        finally:
            admin.close()

    rows = []
    for mode in MODES:
        ts = [t for t in trials if t.mode == mode]
        outcomes = sorted({t.outcome for t in ts})
        rows.append(
            [
                mode,
                f"{sum(t.survived for t in ts)}/{len(ts)}",
                f"{sum(t.arrived for t in ts)}/{len(ts)}",
                "; ".join(outcomes),
                ", ".join(str(t.heartbeats_sent) for t in ts) if mode == "drainer" else "-",
            ]
        )
    drainer = [t for t in trials if t.mode == "drainer"]
    ok = all(t.survived and t.arrived for t in drainer)
    legacy_lost = [t for t in trials if t.mode == "legacy" and not t.arrived]
    silent = [t for t in legacy_lost if t.survived]
    delivered = sum(t.survived and t.arrived for t in drainer)
    targets = [
        Target(
            "drainer: survived and delivered",
            f"{delivered}/{len(drainer)}",
            "every time",
            ok,
            asserted=True,
        ),
    ]
    section = Section(
        key="heartbeat_publish_only",
        title=f"6. Publish-only connection, heartbeat {HEARTBEAT} s, idle {IDLE:g} s, "
        "then a confirmed publish",
        headers=[
            "mode",
            "survived",
            "message arrived",
            "outcome of the publish",
            "heartbeats sent by the drainer",
        ],
        rows=rows,
        targets=targets,
        notes=[
            f"{TRIALS} connections per mode, all at once. 'survived' = the publisher "
            f"confirm came back within {CONFIRM_TIMEOUT:g} s; 'message arrived' = "
            "basic_get on a direct connection found it in the trial's own queue.",
            "Legacy (not asserted): "
            + (
                "every message was lost, and the publish raised an error each time "
                "(no silent loss)."
                if legacy_lost and not silent
                else f"{len(legacy_lost)} lost, {len(silent)} of them silently."
            ),
        ],
        raw={
            "heartbeat_s": HEARTBEAT,
            "idle_s": IDLE,
            "trials": [t.__dict__ | {"marker": t.marker.decode()} for t in trials],
        },
        seconds=time.perf_counter() - began,
    )
    bench_report.add(section)
    assert ok, "drainer connection did not survive the idle period:\n" + "\n".join(
        f"{t.queue}: {t.outcome}, arrived={t.arrived}" for t in drainer
    )
