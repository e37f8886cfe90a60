"""The ``NCCL and GPUs`` section of ``ringrun --check``: which NCCL ranks would load, its
version, and the GPUs this host shows (no framework is imported)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from ringplug.run.checks.report import CheckContext, Section


def _gpu_names(environ: dict[str, str]) -> list[str]:
    """``nvidia-smi -L`` lines (all GPUs of the host, before CUDA_VISIBLE_DEVICES)."""
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi is None:
        return []
    try:
        result = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


def _kernel_driver(proc: str) -> str | None:
    """The NVIDIA kernel module's version ("570.86.15"), or ``None`` where none is loaded."""
    if not os.path.exists(proc):
        return None
    try:
        first = (Path(proc) / "version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return "loaded"
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Fri Jan ..."
    found = re.search(r"\s(\d+\.\d+(?:\.\d+)*)\s", first + " ")
    return found.group(1) if found else "loaded"


def _libcuda_loads() -> bool:
    """Whether the driver's user-space library loads in this process (no CUDA call made)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def driver_row(cudart: Any | None) -> tuple[str, bool]:
    """What this host has of the NVIDIA driver, and whether it has any: its kernel module
    (``/proc/driver/nvidia``), its library (``libcuda.so.1``), and the CUDA version it
    supports as the CUDA runtime reports it (0 there means no library could be loaded)."""
    from ringplug.core.gpu.cuda import DRIVER_PROC, cuda_version_text

    kernel = _kernel_driver(DRIVER_PROC)
    library = _libcuda_loads()
    supports = cudart.driver_version() if cudart is not None else 0
    if kernel is None and not library and not supports:
        return f"none (no {DRIVER_PROC}, no libcuda.so.1 to load)", False
    parts = [
        f"kernel module {kernel}" if kernel else f"no kernel module ({DRIVER_PROC})",
        "libcuda.so.1 loads" if library else "libcuda.so.1 cannot be loaded",
    ]
    if supports:
        parts.append(f"supports CUDA {cuda_version_text(supports)}")
    return ", ".join(parts), True


def gpu_section(context: CheckContext) -> Section:
    """NCCL's library and version, the CUDA runtime, and the GPUs visible."""
    # Here, not at the top: ringrun's other commands need none of the core.
    from ringplug.core.gpu import nccl
    from ringplug.core.gpu.cuda import CudaError, CudaRuntime

    environ = dict(context.environ)
    section = Section("NCCL and GPUs")
    try:
        found = nccl.version(environ)
        section.rows.append(("NCCL", f"{found} at {found.path} (found in {found.source})"))
        have_nccl = True
    except nccl.NcclError as error:
        section.rows.append(("NCCL", "not found"))
        missing = str(error)
        have_nccl = False
    visible = 0
    cudart: CudaRuntime | None = None
    try:
        cudart = CudaRuntime(environ)
    except (CudaError, OSError):
        section.rows.append(("CUDA runtime", "not found"))
    else:
        section.rows.append(("CUDA runtime", cudart.path))
    driver, has_driver = driver_row(cudart)
    section.rows.append(("NVIDIA driver", driver))
    if cudart is not None:
        try:
            visible = cudart.device_count()  # 0 without a driver: no GPU, not an error
        except CudaError as error:  # e.g. a driver older than the runtime
            section.warnings.append(str(error))
    mask = environ.get("CUDA_VISIBLE_DEVICES")
    shown = f"{visible}" + (f" (CUDA_VISIBLE_DEVICES={mask})" if mask is not None else "")
    section.rows.append(("GPUs visible", shown))
    for index, name in enumerate(_gpu_names(environ)):
        section.rows.append((f"  nvidia-smi {index}", name))
    if visible and not have_nccl:
        section.warnings.append(f"this host has {visible} GPU(s) but no NCCL: {missing}")
    if not visible:
        section.rows.append(
            ("note", "CPU tensors take the MPI ring; NCCL is used only for GPU tensors")
        )
    if not has_driver:
        section.rows.append(
            (
                "",
                "no NVIDIA driver on this host: its ranks compute on the CPU; for GPUs, "
                "install the driver (the CUDA wheels bring the runtime, not the driver)",
            )
        )
    return section
