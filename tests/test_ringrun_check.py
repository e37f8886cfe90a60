"""``ringrun --check`` reports the environment ranks run in and warns about mixed MPIs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fakegpu import fake_env
from launch import SOURCE_DIR, run_ringrun, write_executable
from ringplug.run.checks.check import (
    CheckContext,
    keras_backend,
    system_mpi_installations,
    venv_mpi_libraries,
)


def test_report_names_python_ringplug_mpi_and_frameworks():
    result = run_ringrun("--check", timeout=90)
    assert result.returncode == 0, result.stderr
    report = result.stdout
    assert f"executable         {sys.executable}" in report
    assert "ringplug\n  version" in report
    assert "mpi4py             4." in report
    assert "library            MPICH Version: 5." in report
    assert f"launcher           {os.path.dirname(sys.executable)}/mpiexec" in report
    assert "(hydra)" in report
    assert "torch              2." in report
    for name in ("lightning", "pytorch_lightning", "tensorflow", "keras", "jax"):
        assert f"\n  {name.ljust(17)}  " in report
    assert "not installed" not in report.partition("Frameworks")[2].partition("\n\n")[0]


def test_frameworks_are_not_imported_to_report_them():
    code = (
        "import sys; from ringplug.run.checks.check import frameworks_section, CheckContext; "
        "frameworks_section(CheckContext()); print('torch' in sys.modules)"
    )
    import subprocess

    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "False"


def test_system_mpiexec_beside_the_wheel_gives_a_warning(tmp_path):
    write_executable(tmp_path / "mpiexec", "#!/bin/sh\necho 'mpiexec (Open MPI) 4.1.6'\n")
    path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
    result = run_ringrun("--check", extra_env={"PATH": path}, timeout=90)
    assert result.returncode == 0, result.stderr
    assert f"system MPI         {tmp_path}/mpiexec" in result.stdout
    warning = next(line for line in result.stdout.splitlines() if "two MPI" in line)
    assert warning.startswith("WARNING:")
    assert "loads the virtualenv's libmpi first" in warning
    assert "pip uninstall mpich" in warning
    assert "MPI4PY_LIBMPI" in warning


def test_no_warning_when_only_the_wheel_is_installed(tmp_path):
    context = CheckContext(environ={"PATH": str(tmp_path)}, ldconfig=lambda: "")
    assert venv_mpi_libraries(context.prefix), "this check needs the mpich wheel"
    assert system_mpi_installations(context) == []


def test_system_libmpi_known_to_the_linker_counts_as_system_mpi(tmp_path):
    ldconfig = (
        "3 libs found in cache `/etc/ld.so.cache'\n"
        "\tlibmpi.so.40 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libmpi.so.40\n"
        "\tlibm.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libm.so.6\n"
    )
    context = CheckContext(environ={"PATH": str(tmp_path)}, ldconfig=lambda: ldconfig)
    assert system_mpi_installations(context) == ["/usr/lib/x86_64-linux-gnu/libmpi.so.40"]


def test_the_virtualenvs_own_mpiexec_is_not_a_system_mpi():
    context = CheckContext(environ={"PATH": os.path.dirname(sys.executable)}, ldconfig=lambda: "")
    assert system_mpi_installations(context) == []


def _install(site: Path, module: str, distribution: str, version: str) -> None:
    """A package `module` installed by the distribution `distribution`, as pip lays it out."""
    (site / module).mkdir()
    (site / module / "__init__.py").write_text("raise SystemExit('imported')\n")
    info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
    )
    (info / "top_level.txt").write_text(f"{module}\n")


def test_frameworks_are_found_whichever_distribution_installed_them(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    _install(site, "tensorflow", "tensorflow-cpu", "2.99.0")
    _install(site, "keras", "keras", "2.15.0")
    _install(site, "pytorch_lightning", "pytorch-lightning", "2.9.1")
    code = (
        "from ringplug.run.checks.check import CheckContext, format_report, frameworks_section;"
        "print(format_report([frameworks_section(CheckContext())]))"
    )
    # Only the fake site and ringplug's source: none of this virtualenv's frameworks.
    result = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env={"PYTHONPATH": f"{site}{os.pathsep}{SOURCE_DIR}", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = dict(line.strip().split(None, 1) for line in result.stdout.splitlines()[1:] if line)
    assert rows == {
        "torch": "not installed",
        "lightning": "not installed",
        "pytorch_lightning": "2.9.1",
        "tensorflow": "2.99.0 (from tensorflow-cpu)",
        "keras": "2.15.0, backend tensorflow (Keras 2)",
        "jax": "not installed",
    }


def test_keras_backend_is_read_as_keras_reads_it(tmp_path):
    home = tmp_path / "home"
    (home / ".keras").mkdir(parents=True)
    assert keras_backend({"HOME": str(home)}) == ("tensorflow", "Keras's default")
    config = home / ".keras" / "keras.json"
    config.write_text(json.dumps({"backend": "jax", "floatx": "float32"}))
    assert keras_backend({"HOME": str(home)}) == ("jax", str(config))
    assert keras_backend({"HOME": str(home), "KERAS_BACKEND": "torch"}) == (
        "torch",
        "KERAS_BACKEND",
    )
    elsewhere = tmp_path / "keras-home"
    elsewhere.mkdir()
    (elsewhere / "keras.json").write_text(json.dumps({"backend": "torch"}))
    assert keras_backend({"HOME": str(home), "KERAS_HOME": str(elsewhere)})[0] == "torch"


# ------------------------------------------------------------------ the NVIDIA driver
GPU_SECTION = """
import json, sys
from ringplug.core.gpu import cuda
from ringplug.run.checks.check import CheckContext, format_report
from ringplug.run.checks.gpu import gpu_section

if len(sys.argv) > 1:
    cuda.DRIVER_PROC = sys.argv[1]  # a kernel driver's /proc folder, made by the test
section = gpu_section(CheckContext())
print(json.dumps({"rows": dict(section.rows), "warnings": section.warnings}))
"""


def _gpu_section(env: dict[str, str], *args: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(GPU_SECTION), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def driverless() -> None:
    """These tests play the driver's part with the fake CUDA runtime: not on a machine
    that has a real one."""
    if os.path.exists("/proc/driver/nvidia"):
        pytest.skip("this machine has an NVIDIA driver")


@pytest.mark.fakegpu
def test_no_driver_at_all_is_said_so_not_taken_for_an_old_one(fakes, driverless):
    # What the CUDA runtime answers where libcuda.so.1 cannot be loaded: error 35 (as for
    # an old driver), and a driver version of 0.
    env = fake_env(fakes, FAKE_CUDA_COUNT_ERROR="35", FAKE_CUDA_DRIVER_VERSION="0")
    report = _gpu_section(env)
    assert (
        report["rows"]["NVIDIA driver"] == "none (no /proc/driver/nvidia, no libcuda.so.1 to load)"
    )
    assert report["rows"]["GPUs visible"] == "0"
    assert report["rows"][""].startswith("no NVIDIA driver on this host")
    assert report["warnings"] == []


@pytest.mark.fakegpu
def test_a_driver_older_than_the_runtime_is_still_said_to_be_old(fakes, driverless):
    env = fake_env(fakes, FAKE_CUDA_COUNT_ERROR="35", FAKE_CUDA_DRIVER_VERSION="12080")
    report = _gpu_section(env)
    assert report["rows"]["NVIDIA driver"].endswith("supports CUDA 12.8")
    [warning] = report["warnings"]
    assert "supports CUDA 12.8, older than the CUDA runtime 13.0" in warning
    assert "" not in report["rows"]  # no "no driver" line


@pytest.mark.fakegpu
def test_a_kernel_driver_without_its_library_says_how_to_reach_it(fakes, driverless, tmp_path):
    proc = tmp_path / "nvidia"
    proc.mkdir()
    (proc / "version").write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Fri Jan 10 2025\n"
    )
    env = fake_env(fakes, FAKE_CUDA_COUNT_ERROR="35", FAKE_CUDA_DRIVER_VERSION="0")
    report = _gpu_section(env, str(proc))
    assert report["rows"]["NVIDIA driver"] == (
        "kernel module 570.86.15, libcuda.so.1 cannot be loaded"
    )
    [warning] = report["warnings"]
    assert "libcuda.so.1 cannot be loaded" in warning and "--gpus all" in warning
    assert "update the driver" not in warning
