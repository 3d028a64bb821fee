"""FairRLock alone: first come, first served; re-entrant; timeouts leave no trace.

Every wait has a deadline: a broken lock fails these tests, never hangs them."""

from __future__ import annotations

import signal
import sys
import threading
import time
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


def test_an_interrupted_waiter_leaves_the_queue(sigint_raises: None) -> None:
    """A ``KeyboardInterrupt`` in a thread waiting for the lock (legacy mode: the main
    thread waits for the transport lock in ``drain_events()``) leaves it as if that
    thread had never come: a later release must not hand the lock to it."""
    lock = FairRLock()
    held, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            let_go.wait(JOIN)

    def interrupt_once_queued() -> None:
        if wait_until(partial(queued, lock, 1), JOIN, interval=0.001):
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(JOIN)
    interrupter = threading.Thread(target=interrupt_once_queued, daemon=True)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        lock.acquire(timeout=JOIN)  # the main thread, as pytest runs tests
    interrupter.join(JOIN)
    assert not lock._waiters and not lock.contended
    let_go.set()
    holder.join(JOIN)
    assert not holder.is_alive()
    other: list[bool] = []
    t = threading.Thread(target=lambda: other.append(lock.acquire(timeout=JOIN)), daemon=True)
    t.start()
    t.join(JOIN)
    assert other == [True], "the lock went to the interrupted thread"


def test_no_thread_is_lost_between_a_release_and_a_waiter_queueing() -> None:
    """The owner lets go, finding nobody queued, just as a thread that saw the lock held
    queues: that thread must get the lock (its look after queueing sees it free), not
    sleep until its timeout. The interleaving is forced with the queue's mutex; a
    release that needs the mutex while nobody is queued fails the test."""
    lock = FairRLock()
    held, release = threading.Event(), threading.Event()

    def own_then_release() -> None:
        with lock:
            held.set()
            release.wait(JOIN)

    owner = threading.Thread(target=own_then_release, daemon=True)
    owner.start()
    assert held.wait(JOIN)
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(lock.acquire(timeout=JOIN)), daemon=True)
    acquire = FairRLock.acquire.__code__
    with lock._mutex:  # the waiter stops where it would queue
        waiter.start()
        assert wait_until(
            lambda: (
                getattr(sys._current_frames().get(waiter.ident or 0), "f_code", None) is acquire
            ),
            JOIN,
            interval=0.001,
        )
        release.set()  # nobody queued yet: the owner lets go without the mutex
        owner.join(JOIN / 4)
        assert not owner.is_alive(), "a release with nobody queued waited for the mutex"
    started = time.monotonic()
    waiter.join(JOIN)
    assert got == [True]
    assert time.monotonic() - started < JOIN / 2, "the waiter slept until its timeout"


def test_many_threads_take_turns_without_overlap_or_loss() -> None:
    """Eight threads take the lock 2,000 times each (some re-entrantly, some with a
    timeout that may run out), with a switch interval of a microsecond to interleave
    the unlocked fast paths: never two owners at once, nobody stuck."""
    lock = FairRLock()
    inside = [0]
    overlaps: list[int] = []
    switch = sys.getswitchinterval()

    def run(n: int) -> None:
        for i in range(2_000):
            if not lock.acquire(timeout=0.001 if i % 7 == n else JOIN):
                continue
            try:
                inside[0] += 1
                if inside[0] != 1:
                    overlaps.append(inside[0])
                if i % 5 == 0:
                    with lock:
                        pass
                inside[0] -= 1
            finally:
                lock.release()

    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN * 4)
            assert not t.is_alive(), "a thread is stuck on the lock"
    finally:
        sys.setswitchinterval(switch)
    assert not overlaps
    assert not lock._waiters and not lock.contended
    assert lock.acquire(blocking=False)
    lock.release()
