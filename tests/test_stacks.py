"""The interpreter and MPI under test are the ones the ranks run, end to end.

``make test-oldest`` / ``make test-newest`` run these (with the core, ringrun, a Lightning
and a Keras job) on Python 3.10 and 3.13, ``make test-openmpi`` on Open MPI; the full suite
runs them on its own interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytestmark = pytest.mark.multirank

INFO = str(Path(__file__).parent / "workers" / "stack_info.py")


def mpi_library_here() -> str:
    """The first line of the MPI library's version that mpi4py loads in this venv."""
    code = "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0].strip())"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return result.stdout.strip()


def test_every_rank_runs_this_interpreter_and_this_venvs_mpi(tmp_path):
    result = run_ringrun("-np", "3", sys.executable, INFO, str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    library = mpi_library_here()
    assert library.startswith(("MPICH", "Open MPI")), library
    for rank in range(3):
        info = json.loads((tmp_path / f"info-{rank}.json").read_text())
        assert (info["rank"], info["size"]) == (rank, 3)
        assert info["python"] == list(sys.version_info[:2])
        assert info["executable"] == sys.executable
        assert info["mpi_library"] == library
        assert info["sum"] == [6.0, 6.0, 6.0]


def test_a_toml_launch_file_starts_the_job_on_this_interpreter(tmp_path):
    # Python 3.10 has no tomllib: this reads the file through tomli, a dependency there.
    config = tmp_path / "launch.toml"
    config.write_text('np = 2\n\n[env]\nSTACK_FROM_TOML = "yes"\n')
    result = run_ringrun(
        "--config-file", str(config), sys.executable, INFO, str(tmp_path), "STACK_FROM_TOML"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        info = json.loads((tmp_path / f"info-{rank}.json").read_text())
        assert info["size"] == 2 and info["env"] == {"STACK_FROM_TOML": "yes"}
    assert not (tmp_path / "info-2.json").exists()
