"""FairRLock alone: first come, first served; re-entrant; timeouts leave no trace.

Every wait has a deadline: a broken lock fails these tests, never hangs them."""

from __future__ import annotations

import threading
from functools import partial

import pytest
from support.broker import JOIN, wait_until

from drainer_amqp.sync import FairRLock


def queued(lock: FairRLock, n: int) -> bool:
    return len(lock._waiters) == n


def test_waiters_get_the_lock_in_arrival_order() -> None:
    lock = FairRLock()
    order: list[int] = []
    lock.acquire()
    threads = []
    for i in range(8):

        def take(i: int = i) -> None:
            if lock.acquire(timeout=JOIN):
                order.append(i)
                lock.release()

        t = threading.Thread(target=take, daemon=True)
        t.start()
        threads.append(t)
        # Each thread must be queued before the next starts: wait until it is.
        assert wait_until(partial(queued, lock, i + 1), JOIN, interval=0.001), i
        assert lock.contended
    # The releasing thread would win an unfair lock back at once; here it queues.
    lock.release()
    assert lock.acquire(timeout=JOIN), "the lock was never handed back"
    order.append(-1)
    lock.release()
    for t in threads:
        t.join(JOIN)
        assert not t.is_alive()
    assert order == [0, 1, 2, 3, 4, 5, 6, 7, -1]
    assert not lock.contended


def test_reentrant_and_owned() -> None:
    lock = FairRLock()
    with lock, lock:
        assert lock.acquire(blocking=False)
        lock.release()
    with pytest.raises(RuntimeError):
        lock.release()


def test_a_timed_out_waiter_leaves_the_queue() -> None:
    lock = FairRLock()
    lock.acquire()
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(lock.acquire(timeout=0.05)), daemon=True)
    t.start()
    t.join(JOIN)
    assert result == [False]
    assert not lock._waiters
    assert not lock.contended
    lock.release()
    assert lock.acquire(blocking=False)
    lock.release()
