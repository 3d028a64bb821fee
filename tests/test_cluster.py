"""A three-node RabbitMQ cluster loses the node the clients are on, mid-stream.

Publisher threads with confirms (``Producer.publish(retry=True)``) and a consumer with
manual acks (``Connection.autoretry``) go through kombu's failover URL list to a quorum
queue; the node they are on is stopped (``rabbitmqctl stop_app``) or killed (SIGKILL of
its Erlang VM). What users rely on: traffic resumes on another node within the retry
policy, every confirmed message is consumed (duplicates are allowed and reported), no
thread hangs, and (drainer) the old connection's drainer thread is gone.

``drainer``: one kombu connection shared by all threads. ``stock``: stock kombu, one
connection per thread (the baseline; see :mod:`support.failover`). The failover times
are printed (``-s``), not asserted; ``tests/benchmarks/bench_failover.py`` records them.

The cluster starts once per module; each case first restarts the node the previous one
stopped.
"""

from __future__ import annotations

import pytest
from support.failover import CLIENTS, FAULTS, FailoverResult, run_failover
from support.rabbit_nodes import RabbitCluster


@pytest.fixture
def cluster(rabbit_cluster: RabbitCluster) -> RabbitCluster:
    rabbit_cluster.ensure_running()
    return rabbit_cluster


def _check(result: FailoverResult) -> None:
    print(f"\n{result.summary()}")
    for error in result.errors:
        print(error)
    assert not result.hung, f"threads hung: {result.hung}\n{result.stacks}"
    assert not result.errors, result.errors
    assert result.t_resumed is not None, "no confirm through another node"
    assert result.new_ports and result.old_port not in result.new_ports
    lost = sorted(result.lost)
    assert not lost, f"{len(lost)} confirmed messages not consumed, e.g. {lost[:5]}"
    assert not result.old_drainer_left, "the old connection's drainer thread is still alive"
    assert result.drainers_after_release == 0, "drainer threads left after release()"


SWITCH_BUG = pytest.mark.xfail(
    strict=True,
    reason=(
        "kombu's failover switch() closes the live connection: a thread's "
        "maybe_switch_next() -> switch() -> close() closes (and detaches from its transport) "
        "the connection other threads use; they get ConnectionClosedIntentionally, or "
        "AttributeError (Consumer.__exit__: channel.connection.client is None; "
        "establish_connection: self.client is None), and confirmed messages are not consumed"
    ),
)
CASES = [
    pytest.param(client, marks=SWITCH_BUG) if client == "drainer" else client for client in CLIENTS
]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("client", CASES)
def test_losing_the_clients_node_moves_traffic_to_another(
    cluster: RabbitCluster, client: str, fault: str
) -> None:
    _check(run_failover(cluster, client, fault))
