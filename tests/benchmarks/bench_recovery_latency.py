"""Benchmark 3: how fast a dead link reaches every thread waiting on the connection.

10 and 50 threads share one connection through the test proxy: half wait in
``drain_events(timeout=20)``, half in ``basic_publish_confirm(confirm_timeout=20)`` for
a confirm that cannot come, because the proxy's downstream (broker -> client) is frozen
by a ``timeout`` toxic (timeout 0: data held forever) before they publish. Once every
thread is asleep in the library, a TCP reset kills the link, and each thread records
when its exception reached it.

The fault, exactly: a ``reset_peer`` toxic (timeout 0) on the *upstream* stream is
added with toxicity 0 before the connection is opened, so the proxy's sockets for this
connection get SO_LINGER 0 (like Toxiproxy, our proxy only resets connections whose
chain had a ``reset_peer`` when they started; one added later closes with a normal
FIN). At fault time the toxic is armed (toxicity 1, one API call) and triggered by
writing one heartbeat frame straight onto the client socket: the proxy drops it and
closes both TCP connections with RST. ``t0`` is taken right after that write returns;
the time reported per thread is from ``t0`` to its exception, and per round the max
over threads.

In legacy mode one thread reads the socket while the others wait for the transport
lock; that is what this measures.

This file is named ``bench_*.py``: collect it with ``-o python_files='test_*.py bench_*.py'``
or by passing its path. ``-k reset_peer`` selects it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import amqp
import pytest
from support.broker import unique_name, wait_until
from support.toxiproxy.fixtures import ProxiedBroker
from toxiproxy.api import APIConsumer

from benchmarks import QUICK, blocked_in, connect, interleaved, stack_names
from benchmarks.report import Collector, Section, Target, fmt_ms, fmt_ratio, percentile, ratio

pytestmark = pytest.mark.benchmark

THREADS = (10, 50)
ROUNDS = 5 if QUICK else 15  # per thread count and mode
LONG = 20.0  # the waits' own timeout: far above any expected propagation time
HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"
DRAINER_TARGET_50 = 0.005


@dataclass
class FaultRound:
    mode: str
    threads: int
    delays: list[float] = field(default_factory=list)  # t0 -> each thread's exception
    errors: dict[str, int] = field(default_factory=dict)  # exception type -> threads

    @property
    def max_s(self) -> float:
        return max(self.delays)


def _clear_toxics(proxied: ProxiedBroker) -> None:
    for name in list(proxied.proxy.toxics()):
        proxied.proxy.destroy_toxic(name)


def run_fault(mode: str, threads: int, proxied: ProxiedBroker) -> FaultRound:
    result = FaultRound(mode, threads)
    proxy = proxied.proxy
    _clear_toxics(proxied)
    proxy.add_toxic(
        name="reset",
        type="reset_peer",
        stream="upstream",
        toxicity=0.0,
        attributes={"timeout": 0},
    )
    conn = connect(mode, host=proxied.hostport)
    n_confirm = threads // 2
    outcomes: list[tuple[float, str] | None] = [None] * threads
    workers: list[threading.Thread] = []
    try:
        sock = conn.transport.sock
        routing_key = unique_name("bench-nowhere")
        message = amqp.Message(b"x" * 64)
        channels = [conn.channel() for _ in range(n_confirm)]
        for channel in channels:  # confirm mode on, and one confirm seen, before the freeze
            channel.basic_publish_confirm(message, exchange="", routing_key=routing_key)
        proxy.add_toxic(
            name="freeze", type="timeout", stream="downstream", attributes={"timeout": 0}
        )

        def wait_confirm(i: int) -> None:
            try:
                channels[i].basic_publish_confirm(
                    message, exchange="", routing_key=routing_key, confirm_timeout=LONG
                )
                outcomes[i] = (time.perf_counter(), "returned")
            except BaseException as exc:  # noqa: BLE001 - the end we wait for
                outcomes[i] = (time.perf_counter(), type(exc).__name__)

        def wait_drain(i: int) -> None:
            try:
                conn.drain_events(timeout=LONG)
                outcomes[i] = (time.perf_counter(), "returned")
            except BaseException as exc:  # noqa: BLE001 - the end we wait for
                outcomes[i] = (time.perf_counter(), type(exc).__name__)

        confirmers = [
            threading.Thread(target=wait_confirm, args=(i,), name=f"bench-confirm-{i}")
            for i in range(n_confirm)
        ]
        drainers = [
            threading.Thread(target=wait_drain, args=(i,), name=f"bench-drain-{i}")
            for i in range(n_confirm, threads)
        ]
        workers = confirmers + drainers
        for w in confirmers:
            w.start()
        # Asleep in basic_publish_confirm; in drainer mode with nothing left to write too
        # (a publish still in the writer would go out after the reset is armed, and trip
        # it). In legacy mode the publishes after the first wait for the reading thread.
        writer = conn.writer
        assert writer is not None
        assert wait_until(
            lambda: (
                all(blocked_in(w, {"basic_publish_confirm"}) for w in confirmers)
                and (mode == "legacy" or not writer.busy)
            ),
            10,
        ), f"{mode}: confirm waiters never all blocked: " + str(
            [stack_names(w)[:4] for w in confirmers if not blocked_in(w, {"basic_publish_confirm"})]
        )
        for w in drainers:
            w.start()
        assert wait_until(lambda: all(blocked_in(w, {"drain_events"}) for w in drainers), 10), (
            f"{mode}: drain_events waiters never all blocked: "
            + str([stack_names(w)[:4] for w in drainers if not blocked_in(w, {"drain_events"})])
        )
        assert all(o is None for o in outcomes), f"{mode}: a waiter ended before the fault"

        APIConsumer.post(f"/proxies/{proxy.name}/toxics/reset", json={"toxicity": 1.0})
        sock.send(HEARTBEAT_FRAME)
        t0 = time.perf_counter()
        end = time.monotonic() + LONG + 10
        for w in workers:
            w.join(max(end - time.monotonic(), 0.0))
    finally:
        conn.collect()
        for w in workers:
            if w.ident is not None:  # started
                w.join(5)
        _clear_toxics(proxied)
    assert not any(w.is_alive() for w in workers), f"{mode}: waiters still blocked"
    for outcome in outcomes:
        assert outcome is not None
        when, what = outcome
        result.errors[what] = result.errors.get(what, 0) + 1
        result.delays.append(when - t0)
    assert "returned" not in result.errors, f"{mode}: a wait returned: {result.errors}"
    return result


def test_error_propagation_reset_peer(
    proxied_broker: ProxiedBroker, bench_report: Collector
) -> None:
    began = time.perf_counter()
    rounds: list[FaultRound] = []
    for threads in THREADS:
        for _, mode in interleaved(ROUNDS):
            rounds.append(run_fault(mode, threads, proxied_broker))

    def pick(mode: str, threads: int) -> list[FaultRound]:
        return [r for r in rounds if r.mode == mode and r.threads == threads]

    rows = []
    summary: dict[tuple[str, int], dict[str, float]] = {}
    for threads in THREADS:
        for mode in ("legacy", "drainer"):
            rs = pick(mode, threads)
            maxes = [r.max_s for r in rs]
            every = [d for r in rs for d in r.delays]
            summary[(mode, threads)] = {
                "median_max": percentile(maxes, 50),
                "worst_max": max(maxes),
                "p50_thread": percentile(every, 50),
            }
            errors: dict[str, int] = {}
            for r in rs:
                for k, v in r.errors.items():
                    errors[k] = errors.get(k, 0) + v
            leg = summary.get(("legacy", threads))
            rows.append(
                [
                    mode,
                    str(threads),
                    str(len(rs)),
                    fmt_ms(summary[(mode, threads)]["p50_thread"]),
                    fmt_ms(summary[(mode, threads)]["median_max"]),
                    fmt_ms(summary[(mode, threads)]["worst_max"]),
                    fmt_ratio(ratio(leg["median_max"], summary[(mode, threads)]["median_max"]))
                    if mode == "drainer" and leg
                    else "",
                    ", ".join(f"{k} x{v}" for k, v in sorted(errors.items())),
                ]
            )
    dr50 = summary[("drainer", 50)]["median_max"]
    worst50 = summary[("drainer", 50)]["worst_max"]
    targets = [
        Target(
            "drainer, 50 threads: max propagation (median of rounds)",
            fmt_ms(dr50),
            f"< {fmt_ms(DRAINER_TARGET_50)}",
            dr50 < DRAINER_TARGET_50,
        ),
        Target(
            "drainer, 50 threads: max propagation (worst round)",
            fmt_ms(worst50),
            f"< {fmt_ms(DRAINER_TARGET_50)}",
            worst50 < DRAINER_TARGET_50,
        ),
    ]
    section = Section(
        key="recovery_latency",
        title="3. Error propagation after a TCP reset (reset_peer), threads sharing a connection",
        headers=[
            "mode",
            "threads",
            "rounds",
            "P50 thread",
            "max (median of rounds)",
            "max (worst round)",
            "legacy/drainer",
            "exceptions seen",
        ],
        rows=rows,
        targets=targets,
        notes=[
            "Half the threads wait in drain_events(timeout=20), half in "
            "basic_publish_confirm(confirm_timeout=20) with the downstream frozen by a "
            "timeout toxic (timeout 0), so no confirm can arrive. (In legacy mode only the "
            "first confirm thread gets its publish out: the others queue for the "
            "transport lock that the reading thread holds.)",
            "Fault: reset_peer (timeout 0) on the upstream, present with toxicity 0 since "
            "the connection opened (so the proxy's sockets have SO_LINGER 0), armed to "
            "toxicity 1 once every thread is blocked, and triggered by one heartbeat "
            "frame written on the client socket: the proxy drops it and resets both TCP "
            "connections. t0 = right after that write returns.",
            "'P50 thread' = median over every thread of every round; 'max' = the last "
            "thread's exception in a round. Every thread must end with an exception.",
            "Reference (12-core laptop, from the issue): 10 threads legacy 468 ms, "
            "drainer 2.2 ms; 50 threads legacy 523 ms, drainer 4.1 ms.",
            "Targets here are reported, not asserted (2 shared cores: waking 50 threads "
            "is bounded by the GIL's 5-ms switch interval as much as by the library).",
        ],
        raw={
            "rounds": ROUNDS,
            "results": [
                {
                    "mode": r.mode,
                    "threads": r.threads,
                    "max_s": r.max_s,
                    "delays_s": r.delays,
                    "errors": r.errors,
                }
                for r in rounds
            ],
        },
        seconds=time.perf_counter() - began,
    )
    bench_report.add(section)
    failed = [t.line() for t in targets if t.asserted and not t.met]
    assert not failed, "targets not met:\n" + "\n".join(failed)
