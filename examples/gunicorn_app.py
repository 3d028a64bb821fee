"""A WSGI app for gunicorn's ``gthread`` worker: one kombu connection per process.

Every request publishes one message (with a publisher confirm, unless ``APP_CONFIRMS=0``)
to ``APP_QUEUE``. All request threads of a worker share one kombu connection; each thread
publishes on its own channel (a thread-local ``Producer``). A consumer thread drains the
same connection (``drain_events(timeout=1)`` in a loop), consuming a per-process queue of
control events.

In legacy mode (``DRAINER_MODE=legacy``) that consumer holds the socket for up to its
drain timeout, so a request's publish may wait up to 1 s; in drainer mode
(``DRAINER_MODE=drainer``, the default) the drainer thread reads the socket and
publishes never wait behind the consumer.

For comparison (the benchmarks use them), four more modes:

* ``stock-lock``: a stock kombu connection (kombu's pyamqp transport) shared behind one
  ``threading.RLock``, held around each publish (with its confirm wait, if any) and around
  each of the consumer's reads; the consumer reads for at most ``LOCKED_DRAIN_TIMEOUT`` at
  a time, so a publish waits at most that long behind it;
* ``per-thread``: a stock kombu connection per request thread (each thread reads its own
  confirms on its own socket: nothing shared, no hand-over between threads), and the
  consumer thread on one more, read as in ``stock-lock`` under a lock only the exit takes;
* ``amqpstorm``: one amqpstorm connection (its own IO thread), a channel per request
  thread with ``confirm_deliveries()`` (without it when ``APP_CONFIRMS=0``), and a
  consumer thread in ``start_consuming()``;
* ``none``: no AMQP at all; ``/publish`` only answers (the baseline).

Run (from the repository root)::

    DRAINER_MODE=drainer AMQP_URL=amqp://guest:guest@127.0.0.1:5672// APP_QUEUE=demo \\
        python -m gunicorn -k gthread --threads 8 -w 2 -b 127.0.0.1:8000 examples.gunicorn_app:app

Environment:

``DRAINER_MODE``  ``drainer`` (default), ``legacy``, ``stock-lock``, ``per-thread``,
                  ``amqpstorm`` or ``none``.
``AMQP_URL``      broker URL (default ``amqp://guest:guest@127.0.0.1:5672//``).
``APP_QUEUE``     queue the requests publish to; declared on start, never deleted here.
``APP_CONFIRMS``  ``1`` (default): each publish waits for its publisher confirm, so a
                  request answers ``200`` only once the broker has the message; ``0``: no
                  confirms in any mode (kombu's ``confirm_publish`` off; amqpstorm's
                  channels without ``confirm_deliveries()``), a ``200`` once the message
                  is handed to the connection.
``PRELOAD_CONNECT=1``  also connect at import time and declare the queue, so that with
                  ``--preload`` the gunicorn master has a live connection (and a running
                  drainer thread) when it forks the workers (drainer and legacy modes).
                  Workers never use the master's connection: each process connects for
                  itself on first use.

Endpoints: ``GET /publish`` (publish one message, ``200 published by <pid>``) and
``GET /health`` (connect if needed; JSON with the pid, the mode, ``confirms`` and the
drainer's state).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import kombu
from kombu import Consumer, Producer, Queue

import drainer_amqp

logger = logging.getLogger("gunicorn_app")

MODES = ("drainer", "legacy", "stock-lock", "per-thread", "amqpstorm", "none")
MODE = os.environ.get("DRAINER_MODE", "drainer")
if MODE not in MODES:
    raise ValueError(f"DRAINER_MODE must be one of {MODES}, not {MODE!r}")
AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
QUEUE = os.environ.get("APP_QUEUE", "gunicorn-example")
_CONFIRMS = os.environ.get("APP_CONFIRMS", "1")
if _CONFIRMS not in ("0", "1"):
    raise ValueError(f"APP_CONFIRMS must be 0 or 1, not {_CONFIRMS!r}")
CONFIRMS = _CONFIRMS == "1"  # publisher confirms on every publish
DRAIN_TIMEOUT = 1.0  # the consumer thread's drain_events(timeout=...)
LOCKED_DRAIN_TIMEOUT = 0.05  # stock-lock: the consumer's read under the lock
HEARTBEAT = 10


def connect(role: str) -> kombu.Connection:
    """A kombu connection, connected, the work queue declared: on drainer-amqp's
    transport, or kombu's stock one in ``stock-lock`` and ``per-thread`` modes.

    Publishes are confirmed (``confirm_publish``) unless ``APP_CONFIRMS=0``: a request
    answers ``200`` only once the broker has the message. The connection is named after
    the process, so it can be found on the broker
    (``rabbitmqctl list_connections user_provided_name``)."""
    options: dict[str, Any] = {
        "confirm_publish": CONFIRMS,
        "client_properties": {"connection_name": f"{QUEUE}:{role}:{os.getpid()}"},
    }
    if MODE in ("stock-lock", "per-thread"):
        conn = kombu.Connection(AMQP_URL, transport_options=options, heartbeat=HEARTBEAT)
    else:
        options["dedicated_drainer"] = MODE == "drainer"
        conn = kombu.Connection(
            AMQP_URL,
            transport="drainer_amqp:Transport",
            transport_options=options,
            heartbeat=HEARTBEAT,
        )
    conn.ensure_connection(max_retries=3)
    channel = conn.channel()
    try:
        work_queue(channel).declare()
    finally:
        channel.close()
    return conn


def work_queue(channel: Any = None) -> Queue:
    return Queue(QUEUE, durable=False, auto_delete=False, channel=channel)


class ProcessState:
    """This process's connection, its consumer thread and the request threads' producers.

    Created lazily by the first request of each process (so it is safe with gunicorn's
    ``--preload``: nothing made before the fork is used after it). In ``stock-lock``
    mode ``self.lock`` serialises every use of the connection; in ``per-thread`` mode
    ``self.conn`` is the consumer thread's alone, and each request thread publishes on
    a connection of its own."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.conn = connect("worker")
        self.lock: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if MODE == "stock-lock" else contextlib.nullcontext()
        )
        # Guards the consumer's reads and close(): a stock connection must not be closed
        # under another thread's read. In per-thread mode the consumer's connection is
        # its own, and the request threads' are theirs.
        self.consumer_lock = threading.RLock() if MODE == "per-thread" else self.lock
        stock = MODE in ("stock-lock", "per-thread")
        self.drain_timeout = LOCKED_DRAIN_TIMEOUT if stock else DRAIN_TIMEOUT
        self.local = threading.local()
        self.own_conns: list[kombu.Connection] = []  # per-thread mode: to release at exit
        self._own_conns_lock = threading.Lock()  # guards own_conns
        self.stopping = threading.Event()
        self.events_received = 0
        events = Queue(
            f"{QUEUE}.events.{self.pid}", durable=False, exclusive=True, auto_delete=True
        )
        self._consumer_channel = self.conn.channel()
        self._consumer = Consumer(
            self._consumer_channel, queues=[events], callbacks=[self._on_event]
        )
        self._consumer.consume()
        self.consumer_thread = threading.Thread(
            target=self._drain_loop, name=f"app-consumer-{self.pid}", daemon=True
        )
        self.consumer_thread.start()

    def _on_event(self, body: Any, message: Any) -> None:
        self.events_received += 1
        message.ack()

    def _drain_loop(self) -> None:
        conn = self.conn
        while not self.stopping.is_set():
            try:
                with self.consumer_lock:
                    conn.drain_events(timeout=self.drain_timeout)
            except TimeoutError:
                continue
            except drainer_amqp.ConnectionClosedIntentionally:
                return  # shutdown
            except conn.connection_errors:
                if self.stopping.is_set():
                    return
                logger.exception("consumer connection failed; this worker stops consuming")
                return

    def producer(self) -> Producer:
        """This request thread's producer, on a channel of its own."""
        producer = getattr(self.local, "producer", None)
        if producer is None:
            if MODE == "per-thread":
                conn = connect(f"thread-{threading.get_ident()}")
                with self._own_conns_lock:
                    self.own_conns.append(conn)
                producer = Producer(conn.channel())
            else:
                with self.lock:
                    producer = Producer(self.conn.channel())
            self.local.producer = producer
        return producer

    def publish(self, body: str) -> None:
        producer = self.producer()
        with self.lock:
            producer.publish(body, routing_key=QUEUE)

    def health(self) -> dict[str, Any]:
        raw = self.conn.connection
        stats = raw.drainer_stats() if hasattr(raw, "drainer_stats") else {}
        return {
            "pid": self.pid,
            "mode": MODE,
            "confirms": CONFIRMS,
            "connected": bool(raw.connected),
            "drainer_running": bool(stats.get("running")),
            "consumer_alive": self.consumer_thread.is_alive(),
            "inherited_connected": inherited_connected(),
        }

    def close(self) -> None:
        """Stop the consumer thread and close the connection (process exit)."""
        self.stopping.set()
        try:
            with self.consumer_lock:  # stock: never close under the consumer's read
                self.conn.connection.close()  # wakes the consumer thread at once
        except Exception:  # noqa: BLE001 - best effort at exit
            logger.debug("close failed", exc_info=True)
        self.consumer_thread.join(DRAIN_TIMEOUT + 5)
        self.conn.release()
        with self._own_conns_lock:
            own = list(self.own_conns)
        for conn in own:  # per-thread mode: the request threads' connections
            conn.release()


class AmqpstormState:
    """``amqpstorm`` mode: one amqpstorm connection per process, a channel per request
    thread (confirming unless ``APP_CONFIRMS=0``), and a consumer thread in
    ``start_consuming()`` (the same lifecycle as :class:`ProcessState`)."""

    def __init__(self) -> None:
        import amqpstorm

        url = urlsplit(AMQP_URL)
        self.pid = os.getpid()
        self.conn = amqpstorm.Connection(
            url.hostname or "127.0.0.1",
            url.username or "guest",
            url.password or "guest",
            port=url.port or 5672,
            heartbeat=HEARTBEAT,
            client_properties={"connection_name": f"{QUEUE}:worker:{self.pid}"},
        )
        self.local = threading.local()
        channel = self.conn.channel()
        channel.queue.declare(QUEUE, durable=False, auto_delete=False)
        events = f"{QUEUE}.events.{self.pid}"
        channel.queue.declare(events, durable=False, exclusive=True, auto_delete=True)
        channel.basic.consume(lambda message: message.ack(), events)
        self._consumer_channel = channel
        self.consumer_thread = threading.Thread(
            target=channel.start_consuming, name=f"app-consumer-{self.pid}", daemon=True
        )
        self.consumer_thread.start()

    def publish(self, body: str) -> None:
        channel = getattr(self.local, "channel", None)
        if channel is None:
            channel = self.conn.channel()
            if CONFIRMS:
                channel.confirm_deliveries()
            self.local.channel = channel
        confirmed = channel.basic.publish(body, routing_key=QUEUE)  # None without confirms
        if CONFIRMS and not confirmed:
            raise RuntimeError("the broker did not confirm the message")

    def health(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "mode": MODE,
            "confirms": CONFIRMS,
            "connected": bool(self.conn.is_open),
            "consumer_alive": self.consumer_thread.is_alive(),
            "inherited_connected": inherited_connected(),
        }

    def close(self) -> None:
        self._consumer_channel.stop_consuming()
        self.consumer_thread.join(DRAIN_TIMEOUT + 5)
        self.conn.close()


_lock = threading.Lock()
_state: ProcessState | AmqpstormState | None = None
_preloaded: kombu.Connection | None = None  # the master's connection, PRELOAD_CONNECT=1


def _reinit_lock_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at fork time


os.register_at_fork(after_in_child=_reinit_lock_in_child)


def state() -> ProcessState | AmqpstormState:
    """This process's state, created on first use (never one inherited through fork)."""
    global _state
    current = _state
    if current is not None and current.pid == os.getpid():
        return current
    with _lock:
        if _state is None or _state.pid != os.getpid():
            _state = AmqpstormState() if MODE == "amqpstorm" else ProcessState()
        return _state


def inherited_connected() -> bool | None:
    """Whether the connection made at import (before a fork) looks connected here.

    In the master that made it: True. In a forked worker: False, because drainer-amqp
    marks connections inherited through fork as lost (they belong to the parent)."""
    if _preloaded is None:
        return None
    raw = _preloaded._connection
    return bool(raw is not None and raw.connected)


@atexit.register
def _close_at_exit() -> None:
    pid = os.getpid()
    if _state is not None and _state.pid == pid:
        _state.close()
    if _preloaded is not None and _preload_pid == pid:
        _preloaded.release()


_preload_pid = os.getpid()
if os.environ.get("PRELOAD_CONNECT") == "1" and MODE in ("drainer", "legacy"):
    _preloaded = connect("preload")


Response = tuple[str, list[tuple[str, str]], bytes]


def _handle(path: str) -> Response:
    if MODE == "none" and path == "/publish":  # the no-AMQP baseline
        return "200 OK", [("Content-Type", "text/plain")], f"answered by {os.getpid()}\n".encode()
    if MODE == "none" and path == "/health":
        body = json.dumps({"pid": os.getpid(), "mode": MODE, "confirms": CONFIRMS}).encode()
        return "200 OK", [("Content-Type", "application/json")], body
    if path == "/publish":
        st = state()
        st.publish(f"{st.pid}:{threading.get_ident()}")
        return "200 OK", [("Content-Type", "text/plain")], f"published by {st.pid}\n".encode()
    if path == "/health":
        body = json.dumps(state().health()).encode()
        return "200 OK", [("Content-Type", "application/json")], body
    return "404 Not Found", [("Content-Type", "text/plain")], b"not found\n"


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    try:
        status, headers, body = _handle(environ.get("PATH_INFO", "/"))
    except Exception as exc:  # noqa: BLE001 - report to the client, log for the operator
        logger.exception("request failed")
        status, headers = "500 Internal Server Error", [("Content-Type", "text/plain")]
        body = f"{type(exc).__name__}: {exc}\n".encode()
    headers.append(("Content-Length", str(len(body))))
    start_response(status, headers)
    return [body]
