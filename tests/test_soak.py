"""The soak, short: scenario A (20 threads, every fault) in drainer mode for 30 s and
scenario B (8 retrying publishers, resets and disables) for 20 s, on one shared kombu
connection through the fault proxy. Only behaviour and hard bounds are asserted: nothing
confirmed is lost, nobody is told the connection was closed on purpose, no drainer
thread or socket is left, no thread is stuck beyond a generous bound, and every error a
caller saw is one kombu retries. The figures (stuck times, RSS slope, ...) are printed.

The seed is random unless ``SOAK_SEED`` is set; every failure message starts with the
run's summary line, which names it. Replay a failure with
``PYTHONPATH=src:tests python -m soak --seconds 30 --runs A/drainer --seed S``.

What the soak found earlier has its reproducers beside the code it concerns
(``test_connection.py``, ``test_reconnect.py``, ``test_stock_semantics.py``).
"""

from __future__ import annotations

import os
import random
from typing import Any

from soak.faults import KINDS, Broker, default_broker_ctl
from soak.run import Options, run, summary_line

#: A thread may wait this long for progress: the longest fault (a 5.5 s silent link),
#: its detection and kombu's retry intervals, many times over on two shared cores.
STUCK_BOUND = 45.0


def _seed() -> int:
    return int(os.environ.get("SOAK_SEED") or random.SystemRandom().randrange(10**6))


def _soak(scenario: str, seconds: float, toxiproxy: Any) -> dict[str, Any]:
    kinds = [k for k in KINDS if k != "memory_alarm"]  # never on the shared broker
    options = Options(seconds, _seed(), kinds, ["memory_alarm (shared broker)"])
    result = run(
        scenario, "drainer", Broker("127.0.0.1", 5672, default_broker_ctl), toxiproxy, options
    )
    print(summary_line(result))
    return result


def _assert_behaviour(result: dict[str, Any]) -> None:
    line = summary_line(result)
    assert result["faults"], f"{line}: no fault was injected"
    assert not result["fault_errors"], f"{line}: {result['fault_errors']}"
    assert result["lost"] == 0, f"{line}: lost e.g. {result['lost_sample']}"
    assert not result["hung"], f"{line}: hung:\n{result['hung_stacks']}"
    assert result["release_error"] is None, f"{line}: {result['release_error']}"
    assert result["recovered_after_last_fault"], f"{line}: {result['not_recovered']}"
    assert result["max_stuck_s"] <= STUCK_BOUND, line
    unexpected = {kind.split(": ", 1)[1] for kind in result["unexpected_errors"]}
    assert not unexpected, f"{line}: {[result['first_tracebacks'][k] for k in unexpected]}"
    assert result["connection_closed_intentionally"] == 0, line
    assert not result["threads_leaked"], f"{line}: {result['threads_leaked']}"
    assert result["fds_leaked"] == 0 and result["sockets_left"] == 0, (
        f"{line}: {result['before']} before, {result['after']} after"
    )
    assert result["left_in_queues"] == 0, line


def test_scenario_a_twenty_threads_every_fault(toxiproxy: Any) -> None:
    result = _soak("A", 30.0, toxiproxy)
    _assert_behaviour(result)
    roles = result["raised_by_role"]
    assert result["consumed_unique"] >= result["confirmed"] > 0, summary_line(result)
    assert "declare" not in roles or set(roles["declare"]) <= set(result["first_tracebacks"])


def test_scenario_b_eight_retrying_publishers_resets_and_disables(toxiproxy: Any) -> None:
    result = _soak("B", 20.0, toxiproxy)
    _assert_behaviour(result)
    assert set(result["fault_kinds"]) <= {"reset_peer", "disable"}
    assert result["confirmed"] > 0, summary_line(result)
