"""The inbox alone: a thread asleep in ``wait()`` wakes for the next callback, however
earlier waits ended; callbacks run once, in arrival order.

Every wait has a deadline: a lost wake-up fails these tests, never hangs them."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

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


class _FlagsSetAtThePop(deque):  # type: ignore[type-arg]
    """The inbox's queue, whose ``popleft()`` first runs ``hook``: the reading thread
    sets a flag just as a take, which found none set, pops without the lock."""

    def __init__(self) -> None:
        super().__init__()
        self.hook: Callable[[], None] = lambda: None

    def popleft(self) -> Any:
        self.hook()
        return super().popleft()


def test_a_take_sees_the_flags_set_as_it_pops() -> None:
    """A take that found neither flag set pops without the lock; a flag set meanwhile
    is still handled: the drainer, leaving the socket unread until the consumer has
    caught up, is told when the queue empties, and reading resumes once a full queue
    has drained to half. Missed, the drainer would stay paused (a consumer that never
    gets another delivery)."""
    emptied: list[bool] = []
    inbox = Inbox(limit=2, on_empty=lambda: emptied.append(True))
    inbox._items = items = _FlagsSetAtThePop()  # type: ignore[assignment]
    inbox.post(None, lambda: None)

    def defer() -> None:
        inbox.wake_when_empty = True

    items.hook = defer
    assert inbox.run_one(None)
    assert emptied == [True], "the queue emptied unseen while the drainer deferred reading"
    assert not inbox.wake_when_empty

    room: list[bool] = []
    inbox = Inbox(limit=2, on_room=lambda: room.append(True))
    inbox._items = items = _FlagsSetAtThePop()  # type: ignore[assignment]
    inbox.post(None, lambda: None)

    def fill() -> None:
        items.hook = lambda: None
        inbox.post(None, lambda: None)  # the limit: full, the drainer pauses
        assert inbox.full

    items.hook = fill
    assert inbox.run_one(None)
    assert room == [True] and not inbox.full, "a full queue drained to half unseen"
