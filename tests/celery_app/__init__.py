"""A tiny Celery app for the drainer-transport tests (worker subprocesses and producers).

:func:`build_app` makes an app configured by settings alone: the broker goes through
``drainer_amqp:Transport`` with the transport options given (``dedicated_drainer`` ...).
``celery_app.app`` builds the worker's app from environment variables (see there).

Tasks (names are fixed, so the test process and the worker agree without importing
each other):

``drainer_test.add(x, y)``
    returns ``x + y``.
``drainer_test.record(token, markers_dir)``
    appends one line (this pid) to ``markers_dir/token``: a task that ran twice leaves
    two lines. Returns where it ran: pid and the names of the process's drainer threads.
``drainer_test.slow_record(token, markers_dir, seconds)``
    writes ``token.started``, sleeps, then appends to ``token`` like ``record``: a warm
    shutdown lets it finish, a cold one would not.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from celery import Celery, bootsteps

__all__ = ["DRAINER_TRANSPORT", "ProbeStep", "build_app"]

DRAINER_TRANSPORT = "drainer_amqp:Transport"


def _drainer_thread_names() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("drainer-amqp-"))


def _append_marker(markers_dir: str, token: str) -> None:
    with open(os.path.join(markers_dir, token), "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\n")


def build_app(
    broker_url: str,
    queue: str,
    *,
    transport_options: dict[str, Any] | None = None,
    result_backend: str | None = None,
    probe_file: str | None = None,
    **settings: Any,
) -> Celery:
    """A Celery app whose broker connections use the drainer transport, by settings only.

    ``probe_file``: add :class:`ProbeStep` to the worker's consumer blueprint.
    """
    app = Celery("drainer_test", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        broker_transport=DRAINER_TRANSPORT,
        broker_transport_options=(
            {"dedicated_drainer": True} if transport_options is None else dict(transport_options)
        ),
        broker_connection_retry_on_startup=True,
        result_backend=result_backend,
        result_expires=120,  # rpc:// reply queues get x-expires: leftovers go away anyway
        task_default_queue=queue,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        worker_enable_remote_control=False,  # no pidbox queue on the shared broker
        worker_prefetch_multiplier=4,
        worker_hijack_root_logger=True,
        **settings,
    )

    @app.task(name="drainer_test.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="drainer_test.record", shared=False)
    def record(token: str, markers_dir: str) -> dict[str, Any]:
        _append_marker(markers_dir, token)
        return {"token": token, "pid": os.getpid(), "drainer_threads": _drainer_thread_names()}

    @app.task(name="drainer_test.slow_record", shared=False)
    def slow_record(token: str, markers_dir: str, seconds: float) -> dict[str, Any]:
        with open(os.path.join(markers_dir, token + ".started"), "w", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(seconds)  # the work a warm shutdown must let finish
        _append_marker(markers_dir, token)
        return {"token": token, "pid": os.getpid()}

    if probe_file:
        app.conf.drainer_test_probe_file = probe_file
        app.steps["consumer"].add(ProbeStep)
    return app


class ProbeStep(bootsteps.StartStopStep):
    """Consumer bootstep (worker main process): each time the consumer has (re)connected,
    append one JSON line to ``app.conf.drainer_test_probe_file`` describing the
    connection the worker consumes from and whether kombu's Hub watches its inbox fd."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def _write(self, c: Any, event: str) -> None:
        path = c.app.conf.drainer_test_probe_file
        info: dict[str, Any] = {"event": event, "pid": os.getpid()}
        kombu_conn = c.connection
        conn = getattr(kombu_conn, "connection", None) if kombu_conn is not None else None
        if conn is not None:
            cls = type(conn)
            info["connection_class"] = f"{cls.__module__}.{cls.__qualname__}"
            stats = conn.drainer_stats() if hasattr(conn, "drainer_stats") else {}
            info["drainer_stats"] = stats
            info["heartbeat"] = conn.heartbeat
            sock = getattr(conn, "sock", None)
            info["local_port"] = sock.getsockname()[1] if sock is not None else None
            hub = c.hub
            if hub is not None and stats.get("dedicated_drainer"):
                info["hub_watches_inbox"] = conn.inbox_fileno() in hub.readers
                info["hub_watches_socket"] = sock is not None and sock.fileno() in hub.readers
        info["drainer_threads"] = _drainer_thread_names()
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(info) + "\n")

    def start(self, c: Any) -> None:
        self._write(c, "consumer_start")

    def shutdown(self, c: Any) -> None:
        self._write(c, "consumer_shutdown")
