"""Errors the collectives raise; each is raised on every rank taking part, never on one."""

from __future__ import annotations


class RingplugError(RuntimeError):
    """Base class of ringplug's own errors.

    `caused_by` names the other ranks whose failure this error reports (empty when the
    cause is on this rank); ringrun names them, not this rank, as the job's root cause.
    """

    def __init__(self, *args: object, caused_by: tuple[int, ...] = ()) -> None:
        super().__init__(*args)
        self.caused_by = tuple(caused_by)


class MismatchError(RingplugError, ValueError):
    """Ranks called a collective with different shapes, dtypes, ops, roots or kinds.

    Raised on every rank, with a message that names the ranks and what each submitted.
    """


class PeerArgumentError(RingplugError, ValueError):
    """Another rank rejected its own arguments to this collective (its error says why)."""


class NotInitializedError(RingplugError):
    """A collective was called before `ringplug.init()`."""


class StallError(RingplugError):
    """Some ranks waited for a collective that others never submitted, for longer than
    `RINGPLUG_STALL_SHUTDOWN_SECONDS`; raised on every rank, naming the missing ranks."""


class BarrierTimeoutError(RingplugError, TimeoutError):
    """A barrier given a timeout of its own (`barrier(timeout=...)`, torch's
    ``monitored_barrier``) was not reached by every rank in time. Raised on each rank that
    waited, naming the ranks that never arrived (`caused_by`); the others raise theirs once
    their own timeout passes."""


class MembersMissingError(RingplugError, TimeoutError):
    """A process set made by its members only (`add_process_set(members_only=True)`, torch's
    ``new_group(use_local_synchronization=True)``): some members never called to make it
    within ``RINGPLUG_TIMEOUT``. Raised on each member that did, naming the set and the
    members that never came (`caused_by`); and on a member that calls after the others gave
    up on it, naming those (`caused_by`)."""

    # Why this member gave up, in the words the set's other members are sent (so that one
    # that calls late can say it): "waited 15 s (RINGPLUG_TIMEOUT) for rank(s) 2, ...".
    withdrawal: str = ""


class PeerFailedError(RingplugError):
    """Another rank failed this collective while running it (an exception on its engine
    thread: out of memory, a read-only output, ...); the message has its error text."""


class PeerEngineFailedError(PeerFailedError):
    """Another rank's engine failed for good (an error outside any one collective), so no
    collective can complete any more; the message has its error text."""


class PeerLeftError(RingplugError):
    """Another rank ended ringplug (its program ended or called `shutdown()`) while this
    rank still had collectives to run with it."""


class NcclError(RingplugError):
    """An NCCL call failed; `code` is NCCL's result, the message has NCCL's own strings."""

    def __init__(self, message: str, code: int = -1, caused_by: tuple[int, ...] = ()) -> None:
        super().__init__(message, caused_by=caused_by)
        self.code = code


class CommunicatorFailed(NcclError):
    """The NCCL communicator was aborted (a peer failed, or NCCL refused this rank); every
    pending and later GPU collective of the process raises this. `code` is NCCL's result
    (ncclRemoteError, 6: a peer's process or its network connection is gone)."""

    @property
    def peer_gone(self) -> bool:
        return self.code == 6
