"""The ``NCCL and GPUs`` section of ``ringrun --check``: which NCCL ranks would load, its
version, and the GPUs this host shows (no framework is imported)."""

from __future__ import annotations

import shutil
import subprocess

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
    try:
        cudart = CudaRuntime(environ)
    except (CudaError, OSError):
        section.rows.append(("CUDA runtime", "not found"))
    else:
        section.rows.append(("CUDA runtime", cudart.path))
        try:
            visible = cudart.device_count()
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
    return section
