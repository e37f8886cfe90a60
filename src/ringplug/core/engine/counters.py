"""What an engine counts of its own work, for tests, benchmarks and the idle poll."""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass(slots=True)
class Counters:
    """Counts of one engine's cycles and collectives (only the thread holding the turn
    changes them, see `scheduler`)."""

    cycles_run: int = 0
    # Of those, run by a caller waiting for its own collective (`Scheduler.submit`, `drive`).
    cycles_by_callers: int = 0
    # Of those, cycles whose negotiation took its fast path: a lone request of an agreed
    # form, and every rank sent that same form (`Cycle.negotiate`).
    fast_cycles: int = 0
    # Of the fast cycles, those a waiting caller ran on its own thread: a synchronous call's
    # whole collective without the engine thread.
    fast_by_callers: int = 0
    # Collectives run (a fused batch counts once; so does a cycle's carried data).
    collectives_run: int = 0
    # When the last cycle that ran something ended (perf_counter): the idle engine thread
    # polls less often the longer ago it was (`waiting.next_delay`).
    last_activity: float = dataclasses.field(default_factory=time.perf_counter)
