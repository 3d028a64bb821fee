"""Benchmark G: confirmed publishing, 64-byte bodies, one connection.

Confirmed msg/s = messages acked / seconds from the first publish to the last ack. Rows,
interleaved round by round, each publishing for ``WINDOW`` seconds to one queue:

* the ceiling: a raw socket in confirm mode, pre-encoded publishes written in batches,
  acks read as a stream by a second thread, at most 20,000 unconfirmed;
* stock py-amqp ``basic_publish_confirm`` and the drainer's (one thread each);
* the drainer's ``basic_publish_deferred`` (drainer mode: one thread, ten and a
  hundred, a channel each; legacy mode: one thread), each publisher checking its
  futures as they settle, oldest first, as a streaming publisher does (``Settling``:
  held while outstanding only);
* pika's ``SelectConnection``: publishes in its ioloop, streaming confirms, at most
  5,000 unconfirmed; pika's ``BlockingConnection`` with ``confirm_delivery`` (a round
  trip per message);
* aio-pika: ``asyncio.gather`` of 1,000 confirmed publishes, in a loop;
* amqpstorm ``confirm_deliveries`` (a round trip per message);
* kombu ``Producer.publish`` with ``confirm_publish``: stock kombu, the drainer's
  transport, and the drainer's ``confirm_publish="deferred"`` (futures checked as above).

Every run happens in a thread of its own, not the main thread, as a publisher in an app
does (in drainer mode a thread other than the main one reads its own confirm while the
drainer is idle; the main thread leaves the reading to the drainer).

A client that is not installed shows "not installed". Hard checks only: every confirm
is an ack. Every wait is bounded (``TIMEOUT``), every connection closed.

Run: ``pytest tests/benchmarks/bench_confirms.py -m benchmark -s``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import statistics
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import amqp
import kombu
import pytest
from amqp import Message, spec
from amqp.serialization import dumps
from support.broker import BROKER_HOST, unique_name

from benchmarks import QUICK, connect
from benchmarks.report import Collector, Section, fmt_ratio

pytestmark = pytest.mark.benchmark

ROUNDS = 1 if QUICK else 2
WINDOW = 0.5 if QUICK else 1.5  # seconds of publishing per run
BODY = b"x" * 64
CEILING_UNCONFIRMED = 20_000
TIMEOUT = 10.0  # seconds any one connect or wait may take
PIKA_UNCONFIRMED = 5_000
PIKA_BATCH = 100  # publishes per ioloop callback
GATHER = 1_000  # aio-pika publishes per asyncio.gather
STOCK = "stock py-amqp basic_publish_confirm, 1 thread"
STOCK_KOMBU = "stock kombu Producer.publish confirm_publish, 1 thread"
#: The module each optional client's rows need.
OPTIONAL = {"pika": "pika", "aio-pika": "aio_pika", "amqpstorm": "amqpstorm"}


def _split(host: str) -> tuple[str, int]:
    """``"host:port"`` as ``(host, port)``."""
    name, _, port = host.partition(":")
    return name, int(port or 5672)


def _frames(channel: int, routing_key: str) -> bytes:
    """One Basic.Publish, its header and its body, encoded once."""
    method = struct.pack(">HH", *spec.Basic.Publish) + dumps("Bssbb", (0, "", routing_key, 0, 0))
    header = struct.pack(">HHQH", 60, 0, len(BODY), 0)

    def frame(kind: int, payload: bytes) -> bytes:
        return struct.pack(">BHI", kind, channel, len(payload)) + payload + b"\xce"

    return frame(1, method) + frame(2, header) + frame(3, BODY)


def run_ceiling(queue: str, host: str = BROKER_HOST, window: float = WINDOW) -> float:
    conn = amqp.Connection(host=host, connect_timeout=TIMEOUT)
    conn.connect()
    try:
        channel = conn.channel()
        channel.confirm_select()
        sock = conn.transport.sock
        one = _frames(channel.channel_id, queue)
        acked = [0]
        stop = threading.Event()

        def read_acks() -> None:
            buffer = b""
            while not stop.is_set() or acked[0] < sent:
                data = sock.recv(1 << 16)
                if not data:
                    return
                buffer += data
                while len(buffer) >= 7:
                    size = struct.unpack_from(">I", buffer, 3)[0]
                    if len(buffer) < size + 8:
                        break
                    if buffer[0] == 1 and struct.unpack_from(">HH", buffer, 7) == spec.Basic.Ack:
                        acked[0] = struct.unpack_from(">Q", buffer, 11)[0]
                    buffer = buffer[size + 8 :]

        sent = 0
        reader = threading.Thread(target=read_acks, name="ceiling-acks", daemon=True)
        reader.start()
        batch = one * 100
        start = time.perf_counter()
        deadline = start + window
        while time.perf_counter() < deadline:
            while sent - acked[0] > CEILING_UNCONFIRMED:
                time.sleep(0.0001)
            sock.sendall(batch)
            sent += 100
        stop.set()
        while acked[0] < sent:
            time.sleep(0.0001)
        took = time.perf_counter() - start
        reader.join(5)
        return sent / took
    finally:
        conn.collect()


def run_sync(kind: str, queue: str, host: str = BROKER_HOST, window: float = WINDOW) -> float:
    """One thread, a round trip per message: stock py-amqp or the drainer's."""
    if kind == "stock":
        conn = amqp.Connection(host=host, confirm_publish=True, connect_timeout=TIMEOUT)
        conn.connect()
    else:
        conn = connect("drainer", host=host, connect_timeout=TIMEOUT)
    try:
        channel = conn.channel()
        n = 0
        start = time.perf_counter()
        deadline = start + window
        while time.perf_counter() < deadline:
            channel.basic_publish_confirm(Message(BODY), routing_key=queue)
            n += 1
        return n / (time.perf_counter() - start)
    finally:
        conn.close()


class Settling:
    """One publisher's futures, each checked once it settles, oldest first, as a
    streaming publisher checks them: held only while outstanding (at most
    ``max_unconfirmed``), not hoarded until the end."""

    def __init__(self) -> None:
        self.outstanding: deque[concurrent.futures.Future[Any]] = deque()
        self.acked = 0

    def add(self, future: concurrent.futures.Future[Any]) -> None:
        outstanding = self.outstanding
        outstanding.append(future)
        while outstanding[0].done():
            self._check(outstanding.popleft())
            if not outstanding:
                return

    def finish(self) -> int:
        """Wait for the rest (bounded); the number acked, every one checked."""
        while self.outstanding:
            self._check(self.outstanding.popleft())
        return self.acked

    def _check(self, future: concurrent.futures.Future[Any]) -> None:
        assert future.result(timeout=TIMEOUT) is True, "a deferred publish was not acked"
        self.acked += 1


def run_deferred(
    mode: str, threads: int, queue: str, host: str = BROKER_HOST, window: float = WINDOW
) -> float:
    conn = connect(mode, host=host, connect_timeout=TIMEOUT)
    try:
        channels = [conn.channel() for _ in range(threads)]
        settling = [Settling() for _ in range(threads)]
        start = time.perf_counter()
        deadline = start + window

        def publish(t: int) -> None:
            channel, add = channels[t], settling[t].add
            while time.perf_counter() < deadline:
                add(channel.basic_publish_deferred(Message(BODY), routing_key=queue))

        workers = [threading.Thread(target=partial(publish, t)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        acked = sum(mine.finish() for mine in settling)
        took = time.perf_counter() - start
        return acked / took
    finally:
        conn.close()


def _pika_parameters(host: str) -> Any:
    """pika's connection parameters: guest, short timeouts, heartbeats to notice a hang."""
    import pika

    name, port = _split(host)
    return pika.ConnectionParameters(
        name,
        port,
        credentials=pika.PlainCredentials("guest", "guest"),
        heartbeat=5,
        socket_timeout=TIMEOUT,
        stack_timeout=TIMEOUT,
        blocked_connection_timeout=TIMEOUT,
    )


def run_pika_select(queue: str, host: str = BROKER_HOST, window: float = WINDOW) -> float:
    """pika's SelectConnection: the ioloop publishes in batches, at most
    ``PIKA_UNCONFIRMED`` unconfirmed, and counts the streaming acks."""
    import pika
    from pika.spec import Basic

    sent = confirmed = nacked = 0  # confirmed: the highest delivery tag settled
    start = end = 0.0
    publishing, paused = True, False
    errors: list[BaseException] = []
    channel: Any = None

    def on_open(conn: Any) -> None:
        conn.channel(on_open_callback=on_channel)

    def on_channel(ch: Any) -> None:
        nonlocal channel
        channel = ch
        ch.confirm_delivery(on_confirm, callback=lambda _frame: begin())

    def begin() -> None:
        nonlocal start
        start = time.perf_counter()
        publish()

    def publish() -> None:
        nonlocal sent, publishing, paused
        if not channel.is_open:  # closing after an error or the timeout
            return
        if time.perf_counter() >= start + window:
            publishing = False
            finish_if_done()
            return
        n = min(PIKA_BATCH, PIKA_UNCONFIRMED - (sent - confirmed))
        if n <= 0:
            paused = True  # on_confirm resumes
            return
        for _ in range(n):
            channel.basic_publish("", queue, BODY)
        sent += n
        conn.ioloop.call_later(0, publish)  # lets the ioloop read acks between batches

    def on_confirm(frame: Any) -> None:
        # RabbitMQ confirms one queue's publishes in order: multiple=True settles every
        # tag up to this one.
        nonlocal confirmed, nacked, paused
        method = frame.method
        count = method.delivery_tag - confirmed if method.multiple else 1
        if isinstance(method, Basic.Nack):
            nacked += count
        confirmed = max(confirmed, method.delivery_tag)
        if paused and sent - confirmed <= PIKA_UNCONFIRMED - PIKA_BATCH:
            paused = False
            publish()
        elif not publishing:
            finish_if_done()

    def finish_if_done() -> None:
        nonlocal end
        if confirmed == sent and not end:
            end = time.perf_counter()
            conn.close()

    def on_failed(_conn: Any, error: BaseException) -> None:
        errors.append(error)
        conn.ioloop.stop()

    def on_closed(_conn: Any, reason: BaseException) -> None:
        if not end:
            errors.append(reason)
        conn.ioloop.stop()

    def time_out() -> None:
        errors.append(TimeoutError(f"pika SelectConnection: {sent - confirmed} unconfirmed"))
        conn.ioloop.stop()

    conn = pika.SelectConnection(
        _pika_parameters(host),
        on_open_callback=on_open,
        on_open_error_callback=on_failed,
        on_close_callback=on_closed,
    )
    conn.ioloop.call_later(window + TIMEOUT, time_out)
    try:
        conn.ioloop.start()
    finally:
        try:
            if not conn.is_closed:  # stopped by an error or the timeout: close it now
                if not conn.is_closing:
                    conn.close()
                conn.ioloop.call_later(TIMEOUT, conn.ioloop.stop)
                conn.ioloop.start()
        finally:
            conn.ioloop.close()
    if errors:
        raise errors[0]
    assert nacked == 0, f"pika: {nacked} publishes nacked"
    return sent / (end - start)


def run_pika_blocking(queue: str, host: str = BROKER_HOST, window: float = WINDOW) -> float:
    """pika's BlockingConnection in confirm mode: each publish waits for its ack."""
    import pika

    conn = pika.BlockingConnection(_pika_parameters(host))
    try:
        channel = conn.channel()
        channel.confirm_delivery()
        n = 0
        start = time.perf_counter()
        deadline = start + window
        while time.perf_counter() < deadline:
            channel.basic_publish("", queue, BODY)  # raises NackError on a nack
            n += 1
        return n / (time.perf_counter() - start)
    finally:
        if conn.is_open:
            conn.close()


def run_aio_pika(queue: str, host: str = BROKER_HOST, window: float = WINDOW) -> float:
    """aio-pika: ``asyncio.gather`` of ``GATHER`` confirmed publishes, in a loop."""
    import aio_pika
    from pamqp.commands import Basic

    async def main() -> float:
        name, port = _split(host)
        conn = await aio_pika.connect(host=name, port=port, timeout=TIMEOUT)
        async with conn:
            channel = await conn.channel(publisher_confirms=True)
            exchange = channel.default_exchange
            n = 0
            start = time.perf_counter()
            deadline = start + window
            while time.perf_counter() < deadline:
                confirms = await asyncio.gather(
                    *(
                        exchange.publish(
                            aio_pika.Message(BODY), queue, mandatory=False, timeout=TIMEOUT
                        )
                        for _ in range(GATHER)
                    )
                )
                assert all(isinstance(c, Basic.Ack) for c in confirms), "aio-pika: a nack"
                n += GATHER
            return n / (time.perf_counter() - start)

    return asyncio.run(asyncio.wait_for(main(), window + TIMEOUT))


def run_amqpstorm(queue: str, host: str = BROKER_HOST, window: float = WINDOW) -> float:
    """amqpstorm with ``confirm_deliveries``: each publish waits for its ack."""
    import amqpstorm

    name, port = _split(host)
    conn = amqpstorm.Connection(name, "guest", "guest", port=port, timeout=TIMEOUT)
    try:
        channel = conn.channel()
        channel.confirm_deliveries()
        n = 0
        start = time.perf_counter()
        deadline = start + window
        while time.perf_counter() < deadline:
            if not channel.basic.publish(BODY, routing_key=queue):
                raise AssertionError("amqpstorm: a publish was nacked")
            n += 1
        return n / (time.perf_counter() - start)
    finally:
        conn.close()


def run_kombu(kind: str, queue: str, host: str = BROKER_HOST, window: float = WINDOW) -> float:
    """kombu ``Producer.publish`` with ``confirm_publish``: "stock" (kombu's pyamqp),
    "drainer", or "deferred" (the drainer's futures, each checked as it settles)."""
    url = f"amqp://guest:guest@{host}//"
    if kind == "stock":
        conn = kombu.Connection(
            url, connect_timeout=TIMEOUT, transport_options={"confirm_publish": True}
        )
    else:
        confirm = True if kind == "drainer" else "deferred"
        options = {"dedicated_drainer": True, "confirm_publish": confirm}
        conn = kombu.Connection(
            url,
            transport="drainer_amqp:Transport",
            connect_timeout=TIMEOUT,
            transport_options=options,
        )
    try:
        producer = kombu.Producer(conn.channel())
        settling = Settling()
        start = time.perf_counter()
        deadline = start + window
        n = 0
        while time.perf_counter() < deadline:
            result = producer.publish(
                BODY, routing_key=queue, timeout=TIMEOUT, confirm_timeout=TIMEOUT
            )
            if kind == "deferred":
                settling.add(result)
            n += 1
        if kind == "deferred":
            n = settling.finish()
        return n / (time.perf_counter() - start)
    finally:
        conn.release()


def in_a_thread(run: Callable[[], float]) -> float:
    """``run()`` in a new thread (not the main one); its result, or its exception."""
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append(run())
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            outcome.append(exc)

    thread = threading.Thread(target=target, name="bench-confirms-publisher")
    thread.start()
    thread.join(WINDOW + 6 * TIMEOUT)
    assert not thread.is_alive(), "a confirmed-publishing run did not end"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return float(outcome[0])


def _installed(row: str) -> bool:
    """Whether the client a row measures can be imported."""
    client = row.split()[0]
    return client not in OPTIONAL or importlib.util.find_spec(OPTIONAL[client]) is not None


def test_confirmed_publishing(bench_report: Collector) -> None:
    began = time.perf_counter()
    queue = unique_name("drainer-bench-confirms")
    admin = connect("drainer")
    admin.channel().queue_declare(queue, auto_delete=False, arguments={"x-max-length": 1000})
    runs: dict[str, list[float]] = {}
    cases: dict[str, Callable[[], float]] = {
        "raw socket, confirm mode (ceiling)": partial(run_ceiling, queue),
        STOCK: partial(run_sync, "stock", queue),
        "drainer basic_publish_confirm, 1 thread": partial(run_sync, "drainer", queue),
        "drainer basic_publish_deferred, 1 thread": partial(run_deferred, "drainer", 1, queue),
        "drainer basic_publish_deferred, 10 threads": partial(run_deferred, "drainer", 10, queue),
        "drainer basic_publish_deferred, 100 threads": partial(run_deferred, "drainer", 100, queue),
        "legacy basic_publish_deferred, 1 thread": partial(run_deferred, "legacy", 1, queue),
        "pika SelectConnection, streaming confirms (window 5,000), 1 thread": partial(
            run_pika_select, queue
        ),
        "pika BlockingConnection confirm_delivery, 1 thread": partial(run_pika_blocking, queue),
        "aio-pika, gather of 1,000 publishes, 1 thread": partial(run_aio_pika, queue),
        "amqpstorm confirm_deliveries, 1 thread": partial(run_amqpstorm, queue),
        STOCK_KOMBU: partial(run_kombu, "stock", queue),
        "drainer kombu Producer.publish confirm_publish, 1 thread": partial(
            run_kombu, "drainer", queue
        ),
        "drainer kombu Producer.publish confirm_publish='deferred', 1 thread": partial(
            run_kombu, "deferred", queue
        ),
    }
    names = [name for name in cases if _installed(name)]
    try:
        for i in range(ROUNDS):
            for name in names if i % 2 == 0 else names[::-1]:
                runs.setdefault(name, []).append(in_a_thread(cases[name]))
    finally:
        admin.channel().queue_delete(queue)
        admin.close()
    rate = {name: statistics.median(values) for name, values in runs.items()}
    ceiling = rate["raw socket, confirm mode (ceiling)"]
    rows = [
        [
            name,
            f"{rate[name]:,.0f}",
            f"{100 * rate[name] / ceiling:.0f}%",
            fmt_ratio(rate[name] / rate[STOCK]),
            fmt_ratio(rate[name] / rate[STOCK_KOMBU]),
        ]
        if name in rate
        else [name, "not installed", "-", "-", "-"]
        for name in cases
    ]
    bench_report.add(
        Section(
            key="confirms",
            title="G. Confirmed publishing (64-byte bodies, one connection)",
            headers=[
                "client",
                "confirmed msg/s",
                "of the ceiling",
                "over stock py-amqp",
                "over stock kombu",
            ],
            rows=rows,
            notes=[
                f"{ROUNDS} interleaved round(s) of {WINDOW:g} s each; the median per row.",
                "Confirmed msg/s: messages acked over the time from the first publish to "
                "the last ack. The queue keeps its last 1,000 messages (x-max-length).",
                "Over stock py-amqp / kombu: this row's rate over the stock py-amqp "
                "basic_publish_confirm row / the stock kombu Producer.publish row.",
                "pika, aio-pika, amqpstorm: default exchange, one channel, publisher "
                "confirms; a client not installed shows 'not installed'.",
            ],
            raw={
                "msg_s": rate,
                "rounds": runs,
                "not_installed": [n for n in cases if n not in rate],
            },
            seconds=time.perf_counter() - began,
            order=15,
        )
    )
