"""``ringrun --check`` reports the environment ranks run in and warns about mixed MPIs."""

from __future__ import annotations

import os
import sys

from launch import run_ringrun, write_executable
from ringplug.run.checks.check import CheckContext, system_mpi_installations, venv_mpi_libraries


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
    assert "tensorflow" in report


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
