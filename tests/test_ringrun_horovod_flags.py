"""horovodrun's flags in ringrun: aliases, tuning flags, --start-timeout, and clear refusals."""

from __future__ import annotations

import logging
import math
import os
import queue
import shlex
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launch import fake_open_mpi, processes_matching, run_ringrun, unique_marker
from ringplug import config
from ringplug.config import read_settings
from ringplug.run.checks.preflight import _Probe
from ringplug.run.cli import (
    _check_context,
    build_parser,
    job_from_settings,
    main,
    settings_from_args,
    ssh_from_settings,
    start_watch,
)
from ringplug.run.configfile import load_config_file
from ringplug.run.horovodrun import UNSUPPORTED
from ringplug.run.hosts.spec import Host, rank_hosts
from ringplug.run.hosts.ssh import DEFAULT_CONNECT_TIMEOUT_S
from ringplug.run.launch.job import START_TIMEOUT_EXIT_CODE, StartWatch, run_job
from ringplug.run.launch.mpi import LaunchPlan
from ringplug.run.launch.status import RankStarted, RankStatus, event_line, parse_event
from ringplug.run.settings import LOG_LEVELS, RunSettings, SettingsError

JOB_TIMEOUT_S = 30
# A job stopped by --start-timeout must end well within this (the ranks never would).
STOPPED_JOB_TIMEOUT_S = 20

WRAPPER_TAIL = [sys.executable, "-m", "ringplug.run.launch.wrapper", "--"]


def dry_run(*args: str, extra_env: dict[str, str] | None = None, cwd: Path | None = None):
    """The dry-run line for ``args``, split back into words, and ringrun's stderr."""
    result = run_ringrun("--dry-run", *args, extra_env=extra_env, cwd=cwd, timeout=30)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    return shlex.split(lines[0]), result.stderr


def dry_run_words(*args: str, **kwargs) -> list[str]:
    return dry_run(*args, **kwargs)[0]


def follows(words: list[str], *expected: str) -> bool:
    """Whether ``expected`` occurs in ``words`` as consecutive words."""
    n = len(expected)
    return any(tuple(words[i : i + n]) == expected for i in range(len(words) - n + 1))


def genv(words: list[str]) -> dict[str, str]:
    """The ``-genv NAME VALUE`` pairs of a hydra line."""
    return {words[i + 1]: words[i + 2] for i, word in enumerate(words) if word == "-genv"}


def rank_program(body: str, marker: str) -> list[str]:
    """``python -c`` arguments for a rank; ``marker`` rides along in argv to find leftovers."""
    code = "import os, sys, threading\nrank = int(os.environ['PMI_RANK'])\n"
    return [sys.executable, "-c", code + textwrap.dedent(body), marker]


# ----------------------------------------------------------------------------- aliases
def test_single_dash_hostfile_is_the_same_as_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2:2\n")
    horovod = dry_run_words("-np", "4", "-hostfile", str(hostfile), "python", "x.py")
    ringrun = dry_run_words("-np", "4", "--hostfile", str(hostfile), "python", "x.py")
    assert horovod == ringrun
    assert follows(horovod, "-hosts", "node1:2,node2:2")


def test_single_dash_hostfile_and_hosts_together_are_refused(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1:2\n")
    result = run_ringrun("-H", "a:2", "-hostfile", str(hostfile), "python", "x.py", timeout=30)
    assert result.returncode == 2
    assert "not both" in result.stderr


def test_hierarchical_allreduce_forces_the_hierarchical_allreduce():
    words = dry_run_words("-np", "2", "--hierarchical-allreduce", "python", "x.py")
    assert genv(words)["RINGPLUG_ALGORITHM"] == "allreduce=hierarchical"
    assert words == dry_run_words(
        "-np", "2", "--algorithm", "allreduce=hierarchical", "python", "x.py"
    )


def test_timeline_filename_is_the_same_as_timeline(tmp_path):
    horovod = dry_run_words("-np", "2", "--timeline-filename", "t.json", "python", cwd=tmp_path)
    ringrun = dry_run_words("-np", "2", "--timeline", "t.json", "python", cwd=tmp_path)
    assert horovod == ringrun
    assert genv(horovod)["RINGPLUG_TIMELINE"] == str(tmp_path.resolve() / "t.json")


@pytest.mark.parametrize("flag", ["--check-build", "-cb"])
def test_check_build_means_check(flag):
    assert build_parser().parse_args([flag]).check is True


def test_check_build_prints_the_check_report():
    result = run_ringrun("--check-build", timeout=90)
    assert result.returncode == 0, result.stderr
    assert "mpi4py             4." in result.stdout
    assert "(hydra)" in result.stdout


def test_network_interfaces_splits_its_comma_list():
    horovod = dry_run_words("-np", "2", "--network-interfaces", "eth0,ib0", "python")
    ringrun = dry_run_words(
        "-np", "2", "--network-interface", "eth0", "--network-interface", "ib0", "python"
    )
    assert horovod == ringrun
    assert follows(horovod, "-iface", "eth0")
    assert genv(horovod)["NCCL_SOCKET_IFNAME"] == "eth0,ib0"


def test_network_interfaces_adds_to_network_interface_in_order(tmp_path):
    mpiexec = fake_open_mpi(tmp_path)
    words = dry_run_words(
        "-np",
        "2",
        "--network-interface",
        "eth0",
        "--network-interfaces",
        "ib0,ib1",
        "python",
        extra_env={"RINGPLUG_MPIEXEC": str(mpiexec)},
    )
    assert follows(words, "--mca", "btl_tcp_if_include", "eth0,ib0,ib1")
    assert follows(words, "-x", "NCCL_SOCKET_IFNAME=eth0,ib0,ib1")


def test_mpi_is_accepted_silently():
    horovod, stderr = dry_run("-np", "2", "--mpi", "python", "x.py")
    assert horovod == dry_run_words("-np", "2", "python", "x.py")
    assert stderr == ""


def test_timeline_mark_cycles_notes_that_cycles_are_always_marked():
    words, stderr = dry_run("-np", "2", "--timeline-mark-cycles", "python", "x.py")
    assert words == dry_run_words("-np", "2", "python", "x.py")
    assert "ringplug's timeline always marks every engine cycle" in stderr


# ----------------------------------------------------------------------------- --mpi-args
def test_mpi_args_go_into_the_launcher_line_before_the_program():
    words = dry_run_words("-np", "2", "--mpi-args=-ppn 2 -genv NOTE 'two words'", "python")
    start = words.index(sys.executable)
    assert words[start - 5 : start] == ["-ppn", "2", "-genv", "NOTE", "two words"]
    assert words[start:] == [*WRAPPER_TAIL, "python"]


def test_mpi_args_go_before_the_program_for_open_mpi_too(tmp_path):
    mpiexec = fake_open_mpi(tmp_path)
    words = dry_run_words(
        "-np",
        "2",
        "--mpi-args",
        "--map-by ppr:1:node",
        "python",
        extra_env={"RINGPLUG_MPIEXEC": str(mpiexec)},
    )
    start = words.index(sys.executable)
    assert words[start - 2 : start] == ["--map-by", "ppr:1:node"]


def test_mpi_args_that_a_shell_cannot_split_are_a_usage_error():
    result = run_ringrun("--dry-run", "-np", "2", "--mpi-args=-genv A 'b", "python", timeout=30)
    assert result.returncode == 2
    assert "--mpi-args" in result.stderr
    assert "No closing quotation" in result.stderr


@pytest.mark.multirank
def test_mpi_args_reach_the_launcher_and_show_in_verbose_output():
    marker = unique_marker("mpiargs")
    program = rank_program("print(os.environ.get('FROM_MPI_ARGS'))", marker)
    result = run_ringrun(
        "-np",
        "2",
        "--verbose",
        "--mpi-args=-genv FROM_MPI_ARGS yes",
        *program,
        timeout=JOB_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] yes", "[1] yes"]
    verbose_line = next(line for line in result.stderr.splitlines() if "mpiexec" in line)
    assert "-genv FROM_MPI_ARGS yes" in verbose_line


# ----------------------------------------------------------------------------- tuning flags
READ_SETTINGS = """
from ringplug.config import read_settings
s = read_settings()
print(os.environ.get('RINGPLUG_LOG_LEVEL'), s.log_level, s.fusion_threshold, s.cycle_time,
      s.stall_check_seconds, s.stall_shutdown_seconds)
"""


@pytest.mark.multirank
def test_tuning_flags_reach_every_rank_as_ringplug_settings():
    marker = unique_marker("tuning")
    result = run_ringrun(
        "-np",
        "2",
        "--log-level",
        "FATAL",
        "--fusion-threshold-mb",
        "32",
        "--cycle-time-ms",
        "2.5",
        "--stall-check-warning-time-seconds",
        "30",
        "--stall-check-shutdown-time-seconds",
        "90",
        *rank_program(READ_SETTINGS, marker),
        timeout=JOB_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    expected = f"CRITICAL CRITICAL {32 << 20} 0.0025 30.0 90.0"
    assert sorted(result.stdout.splitlines()) == [f"[0] {expected}", f"[1] {expected}"]


@pytest.mark.multirank
def test_no_stall_check_gives_the_ranks_a_stall_check_that_never_fires():
    marker = unique_marker("nostall")
    result = run_ringrun(
        "-np",
        "2",
        "--no-stall-check",
        *rank_program(READ_SETTINGS, marker),
        extra_env={"RINGPLUG_STALL_SHUTDOWN_SECONDS": "5"},  # ringrun's own must not leak
        timeout=JOB_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout
    for line in lines:
        *_, check, shutdown = line.split()
        assert math.isinf(float(check))
        assert float(shutdown) == 0.0


@pytest.mark.parametrize(
    ("horovod", "python"),
    [
        ("TRACE", "DEBUG"),
        ("debug", "DEBUG"),
        ("INFO", "INFO"),
        ("WARNING", "WARNING"),
        ("ERROR", "ERROR"),
        ("FATAL", "CRITICAL"),
    ],
)
def test_log_level_maps_horovods_names_to_pythons(horovod, python):
    words = dry_run_words("-np", "2", "--log-level", horovod, "python")
    assert genv(words)["RINGPLUG_LOG_LEVEL"] == python
    logging.getLogger("ringplug.test.level").setLevel(python)  # a name Python logging knows


def test_every_log_level_ringrun_maps_is_a_python_logging_level():
    for value in LOG_LEVELS.values():
        assert isinstance(logging.getLevelName(value), int), value


def test_unknown_log_level_is_a_usage_error():
    result = run_ringrun("--dry-run", "-np", "2", "--log-level", "LOUD", "python", timeout=30)
    assert result.returncode == 2
    assert "--log-level" in result.stderr


def test_tuning_flag_wins_over_the_same_variable_from_x_and_says_so():
    words, stderr = dry_run("-np", "2", "-x", "RINGPLUG_CYCLE_TIME=9", "--cycle-time-ms", "1", "py")
    assert genv(words)["RINGPLUG_CYCLE_TIME"] == "1"
    assert "RINGPLUG_CYCLE_TIME=1" in stderr
    assert "replaces the value of RINGPLUG_CYCLE_TIME" in stderr
    assert "=9" not in stderr  # the user's value is not shown


def test_no_stall_check_with_stall_times_is_a_usage_error():
    result = run_ringrun(
        "--dry-run",
        "-np",
        "2",
        "--no-stall-check",
        "--stall-check-warning-time-seconds",
        "10",
        "python",
        timeout=30,
    )
    assert result.returncode == 2
    assert "--no-stall-check" in result.stderr


def test_zero_stall_warning_time_points_to_no_stall_check():
    result = run_ringrun(
        "--dry-run", "-np", "2", "--stall-check-warning-time-seconds", "0", "python", timeout=30
    )
    assert result.returncode == 2
    assert "--no-stall-check" in result.stderr


def test_fusion_threshold_zero_turns_fusion_off():
    words = dry_run_words("-np", "2", "--fusion-threshold-mb", "0", "python")
    assert genv(words)["RINGPLUG_FUSION_THRESHOLD"] == "0M"


def test_autotune_flags_reach_the_ranks_as_their_variables(tmp_path):
    log = tmp_path / "trials.csv"
    words = dry_run_words(
        "-np",
        "2",
        "--autotune",
        "--autotune-log-file",
        str(log),
        "--autotune-warmup-samples",
        "2",
        "--autotune-steps-per-sample",
        "5",
        "--autotune-bayes-opt-max-samples",
        "9",
        "python",
    )
    assert {name: value for name, value in genv(words).items() if "AUTOTUNE" in name} == {
        "RINGPLUG_AUTOTUNE": "1",
        "RINGPLUG_AUTOTUNE_LOG": str(log),
        "RINGPLUG_AUTOTUNE_WARMUP_SAMPLES": "2",
        "RINGPLUG_AUTOTUNE_STEPS_PER_SAMPLE": "5",
        "RINGPLUG_AUTOTUNE_MAX_SAMPLES": "9",
    }


@pytest.mark.parametrize(
    ("argv", "fixed"),
    [
        (["--autotune", "--fusion-threshold-mb", "32"], "RINGPLUG_FUSION_THRESHOLD=32M"),
        (["--autotune", "--cycle-time-ms", "5"], "RINGPLUG_CYCLE_TIME=5"),
        (["--autotune", "-x", "RINGPLUG_CYCLE_TIME=2"], "RINGPLUG_CYCLE_TIME=2"),
        (["-x", "RINGPLUG_AUTOTUNE=1", "--fusion-threshold-mb", "8"], "FUSION_THRESHOLD=8M"),
    ],
)
def test_autotune_with_a_fixed_setting_stops_ringrun_before_launch(argv, fixed):
    result = run_ringrun("--dry-run", "-np", "2", *argv, "python", timeout=30)
    assert result.returncode == 2
    assert result.stdout == ""  # nothing launched, no command line shown
    assert fixed in result.stderr
    assert "Drop the fixed value (--fusion-threshold-mb / --cycle-time-ms" in result.stderr


def test_autotune_samples_out_of_range_name_the_flag():
    result = run_ringrun(
        "--dry-run",
        "-np",
        "2",
        "--autotune",
        "--autotune-steps-per-sample",
        "1",
        "python",
        timeout=30,
    )
    assert result.returncode == 2
    assert "RINGPLUG_AUTOTUNE_STEPS_PER_SAMPLE='1' must be a whole number from 2" in (result.stderr)


def test_tuning_settings_and_mpi_args_come_from_a_yaml_config_file(tmp_path):
    config = tmp_path / "launch.yaml"
    config.write_text(
        "np: 2\nlog_level: trace\nfusion_threshold_mb: 16\ncycle_time_ms: 3\n"
        "stall_check_warning_time_seconds: 45\nstall_check_shutdown_time_seconds: 120\n"
        "mpi_args: -ppn 1\nstart_timeout: 60\n"
    )
    settings = load_config_file(config)
    assert settings.mpi_args == ["-ppn", "1"]
    assert settings.start_timeout == 60.0
    words = dry_run_words("--config-file", str(config), "python")
    assert {name: value for name, value in genv(words).items() if "RINGPLUG" in name} == {
        "RINGPLUG_LOG_LEVEL": "DEBUG",
        "RINGPLUG_FUSION_THRESHOLD": "16M",
        "RINGPLUG_CYCLE_TIME": "3",
        "RINGPLUG_STALL_CHECK_SECONDS": "45",
        "RINGPLUG_STALL_SHUTDOWN_SECONDS": "120",
    }
    assert follows(words, "-ppn", "1", sys.executable)


def test_toml_config_turns_the_stall_check_off_and_flags_win(tmp_path):
    config = tmp_path / "launch.toml"
    config.write_text('stall_check = false\nfusion_threshold_mb = 16\nmpi_args = ["-ppn", "1"]\n')
    words = dry_run_words(
        "--config-file", str(config), "-np", "2", "--fusion-threshold-mb", "8", "python"
    )
    values = genv(words)
    assert values["RINGPLUG_STALL_CHECK_SECONDS"] == "inf"
    assert values["RINGPLUG_FUSION_THRESHOLD"] == "8M"
    assert follows(words, "-ppn", "1", sys.executable)


def test_config_file_value_of_the_wrong_type_is_named(tmp_path):
    config = tmp_path / "launch.yaml"
    config.write_text("cycle_time_ms: soon\n")
    result = run_ringrun("--config-file", str(config), "python", timeout=30)
    assert result.returncode == 2
    assert "cycle_time_ms must be a number" in result.stderr


# ----------------------------------------------------------------------------- refusals
def _refused_command_lines() -> list[list[str]]:
    """Each unsupported flag as horovodrun users would write it, with its values."""
    values = {0: [], 1: ["4"], 2: ["60", "300"]}
    return [[flag, *values[entry.values]] for entry in UNSUPPORTED for flag in entry.flags]


@pytest.mark.parametrize("flag_and_values", _refused_command_lines(), ids=lambda argv: argv[0])
def test_unsupported_flag_fails_with_one_line_naming_it(flag_and_values, capsys):
    code = main(["-np", "2", *flag_and_values, "python", "train.py"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"ringrun: error: {flag_and_values[0]} is not supported: ")


@pytest.mark.parametrize(
    ("argv", "advice"),
    [
        (["--gloo"], "through MPI"),
        (["--jsrun"], "jsrun directly"),
        (["--blacklist-cooldown-range", "5", "10"], "lost host stays out of the job for 60"),
        (["--autotune-gaussian-process-noise", "0.8"], "no noise to set"),
        (["--hierarchical-allgather"], "only the allreduce has a hierarchical form"),
        (["--cache-capacity", "2048"], "fixed size"),
        (["--num-nccl-streams", "2"], "one stream per rank"),
        (["--thread-affinity", "1"], "--bind-to core"),
        (["--gpu-operations", "NCCL"], "NCCL for GPU tensors"),
        (["--cpu-operations", "MPI"], "MPI for CPU"),
    ],
)
def test_unsupported_flag_says_what_to_do_instead(argv, advice, capsys):
    assert main(["-np", "2", *argv, "python"]) == 2
    assert advice in capsys.readouterr().err


def test_unlisted_flag_of_a_refused_family_gets_the_familys_reason(capsys):
    assert main(["-np", "2", "--autotune-new-knob", "python"]) == 2
    assert "--autotune-new-knob is not supported: ringplug's autotune takes --autotune," in (
        capsys.readouterr().err
    )


def test_flags_after_the_command_belong_to_the_program():
    words = dry_run_words("-np", "2", "python", "train.py", "--gloo", "--autotune")
    assert words[-4:] == ["python", "train.py", "--gloo", "--autotune"]


def test_unsupported_flag_exits_2_from_the_command_line():
    result = run_ringrun("-np", "2", "--gloo", "python", "x.py", timeout=30)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ringrun: error: --gloo is not supported: ringrun always starts ranks through MPI "
        "(mpiexec or mpirun), and ringplug runs its collectives over MPI on the CPU; drop --gloo"
    ]


def test_unknown_flags_outside_horovods_families_are_still_argparse_errors():
    result = run_ringrun("-np", "2", "--frobnicate", "python", timeout=30)
    assert result.returncode == 2
    assert "unrecognized arguments: --frobnicate" in result.stderr


def test_help_groups_horovodrun_flags_and_hides_the_refused_ones():
    text = build_parser().format_help()
    group = text[text.index("horovodrun compatibility:") :]
    for flag in (
        "-hostfile",
        "--network-interfaces",
        "--mpi-args",
        "--start-timeout",
        "--fusion-threshold-mb",
        "--no-stall-check",
        "--log-level",
        "--min-np",
        "--host-discovery-script",
        "--reset-limit",
    ):
        assert flag in group
    assert "--blacklist-cooldown-range" not in text
    listed = [line.split()[0] for line in text.splitlines() if line.strip().startswith("-")]
    assert "--autotune-gaussian-process-noise" not in listed
    assert {"--autotune", "--autotune-log-file", "--autotune-bayes-opt-max-samples"} <= set(listed)


# ----------------------------------------------------------------------------- start reports
TOKEN = "feedc0de"


def run_wrapper(rank: int, *command: str, token: str | None = TOKEN):
    """The wrapper as rank ``rank`` of a job whose ringrun asked for events (or did not)."""
    env = {**os.environ, "PMI_RANK": str(rank)}
    if token is not None:
        env["RINGPLUG_RUN_EVENTS"] = token
    return subprocess.run(
        [*WRAPPER_TAIL, *command], capture_output=True, text=True, timeout=30, env=env, check=False
    )


def fake_launcher(
    *started_ranks: int, then: str = "threading.Event().wait()", report_ends: bool = False
) -> LaunchPlan:
    """A launcher whose ranks ``started_ranks`` report starting, and that then runs ``then``
    (and, with `report_ends`, reports that each rank exited cleanly)."""
    lines = b"".join(
        event_line(TOKEN, RankStarted(rank=rank, host="here", pid=100 + rank).to_event())
        for rank in started_ranks
    )
    ends = b"".join(
        event_line(TOKEN, RankStatus(rank, "here", 100 + rank, 0, None, 1.0).to_event())
        for rank in started_ranks
        if report_ends
    )
    code = f"import sys, threading, time\nsys.stderr.buffer.write({lines!r}); sys.stderr.flush()\n"
    tail = f"\nsys.stderr.buffer.write({ends!r}); sys.stderr.flush()\n"
    return LaunchPlan(argv=[sys.executable, "-c", code + then + tail])


def test_wrapper_reports_its_rank_started_on_stderr():
    result = run_wrapper(3, sys.executable, "-c", "import os; print(os.getpid())")
    assert result.returncode == 0, result.stderr
    started = RankStarted(rank=3, host=socket.gethostname(), pid=int(result.stdout))
    first, second = result.stderr.splitlines(keepends=True)
    assert first == event_line(TOKEN, started.to_event()).decode()
    ended = parse_event(second, TOKEN)  # a clean exit is reported too
    assert isinstance(ended, RankStatus) and ended.clean and ended.rank == 3


def test_wrapper_reports_nothing_unless_asked():
    result = run_wrapper(3, sys.executable, "-c", "pass", token=None)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_a_program_that_cannot_start_reports_no_start():
    result = run_wrapper(0, "/nonexistent/program")
    assert '"event":"started"' not in result.stderr
    assert '"event":"exited"' in result.stderr, "the failure is reported instead"


def test_watcher_stops_a_job_whose_ranks_never_start():
    # A launcher that never starts rank 1 and never ends by itself.
    began = time.monotonic()
    result = run_job(
        fake_launcher(0), events_token=TOKEN, start_watch=StartWatch(0.5, frozenset({0, 1}))
    )
    assert result.not_started == [1]
    assert set(result.started) == {0}
    assert result.exit_code == START_TIMEOUT_EXIT_CODE
    assert time.monotonic() - began < 10


def test_watcher_leaves_a_job_alone_once_every_rank_started():
    # Outlives the start timeout, then ends on its own.
    plan = fake_launcher(0, 1, then="time.sleep(1)", report_ends=True)
    result = run_job(plan, events_token=TOKEN, start_watch=StartWatch(0.1, frozenset({0, 1})))
    assert result.not_started == []
    assert result.exit_code == 0


def test_ranks_killed_with_their_wrappers_fail_the_job_even_if_the_launcher_exits_0():
    # hydra kills every rank and wrapper when one leaves without MPI_Finalize, and may then
    # exit 0: ranks that started but never said how they ended did not succeed.
    result = run_job(fake_launcher(0, 1, then="pass"), events_token=TOKEN)
    assert result.launcher_returncode == 0
    assert result.unreported == [0, 1]
    assert result.exit_code == 1


def test_event_lines_do_not_reach_ringruns_output(capfd):
    plan = fake_launcher(0, then="print('from rank 0', file=sys.stderr)")
    run_job(plan, events_token=TOKEN)
    assert capfd.readouterr().err == "from rank 0\n"


def test_start_timeout_defaults_to_a_minute_and_zero_turns_it_off():
    assert RunSettings().effective_start_timeout == 60.0
    assert RunSettings(start_timeout=0).effective_start_timeout is None
    assert RunSettings(start_timeout=5).effective_start_timeout == 5.0


def test_ranks_fill_hosts_in_order_and_wrap_around():
    hosts = [Host("a", 2), Host("b", 1)]
    assert rank_hosts(hosts, 5) == ["a", "a", "b", "a", "a"]


def blocking_site_directory(directory: Path, rank: int) -> str:
    """A ``PYTHONPATH`` entry whose ``sitecustomize`` blocks every Python process of ``rank``.

    On that rank the first Python process is ringrun's wrapper, so its program never
    starts: what a host that cannot start its rank looks like to ringrun.
    """
    site = directory / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import os, threading\nif os.environ.get('PMI_RANK') == '{rank}':\n"
        "    threading.Event().wait()\n"
    )
    return os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))


@pytest.mark.multirank
def test_start_timeout_stops_a_job_whose_rank_never_starts_and_names_it(tmp_path):
    marker = unique_marker("starttimeout")
    python_path = blocking_site_directory(tmp_path, rank=1)
    program = rank_program("print('started', rank, flush=True); threading.Event().wait()", marker)
    result = run_ringrun(
        "-np",
        "2",
        "--start-timeout",
        "3",
        "-x",
        f"PYTHONPATH={python_path}",
        *program,
        timeout=STOPPED_JOB_TIMEOUT_S,
    )
    assert result.returncode == START_TIMEOUT_EXIT_CODE
    assert "[0] started 0" in result.stdout
    assert "started 1" not in result.stdout
    first, advice = [line for line in result.stderr.splitlines() if line.startswith("ringrun:")]
    assert first.startswith("ringrun: rank 1 on host ")
    assert "within 3 s (--start-timeout)" in first
    assert "ssh" in advice and "ringrun --check" in advice
    assert processes_matching(marker) == []


@pytest.mark.multirank
def test_start_timeout_does_not_stop_ranks_that_started_and_run_past_it():
    marker = unique_marker("startedfine")
    # The sleep is the job's length, not a wait for something: it outlasts the timeout.
    program = rank_program("import time; time.sleep(5); print('ran', rank)", marker)
    result = run_ringrun("-np", "2", "--start-timeout", "3", *program, timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] ran 0", "[1] ran 1"]


# ------------------------------------------------- settings declared in ringplug.config, flags
FLAGGED = [variable for variable in config.VARIABLES if variable.flag is not None]


def _example(variable: config.Variable, folder: Path) -> str:
    """A value of ``variable`` other than its default, as a user would write it."""
    if variable.form == config.PATH:
        return str(folder / "trace.json")
    if variable.form in (config.SECONDS, config.MILLISECONDS):
        return f"{(variable.default or 1) / 2 + 0.25:g}"
    if variable.form == config.CHOICE:
        return variable.choices[-1]
    if variable.name == "RINGPLUG_ALGORITHM":
        return "allreduce=ring,broadcast=chain"
    if variable.form == config.COUNT:
        return str(variable.default + 1)
    raise AssertionError(f"no example value for {variable.name}: add one here")


def test_the_settings_with_a_flag_include_timeout_and_timeline():
    assert {variable.flag for variable in FLAGGED} >= {"--timeout", "--timeline"}


@pytest.mark.parametrize("variable", FLAGGED, ids=lambda v: v.flag)
def test_every_flag_of_a_declared_setting_reaches_the_ranks_config(variable, tmp_path):
    # flag -> RINGPLUG_* -> the ranks' config, and the config file's key the same way
    text = _example(variable, tmp_path)
    settings = settings_from_args(build_parser().parse_args([variable.flag, text, "-np", "1"]))
    environ = settings.rank_variables()
    assert set(environ) == {variable.name}
    expected = variable.parse(text)
    assert variable.read(environ) == expected != variable.default
    if variable.field is not None:
        assert getattr(read_settings(environ), variable.field) == variable.field_value(expected)
    config_file = tmp_path / "job.yaml"
    config_file.write_text(f"{variable.key}: {text}\n")
    from_file = load_config_file(config_file)
    from_file.validate()
    assert from_file.rank_variables() == environ


@pytest.mark.parametrize("variable", FLAGGED, ids=lambda v: v.flag)
def test_every_flag_of_a_declared_setting_has_its_help_from_the_declaration(variable):
    help_text = " ".join(build_parser().format_help().split())
    assert variable.name in help_text
    if variable.default is not None:
        assert f"default {variable.default_text}" in help_text


def test_timeout_reaches_every_rank_and_a_bad_one_is_refused_before_any_starts():
    marker = unique_marker("timeout")
    code = "from ringplug.config import read_settings\nprint(read_settings().timeout)\n"
    result = run_ringrun(
        "-np", "2", "--timeout", "42.5", *rank_program(code, marker), timeout=JOB_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] 42.5", "[1] 42.5"]
    refused = run_ringrun("-np", "2", "--timeout", "0", "python", "-c", "pass", timeout=30)
    assert refused.returncode == 2
    assert "--timeout (timeout): RINGPLUG_TIMEOUT='0' must be a positive number" in refused.stderr


def test_timeout_is_on_the_dry_run_line():
    words, _ = dry_run("-np", "2", "--timeout", "90", "python", "x.py")
    assert genv(words)["RINGPLUG_TIMEOUT"] == "90"


def test_the_horovodrun_tuning_flags_are_checked_by_the_ranks_bounds():
    # the cycle time's limit is declared once (ringplug.config), not again for the flag
    limit = config.CYCLE_TIME.most
    with pytest.raises(SettingsError, match=f"RINGPLUG_CYCLE_TIME='{limit + 1:g}' must be at most"):
        RunSettings(cycle_time_ms=limit + 1).validate()
    RunSettings(cycle_time_ms=limit).validate()
    with pytest.raises(SettingsError, match="RINGPLUG_STALL_SHUTDOWN_SECONDS='inf'"):
        RunSettings(stall_check_shutdown_time_seconds=math.inf).validate()


def test_a_start_timeout_of_zero_is_no_limit_everywhere():
    settings = settings_from_args(build_parser().parse_args(["--start-timeout", "0", "-np", "2"]))
    assert settings.start_timeout == 0 and settings.effective_start_timeout is None
    assert settings.host_timeout_s == math.inf  # the preflight and --check: no limit either
    assert _check_context(settings, []).host_timeout_s == math.inf
    assert ssh_from_settings(settings).connect_timeout_s == DEFAULT_CONNECT_TIMEOUT_S
    spec = job_from_settings(settings, ["python", "x.py"])
    assert start_watch(spec, settings) is None
    # and a limit given is kept, ssh's connect timeout within it
    short = settings_from_args(build_parser().parse_args(["--start-timeout", "3", "-np", "2"]))
    assert short.host_timeout_s == 3 and ssh_from_settings(short).connect_timeout_s == 3


def test_the_preflight_waits_without_a_deadline_when_there_is_no_limit():
    # math.inf is a deadline the waits accept (no OverflowError), and an answer still ends it
    probe = _Probe.__new__(_Probe)
    probe.messages = queue.Queue()
    probe.messages.put({"kind": "hello"})
    probe.process, probe.readers = None, []
    assert probe.expect("hello", time.monotonic() + math.inf) == {"kind": "hello"}
