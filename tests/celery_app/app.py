"""The worker's app: ``celery -A celery_app.app worker -Q <queue> ...`` (cwd ``tests/``).

Configured from the environment, settings only:

``DRAINER_TEST_BROKER_URL``   broker URL (``amqp://...``; default the local RabbitMQ)
``DRAINER_TEST_QUEUE``        the queue, unique per test (also pass ``-Q``)
``DRAINER_TEST_BACKEND``      result backend (default ``rpc://``)
``DRAINER_TEST_PROBE``        file the consumer bootstep appends JSON lines to (optional)
``DRAINER_TEST_QUEUE_TYPE``   ``classic`` (default) or ``quorum`` (the cluster tests)

SIGUSR2 makes any process of the worker (the pool's children inherit the handler) write
every thread's stack to its stderr, the worker's log: what a stuck shutdown waits on.
"""

from __future__ import annotations

import faulthandler
import os
import signal

from celery_app import build_app

faulthandler.register(signal.SIGUSR2, all_threads=True)

app = build_app(
    os.environ.get("DRAINER_TEST_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//"),
    os.environ.get("DRAINER_TEST_QUEUE", "drainer-test-celery"),
    transport_options={"dedicated_drainer": True},
    result_backend=os.environ.get("DRAINER_TEST_BACKEND", "rpc://"),
    probe_file=os.environ.get("DRAINER_TEST_PROBE") or None,
    task_default_queue_type=os.environ.get("DRAINER_TEST_QUEUE_TYPE", "classic"),
)
