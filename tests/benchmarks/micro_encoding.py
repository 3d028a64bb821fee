"""Micro-benchmark of the publish path's encoding (a plain script; pytest does not collect
it). Prints µs per encode, py-amqp's frame writer against PublishEncoder, then µs per
``channel.basic_publish`` on one drainer connection, one thread, through py-amqp's
encoder (``publish_encoder = None``: the path before PublishEncoder) and through
PublishEncoder, then the top of a cProfile of 20k fast-path publishes.

    PYTHONPATH=src:tests python tests/benchmarks/micro_encoding.py [--publishes N]

Publishes go to an unbound routing key on the default exchange: the broker drops them.
The machine is shared: run it a few times, read the best figures.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
from collections.abc import Callable
from time import perf_counter
from typing import Any

import amqp
from amqp import spec
from amqp.method_framing import frame_writer
from amqp.serialization import dumps
from support.broker import BROKER_HOST, unique_name

import drainer_amqp
from drainer_amqp.encoding import PublishEncoder

FRAME_MAX = 131072
PUBLISH = ("", "some.routing.key", False, False)


class _Collector:
    """py-amqp's frame writer's transport, as the Connection uses it: copies each write."""

    def __init__(self) -> None:
        self.frame_max = FRAME_MAX
        self.bytes_sent = 0
        self.chunks: list[bytes] = []

    def write(self, data: Any) -> None:
        self.chunks.append(bytes(data))


def _messages() -> dict[str, Callable[[], amqp.Message]]:
    headers = {"id": "9f1c0b6e-3a52-4c1f-8f0e-5a1b2c3d4e5f", "task": "tasks.add", "retries": 0}
    return {
        "bare 5 B": lambda: amqp.Message(b"hello"),
        "kombu-like 100 B": lambda: amqp.Message(
            b"x" * 100,
            content_type="application/json",
            content_encoding="utf-8",
            application_headers=dict(headers, eta=None),
            delivery_mode=2,
            priority=0,
        ),
        "str body 100 chars": lambda: amqp.Message("\u00e9" * 100, content_type="text/plain"),
        "1 MiB body": lambda: amqp.Message(b"y" * (1 << 20), delivery_mode=2),
    }


def _per_call(run: Callable[[int], None], n: int, rounds: int = 5) -> float:
    """Best µs per call over ``rounds`` runs of ``n`` calls."""
    best = float("inf")
    for _ in range(rounds):
        start = perf_counter()
        run(n)
        best = min(best, (perf_counter() - start) / n * 1e6)
    return best


def bench_encode() -> None:
    print(f"µs per encode (frame_max {FRAME_MAX}; best of 5)")
    print(f"  {'message':<22}{'py-amqp':>10}{'ours':>10}{'speed-up':>10}")
    for name, make in _messages().items():
        n = 200 if "MiB" in name else 20000
        msgs = [make() for _ in range(n)]  # py-amqp mutates a str body's properties
        collector = _Collector()
        write = frame_writer(collector, collector)
        encoder = PublishEncoder(FRAME_MAX)

        def theirs(
            count: int, msgs: list[amqp.Message] = msgs, write: Any = write, c: Any = collector
        ) -> None:
            for msg in msgs[:count]:
                args = dumps("Bssbb", (0, *PUBLISH))
                write(1, 1, spec.Basic.Publish, args, msg)
                c.chunks = []

        def ours(count: int, msgs: list[amqp.Message] = msgs, encode: Any = encoder.encode) -> None:
            for msg in msgs[:count]:
                encode(1, *PUBLISH, msg)

        a, b = _per_call(theirs, n), _per_call(ours, n)
        print(f"  {name:<22}{a:>10.2f}{b:>10.2f}{a / b:>9.1f}x")


def bench_publish(publishes: int) -> drainer_amqp.Connection:
    conn = drainer_amqp.Connection(host=BROKER_HOST, dedicated_drainer=True)
    conn.connect()
    encoder = conn.publish_encoder
    channel = conn.channel()
    key = unique_name("micro-encoding")  # unbound: the broker drops what we send
    message = _messages()["kombu-like 100 B"]()

    def run(count: int) -> None:
        publish = channel.basic_publish
        for _ in range(count):
            publish(message, routing_key=key)

    results: dict[str, list[float]] = {"py-amqp encoder (before)": [], "PublishEncoder": []}
    for _ in range(5):  # interleaved: the machine's load drifts
        conn.publish_encoder = None
        results["py-amqp encoder (before)"].append(_per_call(run, publishes, rounds=1))
        conn.publish_encoder = encoder
        results["PublishEncoder"].append(_per_call(run, publishes, rounds=1))
    print(f"\nµs per basic_publish, drainer mode, one thread, {publishes} per round, 5 rounds")
    for name, values in results.items():
        print(f"  {name:<26} best {min(values):6.2f}   median {statistics.median(values):6.2f}")
    return conn


def profile_publish(conn: drainer_amqp.Connection, publishes: int) -> None:
    channel = conn.channel()
    key = unique_name("micro-encoding")
    message = _messages()["kombu-like 100 B"]()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(publishes):
        channel.basic_publish(message, routing_key=key)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(10)
    print(f"\ncProfile, {publishes} basic_publish with PublishEncoder, top 10 cumulative")
    print(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--publishes", type=int, default=20000)
    options = parser.parse_args()
    bench_encode()
    conn = bench_publish(options.publishes)
    try:
        profile_publish(conn, options.publishes)
    finally:
        conn.close()


if __name__ == "__main__":
    main()
