"""Process-wide state: start MPI (lazily), know this rank's place, and shut down.

`init()` is the only function that starts MPI, and only when called, never at import.
Without any MPI library a process is a world of one, which is all a laptop script needs;
a process that a launcher started as one of several ranks without a usable MPI gets an
error saying what to install instead of silently training alone.
"""

from __future__ import annotations

import atexit
import contextvars
import dataclasses
import logging
import os
import sys
import threading
import time
import traceback as traceback_module
from types import TracebackType
from typing import TYPE_CHECKING, NoReturn

from .. import wire
from ..config import Settings, read_settings
from ..forensics import stacks
from . import log
from .engine.engine import Engine
from .errors import NotInitializedError, PeerEngineFailedError, PeerLeftError, RingplugError

if TYPE_CHECKING:
    from mpi4py import MPI

logger = logging.getLogger(__name__)

_INSTALL_HINT = (
    "Install an MPI library for mpi4py: `pip install 'ringplug[mpich]'` (MPICH from PyPI), "
    "or on a cluster load its MPI module (and `pip uninstall mpich` so mpi4py uses it)."
)

# How long a rank that a peer's departure ends waits for the launcher to stop it.
_LEAVER_GRACE_S = 3.0


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process sits: in the world, on its host, and across hosts."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.engine: Engine | None = None
        self.topology: Topology | None = None
        # A duplicate of MPI_COMM_WORLD for process sets' own traffic (`process_sets`): the
        # proposals of members-only sets, and the parent of MPI_Comm_create_group; so no
        # receive of the application's on MPI_COMM_WORLD, even from any source with any tag,
        # can match them. None without MPI.
        self.sets_comm: MPI.Comm | None = None
        self.previous_excepthook = None
        self.atexit_registered = False
        self.mpi_started = False  # ringplug initialised MPI, so it finalizes it at exit
        self.left_early = False  # the last engine ended while peers still waited for it
        self.timeout = Settings().timeout
        self.exit_status: object = None  # what the main thread passed to sys.exit
        self.exit_watched = False


_state = _State()

# The process set whose engine this thread's collectives go to while a set's method runs
# (`process_sets.ProcessSet`); None: the world's. The request builders ask `engine()`,
# `rank()` and `size()` at build time, so one variable points them all at the set.
scope: contextvars.ContextVar[Engine | None] = contextvars.ContextVar(
    "ringplug_process_set", default=None
)
# Called by `shutdown()` before the world's engine stops (the process sets' engines).
before_shutdown: list = []


def launcher_world_size() -> tuple[int, str] | None:
    """The world size a launcher announced in the environment, and the launcher's name."""
    for variable, launcher in (
        ("PMI_SIZE", "MPICH/hydra (PMI)"),
        ("OMPI_COMM_WORLD_SIZE", "Open MPI"),
        ("PMIX_SIZE", "a PMIx launcher"),
        ("SLURM_STEP_NUM_TASKS", "srun"),
    ):
        value = os.environ.get(variable, "")
        if value.isdigit() and int(value) > 1:
            return int(value), launcher
    return None


def refuse_torchrun_world() -> None:
    """Raise when torch's launcher (torchrun, torch.distributed.run, a Kubernetes PyTorchJob)
    started this process as one of several: ringplug takes its ranks from MPI, so each of
    them would be a world of one, training a model of its own."""
    world = os.environ.get("WORLD_SIZE", "")
    if not world.isdigit() or int(world) <= 1 or launcher_world_size() is not None:
        return  # an MPI launcher started it too: MPI's world is the job's
    by = "torchrun" if os.environ.get("TORCHELASTIC_RUN_ID") else "torch's launcher"
    raise RingplugError(
        f"This process was started by {by} as rank {os.environ.get('RANK', '?')} of {world} "
        "(RANK/WORLD_SIZE are set), but ringplug takes its ranks from MPI and no MPI launcher "
        f"started it: the {world} processes would each train a separate model. Start the "
        f"job with `ringrun -np {world} python ...` (or mpiexec/srun) instead; on Kubernetes, "
        "use an MPIJob (the MPI Operator) rather than a PyTorchJob."
    )


def _start_mpi():
    """Import mpi4py and initialise MPI with thread support, or return None without MPI."""
    try:
        import mpi4py

        mpi4py.rc.initialize = False
        # ringplug finalizes at exit itself (`_at_exit`), with a deadline, and not at all
        # when this rank leaves while its peers still wait for it.
        mpi4py.rc.finalize = False
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:
        announced = launcher_world_size()
        if announced:
            raise RingplugError(
                f"This process was started as one of {announced[0]} ranks by {announced[1]}, "
                f"but no MPI library could be loaded ({exc}). {_INSTALL_HINT}"
            ) from exc
        logger.info("No MPI library (%s); running as a single process.", exc)
        return None
    if not MPI.Is_initialized():
        _state.mpi_started = True
        # MULTIPLE, although one thread at a time calls MPI: at that level MPICH yields the
        # core inside blocking calls. At SINGLE or SERIALIZED it spins, and with more ranks
        # than cores (3 ranks on the 2-core CI machine) a 20-step allreduce loop then took
        # 50 s instead of 0.4 s.
        provided = MPI.Init_thread(MPI.THREAD_MULTIPLE)
        if provided < MPI.THREAD_SERIALIZED:
            logger.warning(
                "The MPI library gives thread level %d (< SERIALIZED); keep every ringplug call "
                "on one thread.",
                provided,
            )
    return MPI


def init() -> None:
    """Join the job: start MPI if needed and learn rank, size and placement. Idempotent.

    Reads the `RINGPLUG_*` settings; rank 0's values of the settings that decide how
    ranks talk (thresholds, segment size, timeout) are used on every rank.
    """
    with _state.lock:
        if _state.engine is not None:
            return
        settings = read_settings()
        mpi = _start_mpi()
        if mpi is None or mpi.COMM_WORLD.Get_size() == 1:
            refuse_torchrun_world()
        if mpi is None:
            log.configure(0, settings.log_level)
            _state.topology = Topology(0, 1, 0, 1, 0, 1)
            _state.engine = Engine(None, settings)
            _register_atexit()
            stacks.install()
            return
        world = mpi.COMM_WORLD
        announced = launcher_world_size()
        if announced and world.Get_size() == 1:
            raise RingplugError(
                f"{announced[1]} started {announced[0]} ranks, but MPI sees a world of 1: the "
                "launcher does not belong to the MPI library mpi4py loaded (for srun, pass "
                "--mpi=pmi2 or --mpi=pmix as the cluster's MPI needs; for mpiexec, use the one "
                "from the same MPI). `ringrun --check` shows which library mpi4py loads."
            )
        log.configure(world.Get_rank(), settings.log_level)
        agreed = world.bcast(settings, root=0)
        if agreed != settings:
            logger.warning("RINGPLUG_* settings differ between ranks; using rank 0's: %s", agreed)
        _state.topology = _topology(mpi, world)
        # Made here, where every rank takes part (MPI_Comm_dup is collective), so that a
        # set made later by some ranks only needs nothing from the others.
        _state.sets_comm = world.Dup()
        _state.engine = Engine(
            world,
            agreed,
            local_rank=_state.topology.local_rank,
            local_size=_state.topology.local_size,
        )
        _install_excepthook()
        _watch_exit_status()
        _register_atexit()
        # Every rank answers for its stacks (stall reports, ringrun --stacks), and its
        # DataLoader workers forked from now on too.
        stacks.install()
        logger.info("ringplug initialised: %s", _state.topology)


def _topology(mpi, world) -> Topology:
    local = world.Split_type(mpi.COMM_TYPE_SHARED, key=world.Get_rank())
    cross = world.Split(color=local.Get_rank(), key=world.Get_rank())
    topology = Topology(
        world.Get_rank(),
        world.Get_size(),
        local.Get_rank(),
        local.Get_size(),
        cross.Get_rank(),
        cross.Get_size(),
    )
    local.Free()
    cross.Free()
    return topology


def _install_excepthook() -> None:
    """Abort the whole job when a rank dies of an uncaught exception.

    Otherwise the rank would finalise MPI and exit while its peers wait for it forever
    inside their next collective.
    """
    if _state.previous_excepthook is not None:
        return
    _state.previous_excepthook = sys.excepthook

    def abort_job(
        kind: type[BaseException], value: BaseException, traceback: TracebackType | None
    ) -> None:
        topology = _state.topology
        if topology is None or topology.size == 1:
            _state.previous_excepthook(kind, value, traceback)  # type: ignore[misc]
            return
        # Straight to the real stderr: a hook that wraps this one (torch.distributed's
        # captures sys.stderr to prefix the lines) would never see its buffer written out.
        stream = sys.__stderr__ or sys.stderr
        traceback_module.print_exception(kind, value, traceback, file=stream)
        stream.flush()
        if getattr(value, "peer_gone", False):
            # NCCL saw a peer's process end but cannot say which: give the launcher time to
            # see that rank's own exit, and name it, before this rank reports a fault.
            time.sleep(_LEAVER_GRACE_S)
        culprits = _culprits(value)
        plural = "s" if len(culprits) > 1 else ""
        cause = f" (caused by rank{plural} {', '.join(map(str, culprits))})" if culprits else ""
        log.end_job(
            topology.rank,
            # ringplug's own failures (a stall, a peer gone) leave the rank's flight record.
            last_words=isinstance(value, RingplugError),
            message=f"uncaught {kind.__name__} on rank {topology.rank}{cause}; ending this rank so "
            f"that the launcher stops all {topology.size} ranks.",
            culprits=culprits,
            # The rank that left (or whose engine failed) is exiting with its own code
            # (sys.exit(3)); if this rank ended first, the launcher would kill that one and
            # lose its code.
            linger=_LEAVER_GRACE_S
            if isinstance(value, (PeerLeftError, PeerEngineFailedError))
            else 0.0,
        )

    sys.excepthook = abort_job


def _watch_exit_status() -> None:
    """Note what the main thread passes to `sys.exit`, which `_at_exit` cannot learn.

    A rank leaving with a code of its own (``sys.exit(3)``) must not wait in MPI_Finalize
    for peers that compute on: the launcher would see a peer fail first and stop this rank
    in the teardown, its code lost. ``raise SystemExit(3)`` is not seen; such a rank
    finalizes as before.
    """
    if _state.exit_watched:
        return
    _state.exit_watched = True
    exit_now = sys.exit

    def exit(status: object = None) -> NoReturn:
        if threading.current_thread() is threading.main_thread():
            _state.exit_status = status
        exit_now(status)

    sys.exit = exit


def _exit_code(status: object) -> int:
    """The process's exit code for a `sys.exit` argument (a message exits with 1)."""
    if status is None:
        return 0
    return status if isinstance(status, int) else 1


def _culprits(error: BaseException | None) -> tuple[int, ...]:
    """The ranks ringplug's error about a peer names, found along the chain of causes
    (Lightning, or the user's program, may raise its own error from it)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        caused_by = tuple(getattr(error, "caused_by", ()) or ())
        if caused_by:
            return caused_by
        error = error.__cause__ or error.__context__
    return ()


def _register_atexit() -> None:
    """Stop the engine before mpi4py finalizes MPI at exit (atexit runs last-in first-out)."""
    if not _state.atexit_registered:
        atexit.register(_at_exit)
        _state.atexit_registered = True


def _at_exit() -> None:
    """Stop the engine, then finalize MPI within the timeout.

    A rank that ended ringplug while its peers still waited for it does not finalize, nor
    does one leaving with a nonzero code: MPI_Finalize would wait for those peers, and the
    launcher would kill this rank with its own exit code (``sys.exit(3)``) lost. Leaving
    without it lets the exit code through, and the launcher stops the job.
    """
    code = _exit_code(_state.exit_status)
    engine = _state.engine
    if code != 0 and engine is not None and engine.size > 1:
        _report_caught_failure(engine, code)
    shutdown()
    if not _state.mpi_started or _state.left_early or code != 0:
        return
    from mpi4py import MPI

    if MPI.Is_finalized():
        return
    rank = MPI.COMM_WORLD.Get_rank()
    finished = threading.Event()

    def watchdog() -> None:
        if not finished.wait(_state.timeout):
            log.end_job(
                rank,
                f"rank {rank} waited {_state.timeout:g} s in MPI_Finalize for the other "
                "ranks to end (RINGPLUG_TIMEOUT); a rank is still running or stuck.",
            )

    threading.Thread(target=watchdog, name="ringplug-finalize", daemon=True).start()
    MPI.Finalize()
    finished.set()


def _report_caught_failure(engine: Engine, code: int) -> None:
    """A program that caught ringplug's error about a peer and exited with `code`: say so,
    and tell ringrun which rank the error points to (it names that rank, not this one,
    whichever ended first)."""
    failure = engine.failure
    culprits = _culprits(failure)
    if not culprits:
        return
    plural = "s" if len(culprits) > 1 else ""
    message = (
        f"{type(failure).__name__} on rank {engine.rank} (caused by rank{plural} "
        f"{', '.join(map(str, culprits))}); the program caught it and exited with code {code}."
    )
    log.say(engine.rank, [f"ERROR: {message}"])
    log.event(
        wire.FAULT,
        rank=engine.rank,
        culprits=sorted(set(culprits)),
        message=message,
        timestamp=time.time(),
    )


def shutdown() -> None:
    """Leave the job: stop the engine on every rank and free ringplug's communicators.

    Collectives that already finished keep their results; ones still waiting for other
    ranks fail with an error saying ringplug was shut down. `init()` may be called again
    later (MPI itself stays initialised until the process exits).
    """
    if _state.engine is not None:
        for stop in list(before_shutdown):
            stop()
    with _state.lock:
        engine, _state.engine = _state.engine, None
        _state.topology = None
    if engine is not None:
        engine.stop()
        _state.left_early = engine.left_early
        _state.timeout = engine.settings.timeout
    sets_comm, _state.sets_comm = _state.sets_comm, None
    if sets_comm is not None:
        _free_drained(sets_comm)


def sets_comm() -> MPI.Comm | None:
    """The communicator of process sets' own traffic (a duplicate of the world's, made at
    `init()`, so with the world's ranks); None before `init()` and without MPI."""
    return _state.sets_comm


def _free_drained(comm: MPI.Comm, seconds: float = 2.0) -> None:
    """Take the messages left for this rank on `comm` (the proposals and withdrawals of
    members-only sets it never made or gave up on), then free it.

    MPI_Finalize would otherwise find them unmatched. Once the world's engine has stopped
    (its last cycle agreed with every rank), each rank has sent all it ever will on `comm`;
    the loop takes what has arrived and stops after `seconds` whatever it finds."""
    from mpi4py import MPI

    if MPI.Is_finalized():
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        message = comm.improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
        if message is None:
            break
        logger.debug("dropped a message no process set took: %r", message.recv())
    comm.Free()


def is_initialized() -> bool:
    """Whether `init()` has been called (and `shutdown()` has not)."""
    return _state.engine is not None


def current_engine() -> Engine | None:
    """The engine, or None before `init()` (for callers that take another path then)."""
    return scope.get() or _state.engine


def engine() -> Engine:
    """The engine (a process set's inside its methods); raises before `init()`."""
    current = scope.get() or _state.engine
    if current is None:
        raise NotInitializedError("Call ringplug.init() before using ringplug's collectives.")
    return current


def topology() -> Topology:
    """This process's place in the job; raises if `init()` has not been called."""
    if _state.topology is None:
        raise NotInitializedError("Call ringplug.init() before asking for rank or size.")
    return _state.topology


def settings() -> Settings:
    """The settings in force (rank 0's, agreed at `init()`)."""
    return engine().settings


def world_engine() -> Engine:
    """The world's engine, whatever process set this thread's calls go to."""
    current = _state.engine
    if current is None:
        raise NotInitializedError("Call ringplug.init() before using ringplug's collectives.")
    return current


def rank() -> int:
    """This process's rank in the job, 0..size()-1 (in the set, inside a set's methods)."""
    scoped = scope.get()
    return topology().rank if scoped is None else scoped.rank


def size() -> int:
    """Number of ranks in the job (in the set, inside a set's methods)."""
    scoped = scope.get()
    return topology().size if scoped is None else scoped.size


def local_rank() -> int:
    """This process's rank among the ranks on its host."""
    return topology().local_rank


def local_size() -> int:
    """Number of ranks on this process's host."""
    return topology().local_size


def cross_rank() -> int:
    """Index of this process's host among the hosts (its rank among same-local-rank peers)."""
    return topology().cross_rank


def cross_size() -> int:
    """Number of hosts (ranks with this process's local rank)."""
    return topology().cross_size


def threads_per_rank() -> int | None:
    """This rank's share of the host's cores (max(1, cores // ranks on the host)), or None
    when the user's ``OMP_NUM_THREADS`` says how many threads to use. Frameworks size their
    thread pools with it, so that N ranks on one machine do not each use all of its cores.

    The ``OMP_NUM_THREADS`` that ringrun's wrapper sets (``RINGPLUG_RUN_THREADS`` holds the
    same value) is no user's choice: the share is still given, so that TensorFlow's pools,
    which that variable does not size, are split too. The wrapper uses the same rule, so
    torch finds its thread count already right and nothing is applied twice."""
    given = os.environ.get("OMP_NUM_THREADS")
    if given and given != os.environ.get(wire.THREADS_VARIABLE):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // local_size())
