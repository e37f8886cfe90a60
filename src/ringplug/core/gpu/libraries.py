"""Finding shared libraries the way the GPU data plane needs: already mapped into this
process, or shipped in an installed wheel (NVIDIA's wheels put them in ``nvidia/*/lib``)."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path


def mapped_library(fragment: str) -> str | None:
    """The path of a library this process has already mapped whose path contains
    `fragment` (e.g. ``"/libnccl.so"``, loaded by ``import torch``), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and fragment in parts[5] and os.path.exists(parts[5]):
            return parts[5]
    return None


def wheel_library(distribution: str, prefix: str) -> str | None:
    """The path of the file named `prefix`* that the installed `distribution` ships."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.startswith(prefix):
            path = Path(file.locate())
            if path.exists():
                return str(path)
    return None


PATHFINDER_PLACE = "cuda-pathfinder"
"""How the search places name NVIDIA's cuda-pathfinder (followed by how it found the file)."""

_PATHFINDER_WHERE = {
    "site-packages": "an NVIDIA wheel",
    "conda": "the conda environment",
    "system-search": "the system library path",
    "CUDA_PATH": "CUDA_PATH/CUDA_HOME",
    "was-already-loaded-from-elsewhere": "already loaded",
}


def pathfinder_library(name: str) -> tuple[str, str | None] | None:
    """Where NVIDIA's cuda-pathfinder finds the CUDA library `name` (``"nccl"``,
    ``"cudart"``): a search place and the path it found (None: not found).

    None when cuda-pathfinder is not installed. It searches NVIDIA's wheels in
    site-packages, the conda environment, the system library path and the install roots
    (``NCCL_HOME``, ``CUDA_PATH``/``CUDA_HOME``), and is updated by NVIDIA with each CUDA
    release, so it knows wheel layouts and library names that a hand-written list would
    miss. It loads the library it finds (``RTLD_GLOBAL``); loading the same path again is
    free.
    """
    try:
        from cuda import pathfinder
    except ImportError:
        return None
    # In current releases the two "unknown library" errors subclass DynamicLibNotFoundError,
    # so they are caught first; older releases lack them (a name that is not there must not
    # turn the except clause itself into an AttributeError).
    unknown = tuple(
        getattr(pathfinder, error)
        for error in ("DynamicLibUnknownError", "DynamicLibNotAvailableError")
        if isinstance(getattr(pathfinder, error, None), type)
    )
    try:
        loaded = pathfinder.load_nvidia_dynamic_lib(name)
    except unknown as error:
        # A cuda-pathfinder that does not know this library: the other places still apply.
        return f"{PATHFINDER_PLACE} ({error})", None
    except pathfinder.DynamicLibNotFoundError:
        return f"{PATHFINDER_PLACE} (NVIDIA wheels, conda, system, install roots)", None
    except OSError as error:
        # Found, but it would not load (wrong architecture, missing dependency).
        return f"{PATHFINDER_PLACE} (found a library that did not load: {error})", None
    found_via = getattr(loaded, "found_via", "") or "found"
    where = _PATHFINDER_WHERE.get(found_via, found_via)
    return f"{PATHFINDER_PLACE} ({where})", loaded.abs_path
