"""Fault injection: no failure hangs, every failure names its cause, no secret on a command line.

Real 2- and 3-rank jobs under ringrun, each with one rank failing from inside (see
tests/workers/faults.py): frozen in negotiation, in the ring, in MPI's Iallreduce, in user
code, stuck in C code holding the GIL, killed, failing on its engine thread, leaving early.
The ranks' own timeouts are short (RINGPLUG_TIMEOUT=3), so each job ends by itself in
seconds; the `subprocess` bound only turns a regression into a failure instead of a hang.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from launch import processes_matching, run_ringrun, unique_marker

WORKER = str(Path(__file__).parent / "workers" / "faults.py")
# RINGPLUG_TIMEOUT + 10 s is the bound the issue sets from the fault to the end of the
# job; starting 3 ranks on a loaded 2-core machine takes a few seconds more.
JOB_BOUND_S = 40
FAST = {
    "RINGPLUG_TIMEOUT": "3",
    "RINGPLUG_STALL_CHECK_SECONDS": "1",
    "RINGPLUG_RING_THRESHOLD": "64K",
}


def run_scenario(scenario: str, ranks: int, *extra: str, env: dict[str, str] | None = None):
    marker = unique_marker(scenario)
    result = run_ringrun(
        "-np",
        str(ranks),
        sys.executable,
        WORKER,
        scenario,
        marker,
        *extra,
        extra_env={**FAST, **(env or {})},
        timeout=JOB_BOUND_S,
    )
    assert processes_matching(marker) == [], "ranks were left running"
    return result, result.stdout + result.stderr


# (scenario, ranks, where the waiting ranks are when the job ends)
FROZEN = [
    ("stop-negotiation", 3, "negotiation"),
    ("stop-ring", 2, "allreduce 'stuck' (ring reduce-scatter step 1 of 1"),
    ("stop-ring", 3, "allreduce 'stuck' (ring reduce-scatter step"),
    ("stop-mpi", 3, "allreduce 'stuck' (MPI Iallreduce)"),
    ("stop-user", 2, "negotiation"),
    ("stop-user-agreed", 3, "negotiation (pending here: 'warm-up')"),
    ("gil", 3, "negotiation"),
]


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("scenario", "ranks", "where"), FROZEN, ids=[f"{s}-{n}" for s, n, _ in FROZEN]
)
def test_a_frozen_rank_is_reported_then_ends_the_job_and_is_named(scenario, ranks, where):
    result, output = run_scenario(scenario, ranks)
    assert result.returncode == 1, output
    healthy = [r for r in range(ranks) if r != 1]
    # The stall check names it first (on the lowest healthy rank), then the timeout ends
    # the job; every healthy rank that gets there before the launcher stops it says why,
    # naming rank 1 and where it waited.
    assert "Stall: rank 0 has waited" in output
    assert "rank 1 stopped taking part: it sent no notice of waiting" in output
    fatal = [line for line in output.splitlines() if "FATAL" in line]
    assert fatal, output
    for line in fatal:
        assert any(f"ringplug[{rank}] FATAL: rank {rank} has waited" in line for rank in healthy)
        assert f"in {where}" in line
        assert "rank 1 stopped answering: it neither did its part nor said it was waiting" in line
        assert "(RINGPLUG_TIMEOUT=3)" in line
    if scenario == "stop-user-agreed":
        # The healthy ranks' calls of the warm-up's form ran fast cycles on the callers'
        # threads (the wait above is inside one of them).
        ran = dict(re.findall(r"\[(\d)\] fast cycles run by callers: (\d+)", output))
        assert sorted(ran) == [str(r) for r in healthy] and all(int(n) for n in ran.values())
    # ringrun names the frozen rank, not the first rank that gave up on it.
    named_by = "rank 0" if ranks == 2 else "ranks 0, 2"
    assert f"ringrun: rank 1 stopped taking part in the job (named by {named_by})" in (
        result.stderr
    )


@pytest.mark.multirank
def test_a_rank_frozen_where_the_negotiation_relays_is_named_and_an_idle_rank_is_not():
    # Rank 2 waits in a negotiation whose messages reach rank 0 only through rank 1, frozen;
    # rank 0 computes, its engine idle, and answers rank 2's notice that it is alive.
    result, output = run_scenario("stop-behind-idle", 3)
    assert result.returncode == 1, output
    assert "Stall: rank 2 has waited" in output
    assert "rank 1 stopped taking part: it sent no notice of waiting" in output
    fatal = [line for line in output.splitlines() if "FATAL" in line]
    assert fatal, output
    for line in fatal:
        assert "ringplug[2] FATAL: rank 2 has waited" in line
        assert "rank 1 stopped answering: it neither did its part nor said it was waiting" in line
        assert "rank 0 is alive with nothing to run" in line
    assert "ringrun: rank 1 stopped taking part in the job (named by rank 2)" in result.stderr


@pytest.mark.multirank
def test_a_frozen_rank_is_named_by_every_other_rank_of_eight_that_agree_before_gathering():
    # From 8 ranks a cycle first agrees on the messages' form (exchange.gathers_only).
    result, output = run_scenario("stop-negotiation", 8)
    assert result.returncode == 1, output
    assert "Stall: rank 0 has waited" in output
    assert "rank 1 stopped taking part: it sent no notice of waiting" in output
    fatal = [line for line in output.splitlines() if "FATAL" in line]
    assert fatal, output
    for line in fatal:
        assert "in negotiation (pending here: 'stuck')" in line
        assert "rank 1 stopped answering: it neither did its part nor said it was waiting" in line
    assert "ringrun: rank 1 stopped taking part in the job (named by ranks 0, 2" in result.stderr


@pytest.mark.multirank
def test_a_killed_rank_is_named_with_its_signal_on_two_ranks():
    result, output = run_scenario("kill", 2)
    assert result.returncode == 137
    assert "ringrun: rank 1 on host" in result.stderr and "SIGKILL" in result.stderr


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [2, 3])
def test_an_exception_on_the_engine_thread_fails_that_collective_everywhere_and_the_job_goes_on(
    ranks,
):
    result, output = run_scenario("engine-errors", ranks)
    assert result.returncode == 0, output
    memory = "MemoryError: cannot allocate the allgather result (injected)"
    assert f"rank 1: allgather raised {memory}" in output
    read_only = "ValueError: assignment destination is read-only"
    assert f"rank 1: read-only allreduce raised {read_only}" in output
    injected = "MemoryError: cannot reduce (injected)"
    assert f"rank 1: mid allreduce raised {injected}" in output
    for rank in range(ranks):
        if rank != 1:
            assert (
                f"rank {rank}: allgather raised PeerFailedError: rank 1 failed allgather "
                f"'gathered': {memory}"
            ) in output
            assert (
                f"rank {rank}: read-only allreduce raised PeerFailedError: rank 1 failed "
                f"allreduce 'ro': {read_only}"
            ) in output
            assert (
                f"rank {rank}: mid allreduce raised PeerFailedError: rank 1 failed "
                f"allreduce 'mid': {injected}"
            ) in output
        assert f"rank {rank}: mid ran a fast cycle: True" in output
        assert f"rank {rank}: later collectives are correct" in output


def first_verdict(stderr: str) -> str:
    """ringrun's first line about the job's end (the root cause it names)."""
    return next(
        (
            line
            for line in stderr.splitlines()
            if line.startswith("ringrun:") and not line.startswith("ringrun: flight records")
        ),
        "",
    )


# Waits long enough that only rank 1's own notice can end the job this soon.
PATIENT = {"RINGPLUG_TIMEOUT": "30", "RINGPLUG_STALL_CHECK_SECONDS": "20"}


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [2, 3])
def test_an_engine_that_dies_completing_a_batch_fails_every_handle_and_tells_its_peers(ranks):
    result, output = run_scenario("engine-dies", ranks, env=PATIENT)
    failure = "RingplugError: the ringplug engine failed: completing the batch failed (injected)"
    assert f"rank 1: 8 of 8 failed: ['{failure}']" in output
    assert "rank 0: 0 of 8 failed" in output  # its collective had run everywhere
    # Rank 1 told the others: their next negotiation fails with its text, not the timeout.
    told = (
        "PeerEngineFailedError: negotiation cannot complete: rank 1's ringplug engine failed "
        "for good (in allreduce 'burst0' (fused with 7 more), engine cycle "
    )
    for rank in range(ranks):
        if rank != 1:
            assert f"[{rank}] ringplug.core.errors.{told}" in output, output
            assert f"uncaught PeerEngineFailedError on rank {rank} (caused by rank 1)" in output
    assert "RuntimeError: completing the batch failed (injected). Every rank must" in output
    assert "stopped answering" not in output and "Stall:" not in output
    # It left with its own code, and ringrun names it first.
    assert result.returncode != 0
    assert first_verdict(result.stderr).startswith("ringrun: rank 1 on host"), result.stderr
    assert "exited with code 4" in result.stderr


@pytest.mark.multirank
def test_a_peer_waiting_inside_the_ring_hears_that_an_engine_died():
    result, output = run_scenario("engine-dies-in-ring", 2, env=PATIENT)
    assert "rank 1: RingplugError: the ringplug engine failed: starting the collective failed" in (
        output
    )
    # Rank 0 was inside the ring's exchange, waiting for rank 1's data.
    assert (
        "rank 0: PeerEngineFailedError: allreduce 'big' cannot complete: rank 1's ringplug "
        "engine failed for good (in allreduce 'big', engine cycle "
    ) in output, output
    assert "stopped answering" not in output and "Stall:" not in output
    assert first_verdict(result.stderr).startswith("ringrun: rank 1 on host"), result.stderr
    assert "exited with code 4" in result.stderr


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [2, 3])
def test_sys_exit_on_rank_0_gives_the_job_its_code_and_names_it(ranks):
    result, output = run_scenario("exit-3", ranks)
    assert result.returncode == 3, output
    assert "ringrun: rank 0 on host" in result.stderr
    assert "exited with code 3" in result.stderr
    assert "caused by rank 0" in output  # what the waiting ranks said


@pytest.mark.multirank
def test_a_rank_that_leaves_early_with_code_0_is_named():
    result, output = run_scenario("exit-0-early", 2)
    assert result.returncode != 0
    assert "ringrun: rank 1 on host" in result.stderr
    assert "exited with code 0 before the other ranks were done: it left the job early" in (
        result.stderr
    )


@pytest.mark.multirank
def test_max_and_min_propagate_nan_on_every_path_rank_and_size():
    result, output = run_scenario("nan", 3)
    assert result.returncode == 0, output
    for rank in range(3):
        assert f"rank {rank}: nan results wrong in []" in output


SECRET = "s3cr3t-" + "9f2c41d7"


@pytest.mark.multirank
@pytest.mark.parametrize("source", ["flag", "config-file"])
def test_secrets_reach_the_ranks_but_no_command_line(source, tmp_path):
    digest = hashlib.sha256(SECRET.encode()).hexdigest()
    if source == "flag":
        given = ["-x", f"RINGPLUG_TEST_SECRET={SECRET}"]
    else:
        config = tmp_path / "job.toml"
        config.write_text(f'[env]\nRINGPLUG_TEST_SECRET = "{SECRET}"\n')
        given = ["--config-file", str(config)]
    marker = unique_marker("secret")
    result = run_ringrun(
        *given,
        "--verbose",
        "-np",
        "2",
        sys.executable,
        WORKER,
        "secret",
        marker,
        digest,
        extra_env=FAST,
        timeout=JOB_BOUND_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for rank in range(2):
        assert f"rank {rank}: secret arrived=True" in output
    # Only on ringrun's own, where the test typed it (`-x NAME` with the value in the
    # environment keeps it off that one too); never on the launcher's, a wrapper's or a rank's.
    on = [
        line.split("command line of: ")[1]
        for line in output.splitlines()
        if "secret on the command line of" in line
    ]
    assert all("ringplug.run.cli" in where for where in on), on
    if source == "config-file":
        assert on == []
    assert SECRET not in output  # --verbose shows the name only
    assert "RINGPLUG_TEST_SECRET=<hidden>" in result.stderr
    dry = run_ringrun(*given, "--dry-run", "-np", "2", "python", "x.py", timeout=30)
    assert dry.returncode == 0 and SECRET not in dry.stdout + dry.stderr
    assert "RINGPLUG_TEST_SECRET=<hidden>" in dry.stdout


# ---------------------------------------------------------------- bad settings, one line each
def ringrun_error(*args: str, env: dict[str, str] | None = None) -> str:
    result = run_ringrun(*args, extra_env=env, timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("ringrun: error:")]
    return line


def test_an_infinite_cycle_time_is_refused():
    line = ringrun_error("--dry-run", "-np", "2", "--cycle-time-ms", "inf", "python", "x.py")
    # the ranks' own bound (ringplug.config), named with the flag that gave the value
    assert "--cycle-time-ms (cycle_time_ms): RINGPLUG_CYCLE_TIME='inf' must be a finite" in line


@pytest.mark.parametrize("content", [b"\x7fELF\x02\x01\x00\x00binary", None])
def test_a_hostfile_that_is_no_text_file_is_refused(content, tmp_path):
    path = "/dev/zero"
    if content is not None:
        path = str(tmp_path / "hosts.bin")
        Path(path).write_bytes(content)
    line = ringrun_error("--dry-run", "--hostfile", path, "python", "x.py")
    assert path in line
    assert ("not a text file" if content else "is not a regular file") in line


def test_an_infinite_start_timeout_in_a_config_file_is_refused(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text("start_timeout = inf\n")
    line = ringrun_error("--config-file", str(config), "--dry-run", "-np", "2", "python", "x.py")
    assert "start_timeout must be a finite number of seconds" in line


@pytest.mark.parametrize("name", ["RINGPLUG_RUN_EVENTS", "PMI_RANK", "OMPI_COMM_WORLD_RANK"])
def test_x_of_a_variable_ringrun_or_the_launcher_sets_is_refused(name):
    line = ringrun_error("--dry-run", "-np", "2", "-x", f"{name}=1", "python", "x.py")
    assert f"{name} is set by ringrun or the MPI launcher" in line


def test_x_of_something_that_is_no_variable_name_is_refused():
    assert "'A B' is not a variable name" in ringrun_error(
        "--dry-run", "-np", "2", "-x", "A B=1", "python", "x.py"
    )


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("RINGPLUG_TIMEOUT", "nan", "must be a finite number of seconds"),
        ("RINGPLUG_TIMEOUT", "inf", "must be a finite number of seconds"),
        ("RINGPLUG_CYCLE_TIME", "inf", "must be a finite number of milliseconds"),
        ("RINGPLUG_CYCLE_TIME", "5000", "at most 1000 milliseconds"),
        ("RINGPLUG_FUSION_THRESHOLD", "inf", "as a byte count"),
        ("RINGPLUG_LOG_LEVEL", "loud", "is not a log level"),
    ],
)
def test_rank_settings_that_would_break_the_engine_are_refused(name, value, says, monkeypatch):
    from ringplug.config import read_settings

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=says):
        read_settings()


def test_the_stall_check_may_be_turned_off_with_infinity(monkeypatch):
    from ringplug.config import read_settings

    monkeypatch.setenv("RINGPLUG_STALL_CHECK_SECONDS", "inf")
    assert read_settings().stall_check_seconds == float("inf")


# ---------------------------------------------------------------- pieces, in one process
def test_core_and_ringrun_take_the_rank_events_from_one_vocabulary():
    # no copies to keep equal: both sides name the wire's constants (the next test reads a
    # line the core wrote with ringrun's parser)
    from ringplug.core import log
    from ringplug.run.launch import status

    for module in (log, status):
        assert not {"EVENTS_VARIABLE", "EVENT_MARK", "FAULT"} & set(vars(module))
        assert module.wire is sys.modules["ringplug.wire"]


def test_a_fault_line_from_the_core_is_read_by_ringrun():
    code = "from ringplug.core import log; log.end_job(2, 'rank 2 gave up on rank 0', culprits=[0])"
    env = {**os.environ, "RINGPLUG_RUN_EVENTS": "tok"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )
    from ringplug.run.launch.status import RankFault, parse_event

    assert result.returncode == 1
    assert "ringplug[2] FATAL: rank 2 gave up on rank 0" in result.stderr
    events = [parse_event(line, "tok") for line in result.stderr.splitlines()]
    (fault,) = [event for event in events if event is not None]
    assert isinstance(fault, RankFault)
    assert (fault.rank, fault.culprits, fault.message) == (2, (0,), "rank 2 gave up on rank 0")


def test_the_rank_others_name_is_the_root_cause_whatever_ended_first():
    from ringplug.run.launch.job import find_root_cause
    from ringplug.run.launch.status import RankFault, RankStatus

    gave_up = RankStatus(0, "h", 10, 1, None, timestamp=100.0)  # ended first
    killed = RankStatus(1, "h", 11, None, "SIGKILL", timestamp=104.0)  # in the teardown
    fault = RankFault(0, (1,), "rank 0 ... rank(s) 1 stopped answering", timestamp=99.9)
    root = find_root_cause([gave_up, killed], [100.0, 104.0], [fault], [])
    assert root.rank == 1 and root.status is None and root.named_by == (0,)
    assert root.exit_code == 1
    # A rank that exited with its own code before the others gave up keeps it.
    exited = RankStatus(1, "h", 11, 3, None, timestamp=101.0)
    root = find_root_cause([gave_up, exited], [100.0, 101.0], [fault], [])
    assert root.rank == 1 and root.exit_code == 3


def test_one_huge_line_is_relayed_whole():
    from ringplug.run.launch.processes import pump_lines

    read_end, write_end = os.pipe()
    line = b"x" * (32 << 20) + b"\n"

    def write() -> None:
        with os.fdopen(write_end, "wb") as stream:
            stream.write(line + b"tail")

    writer = threading.Thread(target=write)
    writer.start()
    lines: list[bytes] = []
    pump_lines(os.fdopen(read_end, "rb"), lines.append)
    writer.join(30)
    assert lines == [line, b"tail"]
