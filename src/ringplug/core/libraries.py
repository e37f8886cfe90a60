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
