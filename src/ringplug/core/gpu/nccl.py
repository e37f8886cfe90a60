"""A thin ctypes binding to NCCL (`libnccl.so.2`): finding it, its version, communicators.

ringplug has no compiled extension; the GPU data plane reaches NCCL through this module
and nothing else does. The library is looked for, in order (`candidates`):

1. ``RINGPLUG_NCCL_LIB`` (a path to the library, or a folder holding it); when it is set,
   nothing else is searched;
2. NVIDIA's cuda-pathfinder, where it is installed: a library already loaded, NVIDIA's
   wheels, the conda environment, the system path and ``NCCL_HOME``;
3. a ``libnccl`` already loaded in this process (torch's CUDA build brings one);
4. the ``nvidia-nccl-cu13`` and ``nvidia-nccl-cu12`` wheels (``ringplug[cuda13]``,
   ``ringplug[cuda12]``);
5. the system's library path (``LD_LIBRARY_PATH``, the ld cache).

Loading needs no GPU: `version()` and `unique_id()` work anywhere the library is; creating a
communicator needs the GPU. Every NCCL failure becomes an `NcclError` that carries NCCL's
own error string and, where the library has it, its last error text.

Communicators are made non-blocking (NCCL 2.14 and later): `ncclCommInitRankConfig`
returns at once and `Communicator.ready` polls it, so that the caller waits under its own
deadline; a peer that never arrives is then a timeout that names it, not a hang.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
import threading
import time
from pathlib import Path

from ..errors import NcclError
from .libraries import mapped_library, pathfinder_library, wheel_library

LIBRARY_VARIABLE = "RINGPLUG_NCCL_LIB"
_LIBRARY_NAME = "libnccl.so.2"
_WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")
UNIQUE_ID_BYTES = 128

# ncclResult_t
SUCCESS = 0
REMOTE_ERROR = 6
IN_PROGRESS = 7
TIMEOUT = 8
RESULT_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",
}
# What the user can do about each result (NCCL's own strings say what happened).
_HINTS = {
    1: "A CUDA call inside NCCL failed: check that the driver supports this CUDA version "
    "(nvidia-smi) and that the GPU is visible (CUDA_VISIBLE_DEVICES).",
    2: "A system call failed (sockets, shared memory): in containers give more shared memory "
    "(--shm-size or --ipc=host), and check the network interface (NCCL_SOCKET_IFNAME).",
    3: "NCCL hit an internal error; rerun with NCCL_DEBUG=INFO and report the output.",
    4: "ringplug passed NCCL an invalid argument; this is a ringplug bug, please report it.",
    5: "NCCL was used incorrectly (e.g. two ranks on one GPU); rerun with NCCL_DEBUG=WARN "
    "to see which.",
    6: "A peer rank failed or the network between the ranks broke; look at the other ranks' "
    "output for the first error.",
    8: "An NCCL operation timed out; a peer is stuck or gone.",
}

# ncclRedOp_t and ncclScalarResidence_t
OP_SUM, OP_PROD, OP_MAX, OP_MIN, OP_AVG = 0, 1, 2, 3, 4
SCALAR_HOST_IMMEDIATE = 1


class NcclNotFound(NcclError):
    """No NCCL library could be loaded; the message lists the places searched."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


CONFIG_MAGIC = 0xCAFEBEEF
CONFIG_VERSION = 21400  # the layout below is ncclConfig_t as NCCL 2.14 defined it


class _Config(ctypes.Structure):
    """The first fields of ``ncclConfig_t`` (NCCL 2.14's whole struct). NCCL reads `size`
    bytes and, for a `version` before 2.17, takes its defaults for every later field."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
    ]

    @classmethod
    def non_blocking(cls) -> _Config:
        return cls(ctypes.sizeof(cls), CONFIG_MAGIC, CONFIG_VERSION, 0)


@dataclasses.dataclass(frozen=True)
class Version:
    """The loaded library: where it is, how it was found, and its version."""

    major: int
    minor: int
    patch: int
    code: int
    path: str
    source: str  # which of the search places found it

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


def parse_version(code: int) -> tuple[int, int, int]:
    """NCCL's version code as (major, minor, patch).

    Releases up to 2.8 encode X*1000 + Y*100 + Z (2708 is 2.7.8); later ones X*10000 +
    Y*100 + Z (22703 is 2.27.3), so a minor version can exceed 9.
    """
    if code < 0:
        raise ValueError(f"NCCL version code {code} is negative.")
    if code >= 10000:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


# ------------------------------------------------------------------ finding the library
def candidates(environ: dict[str, str] | None = None) -> list[tuple[str, str | None]]:
    """Every search place in order, with the library path it gives (None: nothing there)."""
    environ = dict(os.environ) if environ is None else environ
    places: list[tuple[str, str | None]] = []
    explicit = environ.get(LIBRARY_VARIABLE, "")
    if explicit:
        path = Path(explicit)
        if path.is_dir():
            path = path / _LIBRARY_NAME
        places.append((f"{LIBRARY_VARIABLE}={explicit}", str(path) if path.exists() else None))
        return places  # an explicit choice is never silently replaced
    # cuda-pathfinder first where it is installed: it also finds an NCCL already loaded, and
    # it remembers what it found, so asking again names the same place.
    found = pathfinder_library("nccl")
    if found is not None:
        places.append(found)
    places.append(("a libnccl already loaded in this process", mapped_library("/libnccl.so")))
    for wheel in _WHEELS:
        places.append((f"the {wheel} wheel", wheel_library(wheel, "libnccl.so")))
    system = ctypes.util.find_library("nccl")
    places.append(("the system library path (LD_LIBRARY_PATH, ld cache)", system))
    return places


def _not_found_message(places: list[tuple[str, str | None]], failures: list[str]) -> str:
    searched = "; ".join(place for place, _ in places)
    tried = (" Loading failed: " + "; ".join(failures) + ".") if failures else ""
    return (
        f"No NCCL library found (searched: {searched}).{tried} Install it with "
        "`pip install 'ringplug[cuda13]'` (CUDA 13 drivers) or `'ringplug[cuda12]'`, use a CUDA "
        f"build of torch (it brings NCCL), or set {LIBRARY_VARIABLE} to libnccl.so.2."
    )


class Library:
    """The loaded NCCL library with its functions' signatures declared."""

    def __init__(self, path: str, source: str) -> None:
        self.path, self.source = path, source
        self.lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        self._declare()

    def _declare(self) -> None:
        lib, c_int, c_void_p, c_size_t = self.lib, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        pointer = ctypes.POINTER
        signatures = {
            "ncclGetVersion": [pointer(c_int)],
            "ncclGetUniqueId": [pointer(_UniqueId)],
            "ncclCommInitRank": [pointer(c_void_p), c_int, _UniqueId, c_int],
            "ncclCommDestroy": [c_void_p],
            "ncclCommAbort": [c_void_p],
            "ncclCommGetAsyncError": [c_void_p, pointer(c_int)],
            "ncclCommCount": [c_void_p, pointer(c_int)],
            "ncclCommCuDevice": [c_void_p, pointer(c_int)],
            "ncclCommUserRank": [c_void_p, pointer(c_int)],
            "ncclAllReduce": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
            "ncclBroadcast": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
            "ncclAllGather": [c_void_p, c_void_p, c_size_t, c_int, c_void_p, c_void_p],
            "ncclReduceScatter": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
            "ncclGroupStart": [],
            "ncclGroupEnd": [],
            "ncclRedOpCreatePreMulSum": [pointer(c_int), c_void_p, c_int, c_int, c_void_p],
            "ncclRedOpDestroy": [c_int, c_void_p],
        }
        for name, argtypes in signatures.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, c_int
        optional = {  # NCCL 2.14 and later
            "ncclCommInitRankConfig": [
                pointer(c_void_p),
                c_int,
                _UniqueId,
                c_int,
                pointer(_Config),
            ],
            "ncclCommFinalize": [c_void_p],
        }
        self.non_blocking = all(hasattr(lib, name) for name in optional)
        if self.non_blocking:
            for name, argtypes in optional.items():
                function = getattr(lib, name)
                function.argtypes, function.restype = argtypes, c_int
        lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [c_int], ctypes.c_char_p
        self.has_last_error = hasattr(lib, "ncclGetLastError")  # NCCL 2.13 and later
        if self.has_last_error:
            lib.ncclGetLastError.argtypes = [c_void_p]
            lib.ncclGetLastError.restype = ctypes.c_char_p

    def check(self, result: int, call: str, comm: int | None = None) -> None:
        """Raise `NcclError` for a failed `call` (result != ncclSuccess)."""
        if result in (SUCCESS, IN_PROGRESS):
            return
        raise NcclError(self.describe(result, call, comm), result)

    def describe(self, result: int, call: str, comm: int | None = None) -> str:
        name = RESULT_NAMES.get(result, f"result {result}")
        text = (self.lib.ncclGetErrorString(result) or b"").decode(errors="replace")
        last = ""
        if self.has_last_error:
            last = (self.lib.ncclGetLastError(comm) or b"").decode(errors="replace").strip()
        message = f"{call} failed with {name}: {text}"
        if last:
            message += f" (NCCL's last error: {last})"
        hint = _HINTS.get(result)
        return f"{message}. {hint}" if hint else message + "."


_loaded: Library | None = None
_load_lock = threading.Lock()


def load(environ: dict[str, str] | None = None) -> Library:
    """The NCCL library (loaded once per process); raises `NcclNotFound` with the places
    searched when there is none."""
    global _loaded
    with _load_lock:
        if _loaded is not None and environ is None:
            return _loaded
        places = candidates(environ)
        failures = []
        for source, path in places:
            if path is None:
                continue
            try:
                library = Library(path, source)
            except (OSError, AttributeError) as exc:
                failures.append(f"{path}: {exc}")
                continue
            if environ is None:
                _loaded = library
            return library
        raise NcclNotFound(_not_found_message(places, failures))


def version(environ: dict[str, str] | None = None) -> Version:
    """Which NCCL ringplug would use, and its version (no GPU needed)."""
    library = load(environ)
    code = ctypes.c_int()
    library.check(library.lib.ncclGetVersion(ctypes.byref(code)), "ncclGetVersion")
    return Version(*parse_version(code.value), code.value, library.path, library.source)


def unique_id(library: Library | None = None) -> bytes:
    """A new communicator id (128 bytes) for rank 0 to share with the others."""
    library = load() if library is None else library
    uid = _UniqueId()
    library.check(library.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)


# ------------------------------------------------------------------ communicators
class Communicator:
    """One NCCL communicator over every rank of the job, on this process's GPU.

    The caller must have made `device` the current CUDA device of the calling thread.
    Collectives are enqueued on `stream` (a ``cudaStream_t`` as an int) and return at once.

    Creating one returns before every rank has joined where the library can (NCCL 2.14 and
    later, ``blocking`` False): poll `ready` until it is True, under a deadline, and `abort`
    when the deadline passes. An older NCCL joins here, blocking, with no deadline.
    """

    def __init__(
        self,
        library: Library,
        uid: bytes,
        size: int,
        rank: int,
        device: int,
        blocking: bool = True,
    ) -> None:
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}.")
        self.library, self.size, self.rank, self.device = library, size, rank, device
        self.call = f"ncclCommInitRank(rank {rank} of {size}, GPU {device})"
        handle = ctypes.c_void_p()
        native = _UniqueId.from_buffer_copy(uid)
        self.blocking = blocking or not library.non_blocking
        if self.blocking:
            result = library.lib.ncclCommInitRank(ctypes.byref(handle), size, native, rank)
        else:
            self.call = self.call.replace("InitRank", "InitRankConfig")
            config = _Config.non_blocking()
            result = library.lib.ncclCommInitRankConfig(
                ctypes.byref(handle), size, native, rank, ctypes.byref(config)
            )
        self.handle = handle.value
        self.aborted = False
        self.joined = result == SUCCESS
        if result not in (SUCCESS, IN_PROGRESS):
            message = library.describe(result, self.call, self.handle)
            self.abort()
            raise NcclError(message, result)

    def ready(self) -> bool:
        """Whether every rank has joined (never blocks); raises `NcclError` if joining failed."""
        if not self.joined:
            state = self.async_error()
            if state == IN_PROGRESS:
                return False
            if state != SUCCESS:
                message = self.describe(state, self.call)
                self.abort()
                raise NcclError(message, state)
            self.joined = True
        return True

    def _call(self, call: str, result: int) -> None:
        self.library.check(result, call, self.handle)

    def allreduce(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:
        self._call(
            "ncclAllReduce",
            self.library.lib.ncclAllReduce(send, recv, count, dtype, op, self.handle, stream),
        )

    def broadcast(
        self, send: int, recv: int, count: int, dtype: int, root: int, stream: int
    ) -> None:
        self._call(
            "ncclBroadcast",
            self.library.lib.ncclBroadcast(send, recv, count, dtype, root, self.handle, stream),
        )

    def allgather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        self._call(
            "ncclAllGather",
            self.library.lib.ncclAllGather(send, recv, count, dtype, self.handle, stream),
        )

    def reducescatter(
        self, send: int, recv: int, count: int, dtype: int, op: int, stream: int
    ) -> None:
        self._call(
            "ncclReduceScatter",
            self.library.lib.ncclReduceScatter(send, recv, count, dtype, op, self.handle, stream),
        )

    def group_start(self) -> None:
        self._call("ncclGroupStart", self.library.lib.ncclGroupStart())

    def group_end(self) -> None:
        self._call("ncclGroupEnd", self.library.lib.ncclGroupEnd())

    def premul_sum(self, scalar: bytes, dtype: int) -> int:
        """A Sum that first multiplies each input by `scalar` (the raw bytes of one element
        of `dtype`); destroy it with `destroy_op` after the collective is enqueued."""
        op = ctypes.c_int()
        value = ctypes.create_string_buffer(scalar, len(scalar))
        self._call(
            "ncclRedOpCreatePreMulSum",
            self.library.lib.ncclRedOpCreatePreMulSum(
                ctypes.byref(op), value, dtype, SCALAR_HOST_IMMEDIATE, self.handle
            ),
        )
        return op.value

    def destroy_op(self, op: int) -> None:
        self._call("ncclRedOpDestroy", self.library.lib.ncclRedOpDestroy(op, self.handle))

    def async_error(self) -> int:
        """NCCL's asynchronous error state (ncclSuccess while healthy)."""
        result = ctypes.c_int()
        self._call(
            "ncclCommGetAsyncError",
            self.library.lib.ncclCommGetAsyncError(self.handle, ctypes.byref(result)),
        )
        return result.value

    def describe(self, result: int, call: str) -> str:
        return self.library.describe(result, call, self.handle)

    def abort(self) -> None:
        """Tear the communicator down without waiting for peers (after an error)."""
        if self.handle is not None and not self.aborted:
            self.aborted = True
            self.library.lib.ncclCommAbort(self.handle)

    def close(self, deadline_seconds: float) -> bool:
        """Finish the communicator's work and free it, or abort it if that takes longer
        than `deadline_seconds` (a peer gone mid-collective): shutdown never waits for
        ever. Whether it closed cleanly."""
        if self.handle is None or self.aborted:
            self.handle = None
            return False
        if self.blocking or not self.joined:
            # An older NCCL's ncclCommDestroy may wait for peers with no deadline, and a
            # communicator that never joined has nothing to finish: abort, which waits
            # for nothing.
            self.abort()
            self.handle = None
            return self.joined
        result = self.library.lib.ncclCommFinalize(self.handle)
        end = time.monotonic() + deadline_seconds
        delay = 1e-4
        state = result
        while state == IN_PROGRESS and time.monotonic() < end:
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
            state = self.async_error()
        if state != SUCCESS:
            self.abort()
            self.handle = None
            return False
        self.library.lib.ncclCommDestroy(self.handle)
        self.handle = None
        return True
