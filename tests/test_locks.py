"""FairRLock alone: first come, first served; re-entrant; timeouts leave no trace."""

from __future__ import annotations

import threading

import pytest

from drainer_amqp.sync import FairRLock


def test_waiters_get_the_lock_in_arrival_order() -> None:
    lock = FairRLock()
    order: list[int] = []
    lock.acquire()
    threads = []
    for i in range(8):

        def take(i: int = i) -> None:
            with lock:
                order.append(i)

        t = threading.Thread(target=take)
        t.start()
        threads.append(t)
        # Each thread must be queued before the next starts: wait until it is.
        while len(lock._waiters) != i + 1:
            threading.Event().wait(0.001)
    # The releasing thread would win an unfair lock back at once; here it queues.
    lock.release()
    lock.acquire()
    order.append(-1)
    lock.release()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3, 4, 5, 6, 7, -1]


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
    t = threading.Thread(target=lambda: result.append(lock.acquire(timeout=0.05)))
    t.start()
    t.join(5)
    assert result == [False]
    assert not lock._waiters
    lock.release()
    assert lock.acquire(blocking=False)
    lock.release()
