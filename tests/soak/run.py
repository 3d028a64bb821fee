"""One soak run: a scenario in a mode, through a fault proxy, with its accounting.

Scenario ``A`` (issue 10): 20 threads on one ``kombu.Connection`` (confirmed
publishers in three kombu retry styles, consumers with manual acks, a declarer), faults
of every kind every 5-20 s. Scenario ``B`` (issue 11): 8 publishers with
``Producer.publish(retry=True)``, the link reset or disabled every 2-5 s.

Modes: ``drainer`` (``drainer_amqp:Transport``, ``dedicated_drainer``), ``legacy`` (the
same transport without it) and ``stock`` (``pyamqp``, every call under one
``threading.RLock``, as a user of stock kombu would share a connection).

Threading contract: :func:`run` is called from one thread and returns when the run is
over; it starts and joins (bounded) every thread it uses: the workers, ``soak-faults``,
``soak-rss`` and ``soak-release``. A worker still alive after its bound is reported
(``hung``, with its stack) and left as a daemon thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

import amqp
import kombu
from support.broker import thread_stacks, unique_name, wait_until

from .faults import Broker, FaultInjector
from .ledger import Ledger, Progress, Raised
from .resources import RssSampler, settled, snapshot
from .workers import (
    PUBLISH_STYLES,
    Consumer,
    Declarer,
    Publisher,
    Shared,
    Worker,
)

__all__ = ["SCENARIOS", "MODES", "Options", "make_connection", "run"]

SCENARIOS = ("A", "B")
MODES = ("drainer", "legacy", "stock")
B_FAULTS = ("reset_peer", "disable")
JOIN = 20.0  # seconds for the workers to stop once told; later is a hang
SETTLE = 30.0  # seconds every worker gets to make progress again after the last fault
RELEASE = 30.0  # seconds for conn.release()
CCI = "ConnectionClosedIntentionally"


@dataclass
class Options:
    seconds: float
    seed: int
    faults: list[str]  # the kinds to draw from (already without the memory alarm unless owned)
    left_out: list[str] = field(default_factory=list)  # kinds not drawn, and why
    rate: float = 50.0  # publishes per second per publisher
    publishers: int = 13  # scenario A: 13 publishers + 6 consumers + 1 declarer = 20
    consumers: int = 6
    b_threads: int = 8
    heartbeat: float = 2.0


def make_connection(mode: str, url: str, name: str, heartbeat: float) -> kombu.Connection:
    """The one shared connection of a run, named ``name`` for the broker."""
    options: dict[str, Any] = {
        "confirm_publish": True,
        "client_properties": {"connection_name": name},
    }
    if mode == "stock":
        transport = "pyamqp"
    else:
        transport = "drainer_amqp:Transport"
        if mode == "drainer":
            options["dedicated_drainer"] = True
    return kombu.Connection(
        url, transport=transport, heartbeat=heartbeat, transport_options=options
    )


def _declare(broker: Broker, queues: list[str]) -> None:
    conn = amqp.Connection(host=f"{broker.host}:{broker.port}")
    conn.connect()
    try:
        channel = conn.channel()
        for name in queues:
            channel.queue_declare(name, durable=False, auto_delete=False)
    finally:
        conn.close()


def _drain(broker: Broker, queues: list[str], ledger: Ledger) -> dict[str, int]:
    """Take every message left in ``queues`` (counted as consumed), then delete them."""
    conn = amqp.Connection(host=f"{broker.host}:{broker.port}")
    conn.connect()
    drained = unacked = 0
    try:
        channel = conn.channel()
        for name in queues:
            while (message := channel.basic_get(name, no_ack=True)) is not None:
                drained += 1
                try:
                    ledger.consumed(json.loads(message.body).get("id"))
                except (ValueError, AttributeError):
                    ledger.consumed(None)
            # Still unacked by a connection that did not go away: not drainable.
            unacked += channel.queue_declare(name, passive=True).message_count
            channel.queue_delete(name)
    finally:
        conn.close()
    return {"drained_at_end": drained, "left_in_queues": unacked}


def _release(conn: kombu.Connection) -> str | None:
    """``conn.release()`` in a thread of its own, bounded: None, or what went wrong."""
    outcome: list[str] = []

    def release() -> None:
        try:
            conn.release()
        except Exception as exc:  # noqa: BLE001 - reported
            outcome.append(repr(exc))

    thread = threading.Thread(target=release, name="soak-release", daemon=True)
    thread.start()
    thread.join(RELEASE)
    if thread.is_alive():
        return f"release() hung for {RELEASE:g}s:\n{thread_stacks([thread])}"
    return outcome[0] if outcome else None


class _LogCounter(logging.Handler):
    """Counts warnings by message template instead of printing them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[f"{record.name}: {str(record.msg).strip()[:100]}"] += 1


@contextlib.contextmanager
def _counted_warnings() -> Iterator[Counter[str]]:
    """The library's, py-amqp's and kombu's warnings during a run, counted (a delivery
    for a consumer without a callback is one)."""
    handler = _LogCounter()
    loggers = [logging.getLogger(name) for name in ("amqp", "kombu", "drainer_amqp")]
    saved = [(lg.propagate, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
        lg.setLevel(logging.WARNING)
    try:
        yield handler.counts
    finally:
        for lg, (propagate, level) in zip(loggers, saved, strict=True):
            lg.removeHandler(handler)
            lg.propagate = propagate
            lg.setLevel(level)


def _workers(scenario: str, shared: Shared, opts: Options) -> list[Worker]:
    if scenario == "B":
        return [Publisher(shared, i, "retry") for i in range(opts.b_threads)]
    workers: list[Worker] = [
        Publisher(shared, i, PUBLISH_STYLES[i % len(PUBLISH_STYLES)])
        for i in range(opts.publishers)
    ]
    workers += [Consumer(shared, i) for i in range(opts.consumers)]
    workers.append(Declarer(shared))
    return workers


def run(scenario: str, mode: str, broker: Broker, toxiproxy: Any, opts: Options) -> dict[str, Any]:
    """Run ``scenario`` in ``mode`` for ``opts.seconds`` through a new proxy of the
    ``toxiproxy`` client in front of ``broker``; return the run's result."""
    with _counted_warnings() as warnings:
        result = _run(scenario, mode, broker, toxiproxy, opts)
    result["warnings"] = dict(warnings)
    return result


def _run(scenario: str, mode: str, broker: Broker, toxiproxy: Any, opts: Options) -> dict[str, Any]:
    if scenario not in SCENARIOS or mode not in MODES:
        raise ValueError(f"unknown run {scenario}/{mode}")
    kinds = opts.faults
    if scenario == "B":  # resets and disables; other kinds only when asked for alone
        kinds = [k for k in opts.faults if k in B_FAULTS] or opts.faults
    token = uuid.uuid4().hex[:8]
    name = f"soak-{scenario}-{mode}-{token}"
    proxy = toxiproxy.create(
        upstream=f"{broker.host}:{broker.port}", name=f"soak_{token}", listen="127.0.0.1:0"
    )
    port = int(proxy.listen.rpartition(":")[2])
    ports = [port, broker.port]
    nqueues = 1 if scenario == "B" else opts.consumers
    queues = [unique_name(f"soak-{scenario}-{mode}") for _ in range(nqueues)]
    nthreads = opts.b_threads if scenario == "B" else opts.publishers
    ledger, progress, raised = Ledger(nthreads), Progress(), Raised()
    rss = RssSampler()
    result: dict[str, Any] = {"scenario": scenario, "mode": mode, "seed": opts.seed}
    conn: kombu.Connection | None = None
    stop = threading.Event()
    released = declared = False
    try:
        before = snapshot(ports)
        _declare(broker, queues)
        declared = True
        conn = make_connection(mode, f"amqp://guest:guest@127.0.0.1:{port}//", name, opts.heartbeat)
        shared = Shared(
            conn,
            ledger,
            progress,
            raised,
            queues,
            opts.rate,
            stop=stop,
            lock=threading.RLock() if mode == "stock" else None,
        )
        conn.ensure_connection(max_retries=3)
        rss.start()
        workers = _workers(scenario, shared, opts)
        progress.start = monotonic()
        faults = FaultInjector(
            proxy,
            broker,
            random.Random(opts.seed),
            kinds,
            interval=(5.0, 20.0) if scenario == "A" else (2.0, 5.0),
            heartbeat=opts.heartbeat,
            connection_name=name,
            start=progress.start,
        )
        for worker in workers:
            worker.start()
        faults.start()
        shared.stop.wait(opts.seconds)
        faults_stopped = faults.stop()
        # Every worker must make progress again after the last fault was undone.
        settled_in = monotonic()
        recovered = wait_until(
            lambda: all(progress.beats_since(faults.last_end).values()), SETTLE, 0.1
        )
        settled_in = monotonic() - settled_in
        stuck = progress.worst(monotonic())
        not_recovered = [n for n, ok in progress.beats_since(faults.last_end).items() if not ok]
        shared.stop.set()
        deadline = monotonic() + JOIN
        hung = [w for w in workers if not w.join(max(deadline - monotonic(), 0.0))]
        hung_stacks = thread_stacks([w.thread for w in hung])
        release_error = _release(conn)
        released = True
        for worker in hung:  # a call the release woke up
            worker.join(5)
        drained = _drain(broker, queues, ledger)
        declared = False
        rss.stop()
        after = settled(before, ports)
        by_type = raised.by_type()
        publish_raised = raised.by_type("publish")
        longest = faults.longest
        warmup = opts.seconds / 4  # the heap's first high-water marks: not a slope
        result.update(ledger.totals())
        result.update(drained)
        result.update(
            {
                "seconds": opts.seconds,
                "threads": len(workers),
                "rate_per_publisher": opts.rate,
                "faults": [r.as_dict() for r in faults.records],
                "fault_kinds": kinds,
                "faults_left_out": opts.left_out + [k for k in opts.faults if k not in kinds],
                "fault_errors": faults.errors,
                "faults_stopped": faults_stopped,
                "longest_fault_s": round(longest, 2),
                "max_stuck_s": round(stuck[0], 2),
                "max_stuck_thread": stuck[1],
                "max_stuck_at_s": round(stuck[2], 1),
                "recovered_after_last_fault": recovered,
                "not_recovered": not_recovered,
                "settle_s": round(settled_in, 2),
                "publish_raised_by_type": publish_raised,
                "raised_by_role": raised.by_role(),
                "unexpected_errors": dict(raised.unexpected),
                "connection_closed_intentionally": sum(
                    n for k, n in by_type.items() if k.endswith(CCI)
                ),
                "first_tracebacks": raised.first,
                "hung": [w.name for w in hung],
                "hung_stacks": hung_stacks,
                "release_error": release_error,
                "before": before.as_dict(),
                "after": after.as_dict(),
                "threads_leaked": sorted(after.threads)
                + (["drainer"] * max(after.drainers - before.drainers, 0)),
                "fds_leaked": max(after.fds - before.fds, 0),
                "sockets_left": max(after.sockets - before.sockets, 0),
                "rss_warmup_s": round(warmup, 1),
                "rss_slope_mb_per_min": round(rss.slope(warmup), 3),
                "rss_slope_second_half_mb_per_min": round(rss.slope(opts.seconds / 2), 3),
                "rss_peak_mb": round(rss.peak(), 1),
                "rss_mb": [[round(t), round(mb, 1)] for t, mb in rss.samples[::10]],
            }
        )
        result["targets"] = targets(result)
        return result
    finally:  # after a failure of the soak itself: stop and clean up what is left
        stop.set()
        rss.stop()
        try:
            _undo_all(proxy, broker)
        finally:
            proxy.destroy()
            if conn is not None and not released:
                _release(conn)
            if declared:
                _drain(broker, queues, ledger)


def _undo_all(proxy: Any, broker: Broker) -> None:
    """Whatever a fault left behind (it undoes itself; this is the ``finally``)."""
    try:
        proxy.enable()
        for toxic in list(proxy.toxics()):
            proxy.destroy_toxic(toxic)
    finally:
        if broker.owned:
            broker.set_watermark(broker.default_watermark)


#: A run this long judges the heap's slope and bounds stuck threads by its longest fault.
#: A shorter run reports both: its slope is mostly warm-up, and it may draw only short
#: faults (one every 5-20 s), so a fixed bound (as tests/test_soak.py's) judges stuck.
LONG_RUN = 300.0
SHORT_RUN_STUCK_BOUND = 45.0


def targets(result: dict[str, Any]) -> dict[str, bool]:
    """The soak's targets; every one true for a run that met them."""
    long_run = result["seconds"] >= LONG_RUN
    stuck = "stuck_within_2x_longest_fault" if long_run else "stuck_within_45s"
    bound = 2 * result["longest_fault_s"] if long_run else SHORT_RUN_STUCK_BOUND
    out = {
        "lost_0": result["lost"] == 0,
        "no_leaks": not result["threads_leaked"]
        and result["fds_leaked"] == 0
        and result["sockets_left"] == 0,
        stuck: result["max_stuck_s"] <= bound and not result["hung"],
        "typed_errors_only": not result["unexpected_errors"],
    }
    if long_run:
        out["rss_slope_below_1_mb_per_min"] = result["rss_slope_mb_per_min"] < 1.0
    if result["scenario"] == "B":
        out["no_connection_closed_intentionally"] = result["connection_closed_intentionally"] == 0
    return out


def summary_line(result: dict[str, Any]) -> str:
    failed = [k for k, ok in result["targets"].items() if not ok]
    raised = ", ".join(
        f"{k.rsplit('.', 1)[-1]}={n}" for k, n in sorted(result["publish_raised_by_type"].items())
    )
    return (
        f"{result['scenario']}/{result['mode']} seed={result['seed']} {result['seconds']:g}s: "
        f"confirmed={result['confirmed']} consumed_unique={result['consumed_unique']} "
        f"lost={result['lost']} duplicates={result['duplicates']} "
        f"publish_raised={{{raised}}} cci={result['connection_closed_intentionally']} "
        f"faults={len(result['faults'])} longest_fault={result['longest_fault_s']}s "
        f"max_stuck={result['max_stuck_s']}s ({result['max_stuck_thread']}) "
        f"threads_leaked={len(result['threads_leaked'])} fds_leaked={result['fds_leaked']} "
        f"sockets_left={result['sockets_left']} "
        f"rss_slope={result['rss_slope_mb_per_min']:+.2f}MB/min "
        f"-> {'OK' if not failed else 'MISSED ' + ','.join(failed)}"
    )
