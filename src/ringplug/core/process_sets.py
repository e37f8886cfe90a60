"""Process sets: collectives over some of the world's ranks, each set with an engine of its own.

Design. A process set is an `Engine` over a communicator that holds its members only, made
collectively by every rank of the world. The set's engine is the world's engine in every
respect, because it is the same class: its own negotiation (ceil(log2 k) rounds for a set of
k ranks, over its own communicator, so a set of 4 inside 32 ranks pays for 4), its own cache of
agreed requests, fusion, ordering, names ("noname.N" counts per set), fast cycles and
algorithm table, and its own join. What it shares with the world comes from the process:
the settings (deadlines, stall times, thresholds: the world's, agreed at `init()`), every wait's
deadline (`Waiter`, per engine), the stall inspector and the errors naming ranks by their rank
in the world (`Engine.ranks`), stacks (process-wide), the flight record written under the
world's rank, and rank 0's timeline (the world engine's, shared with its followers).

Why an engine per set rather than one engine scheduling every set's cycles: sets cannot
deadlock each other by construction. Each set has its own communicator (so no message of one
set matches another's) and its own cycle on its own thread, so a rank that is in sets A and B
never blocks B's peers while it waits for A's (the rows and columns of a 2-D mesh, overlapping
sets). One scheduler for several sets would have to interleave their negotiations without
ever waiting in one, which is the engine's whole cycle written again with a second level of
state. The cost is a thread per set this rank is in, asleep when the set is idle (it polls
for peers with the same growing interval as the world's engine), and two communicators per
set (the negotiation's and the data plane's). Creating a set costs one allgather of the
proposed ranks on the world (through the world's engine, so with its deadline and stall
inspector) and MPI_Comm_create_group among the members only, on a duplicate of the world
that `runtime.init()` made for process sets' own traffic.

Creation is collective: every rank of the world calls `add_process_set` with the same ranks,
in the same order of calls; the ranks compare what each passed before any communicator is
made, so duplicate ranks, ranks outside the world and ranks that disagree are the same clear
error on every rank.

Or only the members call (`add_process_set(ranks, members_only=True)`, torch's
``new_group(use_local_synchronization=True)``), and the rest of the world takes no part at
all. Their messages go point to point on a duplicate of MPI_COMM_WORLD that `runtime.init()`
made for process sets (so no receive of the application's on MPI_COMM_WORLD, from any source
with any tag, can take one), each naming the set it is about. Each member sends its proposal
(its ranks, and how many members-only sets of exactly these ranks it made before) to the
other members, and polls for theirs until ``RINGPLUG_TIMEOUT``, after which it raises
`MembersMissingError` naming the members that never called. The members then compare the
proposals as the world's ranks do (the same error on each), tell each other they are ready,
and make the communicator with MPI_Comm_create_group, which only the members enter. Such a
set is named, not numbered: its id is the string ``"[0,2]#1"`` (its ranks, and the count of
members-only sets of those ranks before it), which no other set can have: the world's sets
have integer ids (Horovod's), and members-only sets made at once by disjoint groups of
ranks differ in their ranks. The proposals of one pair of ranks are matched in the order
each sends them, so members that make their shared members-only sets in different orders
do not hang: those whose proposals crossed get `MismatchError`, a member left waiting
`MembersMissingError`.

A member that fails to make a set (it gave up waiting, or the proposals disagreed) sends
the others a withdrawal naming the set, so a member that calls late, after the others gave
up, reads their stale proposals and then their withdrawals, and raises `MembersMissingError`
naming them at once, instead of entering MPI_Comm_create_group alone. That is why the
members wait for each other's "ready" before making the communicator: a proposal alone
cannot say whether its sender is still waiting. A member that has every proposal waits for
the readies for ``RINGPLUG_TIMEOUT`` and a grace more, longer than any member that sent its
proposal can still be waiting for the others, so it hears "ready" or a withdrawal from each
live member. Every member advances its count of sets of those ranks whatever the outcome,
so calling again on every member tries again.

Removal is collective too, and refused on every rank while any member
has a collective of the set in flight. A rank that is not in a set gets a `ProcessSet` whose
collectives refuse at once (`included()` says whether to call them).

Inside a set, ranks are the set's own: `ps.rank()` is 0..k-1 in the order of the world's
ranks, and `root_rank` of a broadcast counts in the set, as for an MPI sub-communicator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from . import collectives, log, runtime
from .engine.engine import Engine
from .errors import MembersMissingError, MismatchError, RingplugError
from .kinds.objects import allgather_object

if TYPE_CHECKING:
    from mpi4py import MPI

logger = logging.getLogger(__name__)

__all__ = ["ProcessSet", "add_process_set", "all_process_sets", "remove_process_set"]

# The MPI tag of members-only sets' messages, on `runtime.sets_comm()` (a duplicate of the
# world that nothing else sends on); under 32767, the least MPI_TAG_UB MPI allows.
_PROPOSAL_TAG = 32101
# What members-only sets' messages say: (kind, set id, sender's world rank, payload).
_PROPOSE = "propose"  # payload: (the ranks passed, how many sets of them the sender made)
_READY = "ready"  # the sender has every member's proposal, and they agree
_WITHDRAW = "withdraw"  # the sender failed to make the set; payload: why, in words
# How much longer than RINGPLUG_TIMEOUT a member with every proposal waits for the others'
# "ready" (see the module's docstring): messages in flight, a busy machine.
_READY_GRACE_SECONDS = 5.0


@dataclasses.dataclass
class _Inbox:
    """What one other rank sent this one about members-only sets, not taken yet."""

    proposals: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    ready: set[str] = dataclasses.field(default_factory=set)
    withdrawn: dict[str, str] = dataclasses.field(default_factory=dict)  # set id: why


class _Sets:
    """This process's sets: those it made (members or not), and the next id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_id: dict[int, ProcessSet] = {}
        # Ids of sets removed by their members only (torch's destroy_process_group): a rank
        # outside such a set cannot know when the members removed it, so no rank gives its
        # id again.
        self.retired: set[int] = set()
        # Sets made by their members only, by name (never given again: see `_add_among_members`),
        # and how many this rank made of each list of ranks.
        self.by_name: dict[str, ProcessSet] = {}
        self.made_of: dict[tuple[int, ...], int] = {}
        # Members-only sets' messages, by sender; the ids of the sets this rank made or gave
        # up on (their late messages are dropped); this rank's sends not yet complete.
        self.inbox: dict[int, _Inbox] = {}
        self.finished: set[str] = set()
        self.sending: list[Any] = []

    def free_id(self) -> int:
        """The smallest id no set has (0 is the world, as in Horovod): the id of a set that
        every rank removed is given again, as Horovod does; the same on every rank, as such
        sets are made and removed collectively."""
        set_id = 1
        while set_id in self.by_id or set_id in self.retired:
            set_id += 1
        return set_id


_sets = _Sets()


class ProcessSet:
    """Some of the world's ranks, running collectives among themselves.

    Made by `add_process_set` on every rank; its collectives are methods with the core's
    signatures (``ps.allreduce(array)``, ``ps.broadcast_async(array, root_rank=0)``, ...),
    called on its members only. Ranks inside a set are the set's own (`rank()`, root ranks).

    Example:
        ```python
        evens = ringplug.core.add_process_set(range(0, ringplug.size(), 2))
        if evens.included():
            total = evens.allreduce(np.ones(4), op=ringplug.Sum)  # size of the set, each
        ringplug.core.remove_process_set(evens)
        ```
    """

    def __init__(
        self,
        set_id: int | str,
        ranks: tuple[int, ...],
        engine: Engine | None,
        comm: MPI.Comm | None,
    ) -> None:
        # An int agreed by the world (Horovod's ids), or the name of a set made by its
        # members only ("[0,2]#0").
        self.process_set_id = set_id
        self.ranks = ranks
        self._engine = engine
        self._comm = comm
        self._removed = False

    @property
    def members_only(self) -> bool:
        """Whether the set was made by its members only (``add_process_set(ranks,
        members_only=True)``), so is removed by them only."""
        return isinstance(self.process_set_id, str)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={list(self.ranks)})"

    def describe(self) -> str:
        """The set as errors name it: "process set 1 (world ranks 0, 2, 3)"."""
        return f"process set {self.process_set_id} (world ranks {_ranks_text(self.ranks)})"

    def included(self) -> bool:
        """Whether this rank is a member (only members call the set's collectives)."""
        return self._engine is not None

    def rank(self) -> int:
        """This rank's place in the set, 0..size()-1 (in the order of the world's ranks)."""
        return self._member_engine("rank").rank

    def size(self) -> int:
        """The number of ranks in the set."""
        return len(self.ranks)

    def in_flight(self) -> list[str]:
        """The names of this rank's collectives on the set that have not completed."""
        engine = self._engine
        return [] if engine is None else engine.in_flight_names()

    def _member_engine(self, what: str) -> Engine:
        if self._removed:
            raise RingplugError(
                f"{self.describe()} was removed; {what} needs a set that exists. Make a new "
                "one with add_process_set."
            )
        engine = self._engine
        if engine is None:
            raise ValueError(
                f"{what} on {self.describe()}: rank {runtime.world_engine().rank} is not in "
                "this set, so it cannot take part in its collectives. Call them on its "
                "members only (`if process_set.included(): ...`)."
            )
        return engine


def _on_set(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` (a core collective) as a method that runs it among the set's members."""

    @functools.wraps(function)
    def call(self: ProcessSet, *args: Any, **kwargs: Any) -> Any:
        token = runtime.scope.set(self._member_engine(function.__name__))
        try:
            return function(*args, **kwargs)
        finally:
            runtime.scope.reset(token)

    call.__doc__ = (
        f"`ringplug.{function.__name__}` among this set's members (root ranks count in "
        f"the set).\n\n{function.__doc__ or ''}"
    )
    return call


_METHODS = (
    "adasum",
    "adasum_async",
    "allgather",
    "allgather_async",
    "allgather_in_place_async",
    "allgather_object",
    "allreduce",
    "allreduce_async",
    "alltoall",
    "alltoall_async",
    "barrier",
    "barrier_async",
    "broadcast",
    "broadcast_async",
    "broadcast_object",
    "grouped_adasum_async",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "join",
    "reducescatter",
    "reducescatter_async",
    "reducescatter_in_place_async",
)
for _name in _METHODS:
    setattr(ProcessSet, _name, _on_set(getattr(collectives, _name)))
del _name


def add_process_set(ranks: Iterable[int], *, members_only: bool = False) -> ProcessSet:
    """Make a process set of `ranks` (ranks of the world); every rank of the world calls it,
    or with `members_only` the set's members only.

    Collective over the world: every rank passes the same ranks (in any order; duplicates
    and ranks outside the world are refused), in the same order of calls as its other
    collectives. Ranks that are not in the set get a `ProcessSet` too, whose `included()`
    is False.

    Args:
        ranks: the world's ranks in the set, at least one.
        members_only: only the set's members call it (as torch's ``new_group(...,
            use_local_synchronization=True)``), each with the same ranks; the other ranks
            take no part and may be busy elsewhere. The set's id is then a name such as
            ``"[0,2]#0"`` (never an id of the world's sets), and it is removed by its members
            only (``remove_process_set(s, members_only=True)``).

    Returns:
        The set, with the same `process_set_id` on every rank (every member).

    Raises:
        ValueError: on every rank (member), when any passed duplicates, a rank outside the
            world or something that is not a list of ranks; with `members_only`, on a rank
            that is not in the ranks it passed.
        MismatchError: on every rank (member), when they passed different sets.
        MembersMissingError: with `members_only`, on the members that called, when others
            did not within ``RINGPLUG_TIMEOUT`` (it names them).
    """
    if members_only:
        return _add_among_members(ranks)
    world = runtime.world_engine()
    _check_threads(world)
    proposal = _proposal(ranks)
    token = runtime.scope.set(None)  # agreed among the whole world, even inside a set's call
    try:
        with _sets.lock:
            set_id = _sets.free_id()
        # One name on every rank, whatever id each would give the set: ranks that disagree
        # on the id get an error below instead of waiting in differently named collectives.
        offers = allgather_object((set_id, proposal), name="ringplug.add_process_set")
    finally:
        runtime.scope.reset(token)
    ids = [offer[0] for offer in offers]
    if len(set(ids)) > 1:
        raise MismatchError(
            "Ranks would give a new process set different ids ("
            + "; ".join(f"rank {r}: {i}" for r, i in enumerate(ids))
            + "): they made or removed different sets before. Every rank of the world must "
            "make and remove the same sets in the same order."
        )
    members = agreed_ranks([offer[1] for offer in offers], world.size, set_id)
    process_set = _make(set_id, members, world, tag=set_id)
    with _sets.lock:
        _sets.by_id[set_id] = process_set
    return process_set


def _make(set_id: int | str, members: tuple[int, ...], world: Engine, tag: int) -> ProcessSet:
    """The set of `members` once they agreed on it: on a member, its communicator (made
    with `tag`) and engine; elsewhere a set whose collectives refuse."""
    engine = comm = None
    if world.rank in members:
        with _within_timeout(members, set_id, world):
            comm = _communicator(members, tag) if world.size > 1 else None
            engine = Engine(  # duplicates `comm` twice, among the members
                comm,
                dataclasses.replace(world.settings, timeline=None),
                local_rank=runtime.local_rank(),
                local_size=runtime.local_size(),
                ranks=members,
                thread_name=f"ringplug-engine-set{set_id}",
            )
    process_set = ProcessSet(set_id, members, engine, comm)
    if engine is not None:
        engine.scope_text = f" This was in {process_set.describe()}."
        engine.timeline = world.timeline
        world.followers.append(engine)
    return process_set


def _add_among_members(ranks: Iterable[int]) -> ProcessSet:
    """`add_process_set(ranks, members_only=True)`: the members exchange their proposals
    point to point, compare them, and make the set (see the module's docstring)."""
    world = runtime.world_engine()
    _check_threads(world)
    proposal = _proposal(ranks)
    problem = _problem(proposal, world.size)
    if problem.endswith("more than once"):
        problem = ""  # the members it names hear of it too, below
    elif not problem and world.rank not in proposal:
        problem = f"passed [{_ranks_text(proposal)}], which does not name rank {world.rank}"
    if problem:
        raise ValueError(
            f"add_process_set(members_only=True) refused: rank {world.rank} {problem}. With "
            "members_only, only the set's members call it, each with the same distinct ranks "
            f"of the world (0..{world.size - 1}), itself among them; other ranks call nothing "
            "(torch's new_group(use_local_synchronization=True) returns None on them)."
        )
    members = tuple(sorted(set(proposal)))
    with _sets.lock:
        count = _sets.made_of.get(members, 0)
        _sets.made_of[members] = count + 1
    set_id = f"[{','.join(map(str, members))}]#{count}"
    where = f"process set {set_id} (world ranks {_ranks_text(members)})"
    peers = [r for r in members if r != world.rank]
    comm = runtime.sets_comm()
    if comm is None or not peers:
        _agree({world.rank: (proposal, count)}, members, world, where)
    else:
        with _negotiation(comm, set_id, peers, world):
            offers = _exchange(comm, (proposal, count), set_id, members, world, where)
            _agree(offers, members, world, where)
            _confirm(comm, set_id, peers, world, where)
    tag = 16384 + zlib.crc32(set_id.encode()) % 16000  # any tag serves; distinct helps MPI
    process_set = _make(set_id, members, world, tag=tag)
    with _sets.lock:
        _sets.by_name[set_id] = process_set
    return process_set


def _agree(
    offers: dict[int, tuple[Any, ...]], members: tuple[int, ...], world: Engine, where: str
) -> None:
    """Raise, the same on every member, when the members' proposals are wrong or differ."""
    problems = [f"rank {r} {text}" for r in members if (text := _problem(offers[r][0], world.size))]
    if problems:
        raise ValueError(
            f"add_process_set(members_only=True) of {where} refused: "
            + "; ".join(problems)
            + ". Pass distinct ranks of the world, the same on every member."
        )
    passed: dict[tuple[int, ...], list[int]] = {}
    for r in members:
        passed.setdefault(tuple(sorted(offers[r][0])), []).append(r)
    if len(passed) > 1:
        raise MismatchError(
            f"The members of {where}, made by its members only, disagree on it: "
            + "; ".join(
                f"rank(s) {_ranks_text(who)} passed [{_ranks_text(m)}]" for m, who in passed.items()
            )
            + ". Ranks that share members-only sets must make them with the same ranks, "
            "and in the same order."
        )
    counts = {r: offers[r][1] for r in members}
    if len(set(counts.values())) > 1:
        raise MismatchError(
            f"The members of {where} made different numbers of members-only sets of these "
            "ranks before ("
            + "; ".join(f"rank {r}: {n}" for r, n in counts.items())
            + "): each member must make (and remove) the same ones, in the same order."
        )


@contextlib.contextmanager
def _negotiation(comm: MPI.Comm, set_id: str, peers: list[int], world: Engine) -> Iterator[None]:
    """Around the members' messages about `set_id`: when this rank fails to make it, tell
    the other members (one that calls late then fails at once, naming this rank); either
    way, drop whatever comes about it later."""
    try:
        yield
    except BaseException as exc:
        why = getattr(exc, "withdrawal", None) or f"raised {type(exc).__name__}"
        _send(comm, (_WITHDRAW, set_id, world.rank, why), peers)
        raise
    finally:
        with _sets.lock:
            _sets.finished.add(set_id)
            for inbox in _sets.inbox.values():
                inbox.proposals.pop(set_id, None)
                inbox.ready.discard(set_id)
                inbox.withdrawn.pop(set_id, None)


def _send(comm: MPI.Comm, message: tuple[Any, ...], peers: list[int]) -> None:
    """`message` to each of `peers`, without blocking (the requests complete in `_collect`)."""
    requests = [comm.isend(message, dest=r, tag=_PROPOSAL_TAG) for r in peers]
    with _sets.lock:
        _sets.sending.extend(requests)


def _collect(comm: MPI.Comm) -> None:
    """File every members-only sets' message that has come for this rank, by sender; drop
    those about sets this rank made or gave up on (a late member's proposal, say)."""
    from mpi4py import MPI

    with _sets.lock:
        while (message := comm.improbe(source=MPI.ANY_SOURCE, tag=_PROPOSAL_TAG)) is not None:
            kind, set_id, sender, payload = message.recv()
            if set_id in _sets.finished:
                continue
            inbox = _sets.inbox.setdefault(sender, _Inbox())
            if kind == _PROPOSE:
                inbox.proposals[set_id] = payload
            elif kind == _READY:
                inbox.ready.add(set_id)
            else:  # the sender gave up on the set (its proposal stays: see `_exchange`)
                inbox.withdrawn[set_id] = payload
                inbox.ready.discard(set_id)
        _sets.sending = [request for request in _sets.sending if not request.Test()]


def _withdrawn(set_id: str, peers: list[int]) -> dict[int, str]:
    """The peers that withdrew from `set_id`, and why (call under `_sets.lock`)."""
    found = {}
    for r in peers:
        inbox = _sets.inbox.get(r)
        if inbox is not None and set_id in inbox.withdrawn:
            found[r] = inbox.withdrawn[set_id]
    return found


def _exchange(
    comm: MPI.Comm,
    offer: tuple[Any, ...],
    set_id: str,
    members: tuple[int, ...],
    world: Engine,
    where: str,
) -> dict[int, tuple[Any, ...]]:
    """Every member's proposal, by world rank: this rank's `offer` sent to each other member,
    and theirs received, polling until RINGPLUG_TIMEOUT (no MPI call here blocks)."""
    got: dict[int, tuple[Any, ...]] = {world.rank: offer}
    peers = [r for r in members if r != world.rank]
    _send(comm, (_PROPOSE, set_id, world.rank, offer), peers)
    timeout = world.settings.timeout
    polls = _Polls(timeout)
    while True:
        _collect(comm)
        with _sets.lock:
            for r in peers:
                inbox = _sets.inbox.get(r)
                if r in got or inbox is None:
                    continue
                # Proposals of sets their sender withdrew from are stale, but for this one:
                # its members compare its proposals first, so that a member that withdrew
                # because they were wrong is the same error here (`_agree`).
                for other in [i for i in inbox.proposals if i in inbox.withdrawn]:
                    if other != set_id:
                        del inbox.proposals[other]
                if set_id in inbox.proposals:
                    got[r] = inbox.proposals.pop(set_id)
                elif inbox.proposals:  # r proposed another set first: crossed (`_agree`)
                    got[r] = inbox.proposals.pop(next(iter(inbox.proposals)))
            # A member whose proposal came and which then withdrew is heard of in `_agree`
            # or `_confirm`.
            withdrawn = _withdrawn(set_id, [r for r in peers if r not in got])
        if withdrawn:
            raise _gave_up(withdrawn, world, where)
        if len(got) == len(members):
            return got
        if not polls.pause():
            break
    missing = tuple(r for r in peers if r not in got)
    error = MembersMissingError(
        f"rank {world.rank} waited {timeout:g} s (RINGPLUG_TIMEOUT) for rank(s) "
        f"{_ranks_text(missing)} to make {where} with it, but they never called: the set is "
        "made by its members only (add_process_set(ranks, members_only=True), torch's "
        "dist.new_group(ranks, use_local_synchronization=True)), and each member must call "
        "it, in the same order as the other members-only sets it shares with them.",
        caused_by=missing,
    )
    # What the other members hear of it (`_negotiation`).
    error.withdrawal = (
        f"waited {timeout:g} s (RINGPLUG_TIMEOUT) for rank(s) {_ranks_text(missing)}, then "
        "raised MembersMissingError"
    )
    raise error


def _confirm(comm: MPI.Comm, set_id: str, peers: list[int], world: Engine, where: str) -> None:
    """Tell the other members this rank has every proposal, and wait for them to say the
    same (or that they gave up), for longer than any of them can still be waiting for
    proposals (see the module's docstring)."""
    _send(comm, (_READY, set_id, world.rank, None), peers)
    timeout = world.settings.timeout
    polls = _Polls(timeout + _READY_GRACE_SECONDS)
    confirmed: set[int] = set()
    while True:
        _collect(comm)
        with _sets.lock:
            for r in peers:
                inbox = _sets.inbox.get(r)
                if inbox is not None and set_id in inbox.ready:
                    inbox.ready.discard(set_id)
                    confirmed.add(r)
            withdrawn = _withdrawn(set_id, peers)
        if withdrawn:
            raise _gave_up(withdrawn, world, where)
        if len(confirmed) == len(peers):
            return
        if not polls.pause():
            break
    silent = tuple(r for r in peers if r not in confirmed)
    error = MembersMissingError(
        f"rank {world.rank} has every member's proposal for {where}, but rank(s) "
        f"{_ranks_text(silent)} neither confirmed it nor gave up within "
        f"{timeout + _READY_GRACE_SECONDS:g} s (RINGPLUG_TIMEOUT and a grace): they are stuck "
        "or gone.",
        caused_by=silent,
    )
    error.withdrawal = f"never heard rank(s) {_ranks_text(silent)} confirm it"
    raise error


class _Polls:
    """The pauses between a members-only wait's polls, from 0.2 ms doubling up to 20 ms,
    for `seconds`: the others may be busy for long, and this rank must not block in MPI."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.seconds = 0.0002

    def pause(self) -> bool:
        """Sleep before the next poll; False, without sleeping, once the time is up."""
        if time.monotonic() >= self.deadline:
            return False
        time.sleep(self.seconds)
        self.seconds = min(2 * self.seconds, 0.02)
        return True


def _gave_up(withdrawn: dict[int, str], world: Engine, where: str) -> MembersMissingError:
    """The error of a member whose peers withdrew from the set (most often: it called late,
    after they had given up waiting for it)."""
    who = tuple(sorted(withdrawn))
    error = MembersMissingError(
        f"rank {world.rank} cannot make {where}: rank(s) {_ranks_text(who)} gave up on it ("
        + "; ".join(f"rank {r} {why}" for r, why in sorted(withdrawn.items()))
        + "), so no member made it. A member that calls after the others waited "
        f"RINGPLUG_TIMEOUT ({world.settings.timeout:g} s) for it is too late: every member "
        "must call add_process_set(ranks, members_only=True) (torch's dist.new_group(ranks, "
        "use_local_synchronization=True)) within RINGPLUG_TIMEOUT of the others (raise it if "
        "a member is busy for longer), in the same order as the other members-only sets "
        "they share; to try again, call it again on every member.",
        caused_by=who,
    )
    error.withdrawal = f"heard that rank(s) {_ranks_text(who)} gave up on it"
    return error


def remove_process_set(process_set: ProcessSet, *, members_only: bool = False) -> None:
    """Remove `process_set`; every rank of the world calls it, once nothing is in flight.

    Args:
        process_set: the set to remove.
        members_only: only the set's members call it (as torch's
            ``destroy_process_group(group)``, which ranks outside the group skip): the
            members agree among themselves, and a rank outside the set that calls it only
            forgets the set, at once.

    Raises:
        RingplugError: on every rank concerned (the world's, or the set's members with
            `members_only`), naming the ranks and their collectives, while any member has
            a collective of the set that has not completed: wait for them first.
    """
    world = runtime.world_engine()
    busy = process_set.in_flight()
    if process_set.members_only and not members_only:
        raise ValueError(
            f"remove_process_set({process_set.describe()}): the set was made by its members "
            "only, so only they remove it: remove_process_set(process_set, members_only=True) "
            "on each member."
        )
    if members_only:
        _remove_among_members(process_set, busy, world)
        return
    token = runtime.scope.set(None)
    try:
        reports = allgather_object(
            (process_set.process_set_id, len(busy), busy[:3]),
            name=f"ringplug.remove_process_set.{process_set.process_set_id}",
        )
    finally:
        runtime.scope.reset(token)
    ids = {report[0] for report in reports}
    if len(ids) > 1:
        raise MismatchError(
            "Ranks removed different process sets in the same call: "
            + "; ".join(f"rank {r} process set {report[0]}" for r, report in enumerate(reports))
            + ". Every rank must remove the same sets in the same order."
        )
    _refuse_pending(process_set, [(r, report[1], report[2]) for r, report in enumerate(reports)])
    _close(process_set, world)


def _remove_among_members(process_set: ProcessSet, busy: list[str], world: Engine) -> None:
    """`remove_process_set(members_only=True)`: the members compare what each has in flight
    over the set's own engine; a rank outside the set forgets it. A set whose engine
    failed (a stall shut it down, on every member alike) is closed with nothing to agree."""
    engine = process_set._engine
    if engine is not None and engine.failure is None and not process_set._removed:
        reports = process_set.allgather_object(  # type: ignore[attr-defined]
            (len(busy), busy[:3]),
            name=f"ringplug.remove_process_set.{process_set.process_set_id}",
        )
        _refuse_pending(
            process_set,
            [(process_set.ranks[r], count, names) for r, (count, names) in enumerate(reports)],
        )
    _close(process_set, world, retire=True)


def _refuse_pending(process_set: ProcessSet, reports: list[tuple[int, int, list[str]]]) -> None:
    """Raise when any rank reported collectives of the set in flight: (world rank, how
    many, the first names)."""
    pending = [(r, count, names) for r, count, names in reports if count]
    if pending:
        raise RingplugError(
            f"Cannot remove {process_set.describe()}: collectives on it are still in flight ("
            + "; ".join(
                f"rank {r}: {count} ({', '.join(repr(n) for n in names)})"
                for r, count, names in pending
            )
            + "). Wait for their handles on every member, then remove it."
        )


def all_process_sets() -> list[ProcessSet]:
    """The process sets made and not removed since `init()`: the world's by id, then those
    made by their members only, in the order they were made."""
    with _sets.lock:
        return [_sets.by_id[i] for i in sorted(_sets.by_id)] + list(_sets.by_name.values())


def _proposal(ranks: Iterable[int]) -> tuple[Any, ...]:
    """What this rank passed, as the ranks compare it: its ranks, or ("unusable", text)."""
    try:
        given = list(ranks)
        if not all(isinstance(r, int) or hasattr(r, "__index__") for r in given):
            raise TypeError
        return tuple(int(r) for r in given)
    except TypeError:
        return ("unusable", repr(ranks)[:80])


def agreed_ranks(
    proposals: Sequence[tuple[Any, ...]], world_size: int, set_id: int
) -> tuple[int, ...]:
    """The set's ranks (sorted) from every rank's proposal; the same error on every rank when
    any is wrong or they differ."""
    problems = []
    for rank, proposal in enumerate(proposals):
        problem = _problem(proposal, world_size)
        if problem:
            problems.append(f"rank {rank} {problem}")
    if problems:
        raise ValueError(
            f"add_process_set (process set {set_id}) refused: " + "; ".join(problems) + ". "
            f"Pass distinct ranks of the world (0..{world_size - 1}), the same on every rank."
        )
    sets: dict[tuple[int, ...], list[int]] = {}
    for rank, proposal in enumerate(proposals):
        sets.setdefault(tuple(sorted(proposal)), []).append(rank)
    if len(sets) > 1:
        raise MismatchError(
            f"Ranks disagree on process set {set_id}: "
            + "; ".join(
                f"rank{'s' if len(who) > 1 else ''} {_ranks_text(who)} passed "
                f"[{_ranks_text(members)}]"
                for members, who in sets.items()
            )
            + ". Every rank of the world must call add_process_set with the same ranks, in "
            "the same order of calls."
        )
    return next(iter(sets))


def _problem(proposal: tuple[Any, ...], world_size: int) -> str:
    """What is wrong with one rank's proposal, or ""."""
    if proposal[:1] == ("unusable",):
        return f"passed {proposal[1]}, which is not a list of ranks"
    if not proposal:
        return "passed no ranks"
    outside = sorted({r for r in proposal if not 0 <= r < world_size})
    if outside:
        return (
            f"passed rank{'s' if len(outside) > 1 else ''} {_ranks_text(outside)}, outside "
            f"the world of {world_size}"
        )
    twice = sorted({r for r in proposal if proposal.count(r) > 1})
    if twice:
        return f"passed rank{'s' if len(twice) > 1 else ''} {_ranks_text(twice)} more than once"
    return ""


def _check_threads(world: Engine) -> None:
    """Refuse sets where MPI cannot take calls from several threads at once (each set's
    engine has a thread of its own); the same on every rank, as they share the library."""
    if world.size == 1:
        return
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RingplugError(
            "Process sets need MPI at thread level MULTIPLE (each set's engine runs on a "
            f"thread of its own), but this MPI gives level {MPI.Query_thread()}. Use an MPI "
            "built with thread support (the mpich wheel from PyPI has it)."
        )


@contextlib.contextmanager
def _within_timeout(members: tuple[int, ...], set_id: int | str, world: Engine) -> Iterator[None]:
    """Bound the members' MPI calls that make a set (they have no deadline of their own):
    a member that agreed and never arrives ends the job naming the wait."""
    done = threading.Event()
    timeout = world.settings.timeout

    def watchdog() -> None:
        if not done.wait(timeout):
            log.end_job(
                world.rank,
                f"rank {world.rank} waited {timeout:g} s (RINGPLUG_TIMEOUT) for the other "
                f"members of process set {set_id} (world ranks {_ranks_text(members)}) to "
                "make its communicators, after every rank agreed on it; a member is stuck or "
                "gone.",
            )

    threading.Thread(target=watchdog, name="ringplug-process-set", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _communicator(members: tuple[int, ...], tag: int) -> MPI.Comm:
    """MPI_Comm_create_group among the members (the others do not take part); `tag` tells
    apart the calls of overlapping sets made at once. The parent is `runtime.sets_comm()`,
    a duplicate of the world (so the members' ranks are its ranks), where nothing of the
    application's can meet the call's messages."""
    parent = runtime.sets_comm()
    assert parent is not None  # a world of more than one rank runs on MPI
    everyone = parent.Get_group()
    group = everyone.Incl(list(members))
    try:
        return parent.Create_group(group, tag=tag)
    finally:
        group.Free()
        everyone.Free()


def _close(process_set: ProcessSet, world: Engine | None, retire: bool = False) -> None:
    """Stop the set's engine (its members agree on it in its last cycle) and free its
    communicator; with `retire`, its id is never given again (see `_Sets.retired`)."""
    set_id = process_set.process_set_id
    with _sets.lock:
        if isinstance(set_id, str):
            _sets.by_name.pop(set_id, None)
        else:
            _sets.by_id.pop(set_id, None)
            if retire:
                _sets.retired.add(set_id)
    process_set._removed = True
    engine, process_set._engine = process_set._engine, None
    if engine is None:
        return
    if world is not None and engine in world.followers:
        world.followers.remove(engine)
    engine.timeline = None  # the world's: stopping the set's engine must not close it
    engine.stop()
    comm, process_set._comm = process_set._comm, None
    if comm is not None:
        comm.Free()


def _stop_all() -> None:
    """At `shutdown()`: stop every set's engine before the world's, and forget the sets and
    the members-only sets' messages (`runtime.shutdown()` takes those still coming, on the
    sets' communicator, before it frees it)."""
    world = runtime.current_engine()
    for process_set in all_process_sets():
        _close(process_set, world)
    with _sets.lock:
        _sets.by_id.clear()
        _sets.retired.clear()
        _sets.by_name.clear()
        _sets.made_of.clear()
        _sets.inbox.clear()
        _sets.finished.clear()
        # `sending` stays: a request must outlive its send, which the next `_collect` sees.


runtime.before_shutdown.append(_stop_all)


def _ranks_text(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, ranks))
