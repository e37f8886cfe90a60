"""Elastic jobs: ringrun starts a failed job again with the hosts and slots left.

Real jobs under ringrun (tests/workers/elastic.py) whose ranks are killed, fail again
during the restart, fail every time, or are preempted, with a discovery script whose
answer changes between starts; and the restart logic itself against a fake job.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from launch import RINGRUN, discovery_script, processes_matching, run_ringrun, unique_marker
from ringplug.run.hosts.spec import Host
from ringplug.run.hosts.ssh import HostProblem
from ringplug.run.launch import elastic
from ringplug.run.launch.elastic import ElasticError, ElasticPlan, discover, run_elastic
from ringplug.run.launch.job import JobResult
from ringplug.run.launch.status import RankStarted

WORKER = str(Path(__file__).parent / "workers" / "elastic.py")


def run_elastic_job(folder: Path, scenario: str, *flags: str):
    marker = unique_marker(scenario)
    result = run_ringrun(
        *flags,
        sys.executable,
        WORKER,
        str(folder),
        scenario,
        marker,
        extra_env={"RINGPLUG_TIMEOUT": "10"},
        timeout=120,
    )
    assert processes_matching(marker) == [], "ranks were left running"
    return result, result.stdout + result.stderr


# What the resume workers (tests/workers/lightning_elastic.py, keras_elastic.py) write:
# a ledger line per trained batch, and a report at the end of a fit.
def ledger(folder: Path, start: int, rank: int) -> list[dict]:
    lines = (folder / f"ledger.{start}.{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def ids_of(records: list[dict]) -> Counter:
    return Counter(i for record in records for i in record["ids"])


def report(folder: Path, start: int, rank: int) -> dict:
    return json.loads((folder / f"done.{start}.{rank}.json").read_text())


def restart_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ringrun: restart ")]


def preempt(
    worker: str, folder: Path, ranks: int, name: str, env: dict | None = None, wait_s: float = 180
) -> tuple[int, str]:
    """Start `worker`'s ``sigterm`` scenario on `ranks` ranks under an elastic ringrun,
    SIGTERM ringrun once every rank has written ``folder/running.<rank>`` (within `wait_s`),
    and return ringrun's exit code and output; no rank may be left, nothing restarted."""
    marker = unique_marker(name)
    process = subprocess.Popen(
        [
            *RINGRUN,
            "-np",
            str(ranks),
            "--max-restarts",
            "2",
            sys.executable,
            worker,
            "sigterm",
            str(folder),
            "0",
            marker,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env if env is not None else os.environ.copy(),
    )
    try:
        for _ in range(int(wait_s * 10)):  # bounded: until every rank waits for the signal
            if len(list(folder.glob("running.*"))) == ranks or process.poll() is not None:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.1)
        assert len(list(folder.glob("running.*"))) == ranks, "the ranks did not reach the step"
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)
    assert processes_matching(marker) == []
    assert restart_lines(stderr) == []  # a job that was asked to stop is not restarted
    return process.returncode, stdout + stderr


@pytest.mark.multirank
def test_a_killed_rank_restarts_the_job_on_the_slots_the_discovery_script_names(tmp_path):
    script = discovery_script(tmp_path, "localhost:3", "localhost:2")
    result, output = run_elastic_job(
        tmp_path,
        "kill",
        "-np",
        "3",
        "--max-restarts",
        "2",
        "--min-np",
        "2",
        "--host-discovery-script",
        str(script),
    )
    assert result.returncode == 0, output
    (line,) = restart_lines(result.stderr)
    assert line.startswith("ringrun: restart 1 of 2 after rank 2 on host")
    assert "killed by signal SIGKILL: 2 ranks on localhost:2 (was 3)" in line
    for rank in range(3):
        assert f"start 0: rank {rank} of 3" in output
    assert sorted(p.name for p in tmp_path.glob("done.*")) == ["done.1.0", "done.1.1"]


@pytest.mark.multirank
def test_a_failure_during_the_restart_is_restarted_too_while_restarts_are_left(tmp_path):
    script = discovery_script(tmp_path, "localhost:3", "localhost:2")
    result, output = run_elastic_job(
        tmp_path,
        "kill-twice",
        "-np",
        "3",
        "--max-restarts",
        "2",
        "--min-np",
        "2",
        "--host-discovery-script",
        str(script),
    )
    assert result.returncode == 0, output
    first, second = restart_lines(result.stderr)
    assert first.startswith("ringrun: restart 1 of 2 after rank 2 ")
    assert second.startswith("ringrun: restart 2 of 2 after rank 0 ")
    assert "exited with code 5: 2 ranks on localhost:2 (was 2)" in second
    assert sorted(p.name for p in tmp_path.glob("done.*")) == ["done.2.0", "done.2.1"]


@pytest.mark.multirank
def test_restarts_are_bounded_and_the_job_ends_with_the_last_starts_code(tmp_path):
    result, output = run_elastic_job(tmp_path, "always", "-np", "2", "--max-restarts", "2")
    assert result.returncode == 7, output
    assert len(restart_lines(result.stderr)) == 2
    assert "the job failed 3 times; no restart left (--max-restarts 2)" in result.stderr
    for start in range(3):
        assert f"start {start}: rank 1 of 2" in output


@pytest.mark.multirank
def test_too_few_slots_for_min_np_ends_the_job_with_a_clear_error(tmp_path):
    script = discovery_script(tmp_path, "localhost:3", "localhost:1")
    result, output = run_elastic_job(
        tmp_path,
        "kill",
        "-np",
        "3",
        "--min-np",
        "2",
        "--elastic-timeout",
        "0",
        "--host-discovery-script",
        str(script),
    )
    assert result.returncode == elastic.NOT_ENOUGH_SLOTS_EXIT_CODE, output
    assert (
        "ringrun: error: too few slots for --min-np 2: localhost:1 (1 slot) after waiting 0 s"
        in result.stderr
    )
    assert restart_lines(result.stderr) == []


@pytest.mark.multirank
def test_sigterm_to_ringrun_reaches_every_rank_which_saves_and_nothing_restarts(tmp_path):
    marker = unique_marker("preempt")
    process = subprocess.Popen(
        [
            *RINGRUN,
            "-np",
            "2",
            "--max-restarts",
            "3",
            sys.executable,
            WORKER,
            str(tmp_path),
            "preempt",
            marker,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(600):  # bounded: until both ranks run
            if len(list(tmp_path.glob("running.*"))) == 2 or process.poll() is not None:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.1)
        assert len(list(tmp_path.glob("running.*"))) == 2, "ranks did not start"
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert sorted(p.name for p in tmp_path.glob("saved.*")) == ["saved.0", "saved.1"]
    assert restart_lines(stderr) == []
    assert processes_matching(marker) == []


# ---------------------------------------------------------------- the logic, on a fake job
def test_discovery_reads_hosts_slots_and_comments(tmp_path):
    script = discovery_script(tmp_path, "a:2\\nb  # two slots by default\\n\\nc:1")
    assert discover(str(script), slots_per_host=2) == [Host("a", 2), Host("b", 2), Host("c", 1)]


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("echo 'no such rack' >&2; exit 3", "exited with code 3: no such rack"),
        ("echo 'a:zero'", "slot count 'zero' is not a whole number"),
        ("sleep 30", "did not answer within 0.5 s"),
    ],
)
def test_a_discovery_script_that_fails_says_how(tmp_path, body, said):
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    with pytest.raises(ElasticError, match="discovery script|line 1") as caught:
        discover(str(script), 1, timeout_s=0.5)
    assert said in str(caught.value)


def test_a_discovery_script_that_cannot_run_says_so(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("echo a\n")  # not executable
    with pytest.raises(ElasticError, match="cannot run the host discovery script"):
        discover(str(script), 1)


class FakeJob:
    """Starts that end as told, one result a start, recording what they were given."""

    def __init__(self, *results: JobResult) -> None:
        self.results = list(results)
        self.starts: list[tuple[list[Host], int, int]] = []

    def __call__(self, hosts: list[Host], np: int, restart: int) -> JobResult:
        self.starts.append((hosts, np, restart))
        return self.results.pop(0)


def plan(**changes) -> ElasticPlan:
    values = dict(max_restarts=2, min_np=2, max_np=4, discovery_script=None, timeout_s=0.0)
    return ElasticPlan(**{**values, **changes})


def test_a_host_the_preflight_cannot_reach_is_kept_out_and_the_start_retried():
    lost = HostProblem("b", "ssh failed", "Connection refused", "check sshd on b")
    job = FakeJob(
        JobResult(exit_code=255, host_problems=[lost]),  # the preflight: nothing started
        JobResult(exit_code=0),
    )
    said: list[str] = []
    code = run_elastic(plan(), [Host("a", 2), Host("b", 2)], job, str, said.append)
    assert code == 0
    assert [(hosts, np, restart) for hosts, np, restart in job.starts] == [
        ([Host("a", 2), Host("b", 2)], 4, 0),
        ([Host("a", 2)], 2, 0),
    ]
    assert said[0].startswith("host b is kept out of the job for ")


def started(*placement: tuple[int, str]) -> dict[int, RankStarted]:
    return {rank: RankStarted(rank, host, 100 + rank) for rank, host in placement}


def test_a_host_lost_mid_job_stays_out_even_when_the_discovery_script_still_names_it(tmp_path):
    # The netbed's test (tests/test_multihost.py) loses a real host; here only the logic.
    script = discovery_script(tmp_path, "a:2\\nb:2")
    lost = HostProblem("b", "connection closed", "the ssh server closed the connection", "-")
    job = FakeJob(
        JobResult(
            exit_code=255,
            started=started((0, "a"), (1, "a"), (2, "b"), (3, "b")),
            host_problems=[lost],
        ),
        JobResult(exit_code=0),
    )
    said: list[str] = []
    code = run_elastic(plan(discovery_script=str(script)), [], job, lambda r: "b lost", said.append)
    assert code == 0
    assert [(hosts, np, restart) for hosts, np, restart in job.starts] == [
        ([Host("a", 2), Host("b", 2)], 4, 0),
        ([Host("a", 2)], 2, 1),
    ]
    assert said[0].startswith("host b is kept out of the job for ")
    assert said[1:] == ["restart 1 of 2 after b lost: 2 ranks on a:2 (was 4)"]


def test_a_host_whose_ssh_connection_closed_after_its_ranks_started_is_lost_not_unstartable():
    from ringplug.run.cli import lost_hosts
    from ringplug.run.launch.mpi import JobSpec

    closed = HostProblem("b", "connection closed", "the ssh server closed the connection", "-")
    spec = JobSpec(np=4, command=["python"], hosts=[Host("a", 2), Host("b", 2)])
    ran = JobResult(exit_code=255, started=started((0, "a"), (2, "b")), host_problems=[closed])
    assert lost_hosts(ran, spec) == [(closed, [2, 3])]
    # The same line while the job started: ranks on b never ran, so b was not lost.
    starting = JobResult(exit_code=255, started=started((0, "a")), host_problems=[closed])
    assert lost_hosts(starting, spec) == []


def test_a_restart_whose_preflight_keeps_a_host_out_is_announced_once():
    # A rank failed (no host lost); the restart's preflight then finds host b unreachable.
    unreachable = HostProblem("b", "no route", "this machine cannot reach it", "-")
    job = FakeJob(
        JobResult(exit_code=1, started=started((0, "a"), (1, "a"), (2, "b"))),
        JobResult(exit_code=255, host_problems=[unreachable]),
        JobResult(exit_code=0),
    )
    said: list[str] = []
    hosts = [Host("a", 2), Host("b", 1)]
    assert run_elastic(plan(), hosts, job, lambda r: "rank 2 failed", said.append) == 0
    assert [restart for _, _, restart in job.starts] == [0, 1, 1]
    assert said[0] == "restart 1 of 2 after rank 2 failed: 3 ranks on a:2,b:1 (was 3)"
    assert said[1].startswith("host b is kept out of the job for ")
    assert said[2:] == ["starting again without b: 2 ranks on a:2"]


def test_a_stopped_job_is_not_restarted_and_a_job_ending_well_ends():
    job = FakeJob(JobResult(exit_code=143, stopped_by=signal.SIGTERM))
    assert run_elastic(plan(), [], job, str, print) == 143
    assert len(job.starts) == 1
    job = FakeJob(JobResult(exit_code=1), JobResult(exit_code=0))
    assert run_elastic(plan(), [], job, lambda result: "rank 1 failed", print) == 0
    assert [restart for _, _, restart in job.starts] == [0, 1]


def test_min_np_above_max_np_is_refused():
    from ringplug.run.settings import RunSettings

    with pytest.raises(ElasticError, match="--min-np 3 is more than --max-np"):
        elastic.plan_from_settings(RunSettings(np=2, min_np=3))
    assert os.environ.get(elastic.RESTART_VARIABLE) is None  # tests run outside any job
