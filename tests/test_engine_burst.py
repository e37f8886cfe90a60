"""`Scheduler.let_burst_finish`: the engine thread steps aside while a burst of asynchronous
submissions goes on, and not once it is over (its caller waits) or the wait is used up.
(An engine that missed the end would look until the 5 s deadline, and fail the count.)"""

from __future__ import annotations

import collections
import math
import time
from types import SimpleNamespace

from ringplug.core.engine.scheduler import _BURST_LEAST, Scheduler


class Queue(collections.deque):
    """The engine's queue, counting how often the engine looks at its newest request; at
    the `ends_at`-th look the submitting thread begins to wait for its handles."""

    def __init__(self, owner: SimpleNamespace, ends_at: int) -> None:
        super().__init__()
        self.owner, self.ends_at, self.looks = owner, ends_at, 0

    def __getitem__(self, index):
        self.looks += 1
        if self.looks == self.ends_at:
            self.owner.waited_at = math.inf  # later than any submission
        return super().__getitem__(index)


def scheduler_with_a_burst(
    ends_at: int, queued: int = _BURST_LEAST
) -> tuple[SimpleNamespace, Queue]:
    engine = SimpleNamespace(waited_at=0.0)
    engine.queue = Queue(engine, ends_at)
    # Submitted "in the future": always younger than the gap, whatever the machine's load.
    submitted = time.perf_counter() + 3600.0
    engine.queue.extend(SimpleNamespace(submitted=submitted) for _ in range(queued))
    return engine, engine.queue


def test_the_engine_steps_aside_until_the_submitting_thread_waits():
    engine, queue = scheduler_with_a_burst(ends_at=3)
    Scheduler.let_burst_finish(engine, deadline=time.perf_counter() + 5.0)
    # Two looks found the burst going on (each followed by a yield), the third its caller
    # waiting.
    assert queue.looks == 3


def test_the_engine_does_not_step_aside_past_its_deadline_or_with_nothing_queued():
    engine, queue = scheduler_with_a_burst(ends_at=0)
    Scheduler.let_burst_finish(engine, deadline=time.perf_counter() - 1.0)
    assert queue.looks == 1
    queue.clear()
    Scheduler.let_burst_finish(engine, deadline=time.perf_counter() + 5.0)
    assert queue.looks == 1


def test_requests_whose_caller_already_waits_run_at_once():
    engine, queue = scheduler_with_a_burst(ends_at=1)
    Scheduler.let_burst_finish(engine, deadline=time.perf_counter() + 5.0)
    assert queue.looks == 1


def test_a_few_requests_are_no_burst_and_run_at_once():
    engine, queue = scheduler_with_a_burst(ends_at=0, queued=_BURST_LEAST - 1)
    Scheduler.let_burst_finish(engine, deadline=time.perf_counter() + 5.0)
    assert queue.looks == 0
