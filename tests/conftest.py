"""Shared fixtures: the broker, the Toxiproxy-compatible proxy, extra RabbitMQ nodes, and
leak checks."""

import signal
import sys
from collections.abc import Iterator

import pytest
from support.broker import *  # noqa: F403
from support.rabbit_nodes import *  # noqa: F403
from support.toxiproxy.fixtures import *  # noqa: F403


@pytest.fixture(params=["default", "tiny-switch-interval"])
def switching(request: pytest.FixtureRequest) -> Iterator[None]:
    """Run a concurrency test once as is, and once with the interpreter switching
    threads as often as it can, to shake out interleavings."""
    previous = sys.getswitchinterval()
    if request.param != "default":
        sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` in the main thread, as in a terminal, also when
    the suite was started in the background (a shell's ``&`` ignores SIGINT, and Python
    then keeps it ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
