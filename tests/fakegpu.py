"""Build the fake NCCL and CUDA runtime (tests/fakes/*.c) and the environment that points
ringplug at them. The fake NCCL finds the fake CUDA runtime loaded in the process (as the real
NCCL carries its own runtime, it has no libcudart among its dependencies) and runs its
collectives on the runtime's stream threads."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

FAKES = Path(__file__).parent / "fakes"


def _compile(source: Path, target: Path, soname: str, *link: str) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the fake NCCL and CUDA runtime")
    subprocess.run(
        [
            compiler,
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            f"-Wl,-soname,{soname}",
            "-o",
            str(target),
            str(source),
            *link,
            "-lpthread",
            "-lm",
        ],
        check=True,
        timeout=120,
    )


def build(directory: Path) -> dict[str, str]:
    """Compile both into `directory`: paths of libnccl.so.2 and libcudart.so.13."""
    nccl, cudart = directory / "libnccl.so.2", directory / "libcudart.so.13"
    _compile(FAKES / "fake_cudart.c", cudart, "libcudart.so.13")
    _compile(FAKES / "fake_nccl.c", nccl, "libnccl.so.2", "-ldl")
    return {"nccl": str(nccl), "cudart": str(cudart), "dir": str(directory)}


def fake_env(fakes: dict[str, str], **extra: str) -> dict[str, str]:
    """This environment with ringplug pointed at the fakes (and their meeting folders in
    the fakes' own folder, removed with the test session's temporary files)."""
    env = dict(os.environ)
    env.update(
        RINGPLUG_NCCL_LIB=fakes["nccl"],
        RINGPLUG_CUDART_LIB=fakes["cudart"],
        FAKE_NCCL_DIR=fakes["dir"],
    )
    env.update(extra)
    return env
