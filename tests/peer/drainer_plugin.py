"""pytest plugin: run py-amqp's and kombu's own integration suites on drainer connections.

Loaded with ``-p drainer_plugin`` (``tests/peer`` on ``PYTHONPATH``) by
``scripts/peer-suites.sh``. With ``DRAINER_PEER=1`` every ``amqp.Connection`` the suites
create is a ``drainer_amqp.Connection(dedicated_drainer=True)``, and kombu's
``pyamqp://``/``amqp://`` URLs resolve to ``drainer_amqp.Transport`` (as a kombu user
switching the drainer on would configure it: its event-loop hooks watch the inbox, not
the socket the drainer owns); the plugin counts the connections
that really ran a drainer thread and writes the count to ``DRAINER_PEER_REPORT`` (JSON).
A drainer run in which no connection ran a drainer fails.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import pytest

_started = 0
_lock = threading.Lock()  # guards _started


def _forced_drainer_class() -> Any:
    import drainer_amqp

    class ForcedDrainerConnection(drainer_amqp.Connection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["dedicated_drainer"] = True
            super().__init__(*args, **kwargs)

        def connect(self, callback: Any = None) -> Any:
            result = super().connect(callback)
            if self.drainer_stats()["running"]:
                global _started
                with _lock:
                    _started += 1
            return result

    return ForcedDrainerConnection


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("DRAINER_PEER") != "1":
        return
    import amqp
    import amqp.connection
    from kombu import transport as kombu_transports
    from kombu.transport import pyamqp

    import drainer_amqp

    forced = _forced_drainer_class()
    amqp.Connection = forced  # type: ignore[misc]
    amqp.connection.Connection = forced  # type: ignore[misc]
    for cls in (pyamqp.Transport, pyamqp.SSLTransport, drainer_amqp.Transport):
        cls.Connection = forced
    for alias in ("amqp", "pyamqp"):
        kombu_transports.TRANSPORT_ALIASES[alias] = "drainer_amqp:Transport"
    kombu_transports.TRANSPORT_ALIASES["amqps"] = "drainer_amqp:SSLTransport"
    kombu_transports._transport_cache.clear()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("DRAINER_PEER") != "1":
        return
    report = os.environ.get("DRAINER_PEER_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump({"drainer_connections": _started}, f)
    if _started == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
