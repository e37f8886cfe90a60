"""The wire vocabulary: what ranks (and ringrun) say to each other, shared by every floor.

The collective kinds (`Kind`), a request's `Signature` (what every rank must agree on), one
rank's `Message` of a negotiation cycle and the `Response` that says what runs, the names of
unnamed and numbered requests, and where a request's buffers live (`HOST`, `GPU`); and what
ringrun and its ranks exchange that is no setting: the rank events' names, and the variables
ringrun (or its per-rank wrapper) sets for the ranks (`RINGPLUG_RESTART`, ...). The settings a
user gives (`RINGPLUG_TIMEOUT`, ...) are declared in `ringplug.config`. Standard library
only: the core and ringrun both import it, and ringrun's side loads no numpy.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

# Where a request's buffers live (`Signature.place`): host memory or GPU memory (NCCL).
HOST, GPU = 0, 1


class Kind(enum.IntEnum):
    """The collectives the engine runs (ERROR: a rank rejected its own arguments)."""

    ERROR = 0
    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    REDUCESCATTER = 4
    ALLTOALL = 5
    BARRIER = 6
    BROADCAST_OBJECT = 7
    ALLGATHER_OBJECT = 8
    ADASUM = 9

    @property
    def label(self) -> str:
        return self.name.lower()


UNNAMED = "noname."  # the prefix of unnamed requests' names


def numbered(name: str) -> tuple[str, int] | None:
    """(prefix, number) of a name numbered in call order ("noname.12" or "group#12"), or
    None for a name given by the program."""
    if name.startswith(UNNAMED):
        cut = len(UNNAMED)
    else:
        cut = name.rfind("#") + 1
        if not cut:
            return None
    digits = name[cut:]
    if not (digits.isdigit() and digits.isascii()) or (digits[0] == "0" and len(digits) > 1):
        return None
    return name[:cut], int(digits)


class Signature(NamedTuple):
    """What must be equal on every rank for a request to run. For allgather and alltoall
    `shape` holds the dimensions after the first, which may differ between ranks. A grouped
    allreduce has `shape` (total elements,) and the shape of each of its tensors in `parts`.
    `place` is HOST or GPU: ranks must agree on it too. (A tuple: built for every request,
    so it must be cheap.)"""

    kind: Kind
    code: int = -1
    op: int = -1
    root: int = -1
    shape: tuple[int, ...] = ()
    parts: tuple[tuple[int, ...], ...] = ()
    place: int = HOST
    # Fail on every rank when a rank has joined, instead of running without its share
    # (Horovod's semantics for allgather and broadcast; ringplug's own callers leave it off).
    refuse_joined: bool = False


@dataclasses.dataclass
class Message:
    """One rank's contribution to a cycle."""

    cycle: int
    cached: int = 0  # bit s set: the request in cache slot s is ready here
    # (slot, number): the request named prefix + number, of the prefix and signature in
    # cache slot `slot`, is ready here (requests numbered in call order, see `numbered`).
    numbered: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    new: list[tuple[str, Signature, int]] = dataclasses.field(default_factory=list)
    # `new` entries: (name, signature, extra); extra is the first dimension of an
    # allgather/alltoall or the byte length of an object, else 0.
    joined_cycle: int = 0  # > 0: the cycle in which this rank joined
    shutdown: bool = False
    stall_abort: list[str] = dataclasses.field(default_factory=list)  # rank 0's verdict
    # Rank 0 saw a stall: these ranks show their stacks, every rank its flight record.
    report: list[int] = dataclasses.field(default_factory=list)
    renew: bool = False  # a collective was abandoned here: every rank renews its communicator
    activity: tuple[str, float] = ("", 0.0)  # the training's phase, seconds in it (activity.py)
    eager: bytes | memoryview = b""  # the data of small allreduces it carries (eager.py)


@dataclasses.dataclass(slots=True)
class Response:
    """A request every active rank has ready, with matching signatures: run it. (Slots: a
    burst of tensors makes one per tensor per cycle.)"""

    name: str
    signature: Signature
    extras: list[int]  # per rank (0 for joined ranks that do not have the request)
    have: list[bool]  # per rank: whether that rank submitted it (joined ranks may not)

    @classmethod
    def everywhere(cls, name: str, signature: Signature, ranks: int) -> Response:
        """A request that every one of `ranks` ranks submitted alike (a repeated step).
        Its `extras` and `have` are shared by every such response: nothing changes them."""
        shared = _EVERYWHERE.get(ranks)
        if shared is None:
            shared = _EVERYWHERE[ranks] = ([0] * ranks, [True] * ranks)
        return cls(name, signature, *shared)


_EVERYWHERE: dict[int, tuple[list[int], list[bool]]] = {}


def cacheable_name(name: str) -> bool:
    """Whether the negotiation cache may learn a request of this name: given names, but not
    numbered ones ("torch.default#12", used once). Decided from the name alone, so that a
    joined rank, which sees only the names, learns the same slots as the others."""
    return not name.startswith(UNNAMED) and "#" not in name


# ------------------------------------------------------------------------ rank events
EVENTS_VARIABLE = "RINGPLUG_RUN_EVENTS"
"""The job's event token; a rank or wrapper writes event lines only when it is set."""

EVENT_MARK = "ringrun-event:"
"""An event line reads ``ringrun-event:<token> {json}`` on the rank's stderr."""

STARTED = "started"  # the wrapper started the rank's program
EXITED = "exited"  # how the rank's program ended
FAULT = "fault"  # a rank ended by ringplug, naming the ranks that caused it (core.log.end_job)
OUTPUT = "output"  # rank 0's terminal output, as raw bytes
STACKS = "stacks"  # a rank's Python stacks (core.log.event and the wrapper)
FLIGHT = "flight"  # a rank's last collectives (core.log.event)

# ------------------------------------------------------ variables ringrun sets for the ranks
TERMINAL_VARIABLE = "RINGPLUG_RUN_TERMINAL"
"""Rank 0's terminal (its size and kind) when ringrun runs in one."""

RESTART_VARIABLE = "RINGPLUG_RESTART"
"""Which start of an elastic job this is: 0 on the first start, 1 on the first restart."""

JOB_ID_VARIABLE = "RINGPLUG_JOB_ID"
"""The same in every start of one elastic ringrun job."""

STACKS_DIR_VARIABLE = "RINGPLUG_STACKS_DIR"
"""The folder where the wrapper asks its rank to write its stacks."""

THREADS_VARIABLE = "RINGPLUG_RUN_THREADS"
"""The ``OMP_NUM_THREADS`` the wrapper gave its rank (the user gave none): a value of
ringrun's, that the rank's thread split may refine, where the user's is left alone."""

FAULT_FILE = "fault.json"
"""In that folder: the rank's fault event, which the wrapper relays when the rank has
ended, in case the program's stderr never reached it (pytest captures file descriptor 2)."""

INTERNAL_PREFIXES = ("RINGPLUG_RUN_", "PMI_", "PMIX_", "OMPI_COMM_WORLD_")
"""Variables ringrun and the MPI launcher set for every rank: a user's value would break the
job (ranks that do not know who they are, or whose reports ringrun cannot read)."""

# What ringrun sets that a program may read (docs/configuration.md's second table).
SET_BY_RINGRUN = (
    (
        RESTART_VARIABLE,
        "which start of an elastic job this is: 0 on the first start, 1 on the first restart, ...",
    ),
    (JOB_ID_VARIABLE, "the same in every start of one elastic job"),
)
