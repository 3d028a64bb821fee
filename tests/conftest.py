"""Shared fixtures: the broker, the Toxiproxy-compatible proxy, extra RabbitMQ nodes, and
leak checks."""

from support.broker import *  # noqa: F403
from support.rabbit_nodes import *  # noqa: F403
from support.toxiproxy.fixtures import *  # noqa: F403
