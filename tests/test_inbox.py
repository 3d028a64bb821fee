"""The inbox alone: a thread asleep in ``wait()`` wakes for the next callback, however
earlier waits ended; callbacks run once, in arrival order.

Every wait has a deadline: a lost wake-up fails these tests, never hangs them."""

from __future__ import annotations

import threading

from support.broker import JOIN
from support.threads import wait_until_blocked

from drainer_amqp.waits import Inbox


def sleeper(inbox: Inbox, woke: list[bool]) -> threading.Thread:
    """A thread asleep in ``inbox.wait()`` once this returns; ``woke`` gets its result.
    It sleeps for twice ``JOIN``: one that is still asleep after a ``join(JOIN)`` was
    not woken."""
    thread = threading.Thread(target=lambda: woke.append(inbox.wait(2 * JOIN)), daemon=True)
    thread.start()
    assert wait_until_blocked(thread, ["wait"]), "the thread never slept in wait()"
    return thread


def test_a_sleeping_waiter_wakes_for_a_post() -> None:
    inbox = Inbox()
    woke: list[bool] = []
    thread = sleeper(inbox, woke)
    inbox.post(None, woke.append, False)
    thread.join(JOIN)
    assert not thread.is_alive(), "the post did not wake the sleeping thread"
    assert woke == [True]
    assert inbox.run_one(None)
    assert woke == [True, False]


def test_a_waiter_after_a_timed_out_one_still_wakes() -> None:
    inbox = Inbox()
    assert not inbox.wait(0.01)  # gone: a post need wake nobody, the next sleeper yes
    inbox.post(None, lambda: None)
    assert inbox.run_one(None)
    woke: list[bool] = []
    threads = [sleeper(inbox, woke) for _ in range(3)]
    for _ in threads:  # a post wakes one sleeper
        inbox.post(None, lambda: None)
    for thread in threads:
        thread.join(JOIN)
        assert not thread.is_alive()
    assert woke == [True, True, True]


def test_the_end_wakes_every_sleeper() -> None:
    inbox = Inbox()
    woke: list[bool] = []
    threads = [sleeper(inbox, woke) for _ in range(3)]
    inbox.end()
    for thread in threads:
        thread.join(JOIN)
        assert not thread.is_alive()
    assert woke == [True, True, True]
    assert not inbox.run_one(None)


def test_callbacks_run_once_in_arrival_order_from_many_threads() -> None:
    inbox = Inbox()
    ran: list[int] = []
    for i in range(200):
        inbox.post(None, ran.append, i)
    threads = [
        threading.Thread(target=lambda: [inbox.run_one(None) for _ in range(100)], daemon=True)
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN)
    assert ran == list(range(200))
