"""Elastic jobs: ringrun starts a failed job again with the hosts and slots left.

A job started with ``--max-restarts``, ``--min-np``, ``--max-np`` or
``--host-discovery-script`` is restarted when it fails, up to ``--max-restarts`` times
(3 when only the other flags are given). Before every start the discovery script, if any,
says which hosts are there now; hosts that were lost (ssh's connection to them closed while
their ranks ran, or ssh could not reach them to start ranks) stay out for
`BLACKLIST_COOLDOWN_S`, even when the script still names them. The job runs with as many
ranks as the hosts have slots, at most ``--max-np``; fewer than ``--min-np`` ends it with an
error once ``--elastic-timeout`` has passed without enough of them.

A restart is a whole new job: every rank starts again, reads ``RINGPLUG_RESTART`` (1 for
the first restart) and resumes from its checkpoint. Survivors do not re-form a ring in
place: neither MPICH's nor Open MPI's wheels ship MPI's fault-tolerance extension (ULFM),
and a fresh start costs the imports and the checkpoint load, which a resume needs anyway.

A job that ringrun was asked to stop (SIGTERM from Slurm or Kubernetes, Ctrl-C) is not
restarted: the signal reached every rank, which may save before it ends.
"""

from __future__ import annotations

import random
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ringplug import config, wire
from ringplug.run.hosts.spec import (
    Host,
    HostSpecError,
    format_host_list,
    parse_host_entry,
    total_slots,
)
from ringplug.run.launch.job import JobResult
from ringplug.run.settings import RunSettings

# RESTART_VARIABLE: which start of the job a rank is in. JOB_ID_VARIABLE: the same in every
# start of one elastic job (``hvd.elastic`` keys its commits by it); a value already in
# ringrun's environment (set by a batch script) is kept.
RESTART_VARIABLE = wire.RESTART_VARIABLE
JOB_ID_VARIABLE = wire.JOB_ID_VARIABLE
COMMIT_DIR_VARIABLE = config.ELASTIC_DIR.name


def default_commit_directory(job_id: str) -> Path:
    """Where ``hvd.elastic`` keeps the commits of job `job_id` without `COMMIT_DIR_VARIABLE`
    (on each writer's host; ringrun removes this host's when the job ends well). The same
    name as ``ringplug.elastic.CommitStore`` uses."""
    return Path(tempfile.gettempdir()) / f"ringplug-elastic-{job_id}"


DEFAULT_MAX_RESTARTS = 3
"""Restarts when an elastic flag other than ``--max-restarts`` is given."""

DEFAULT_ELASTIC_TIMEOUT_S = 600.0
"""How long ringrun waits for enough slots for ``--min-np`` (Horovod's default too)."""

BLACKLIST_COOLDOWN_S = (60.0, 600.0)
"""A lost host stays out of the job for a random time in this range (seconds)."""

DISCOVERY_TIMEOUT_S = 60.0
"""The most a discovery script may take to answer."""

NOT_ENOUGH_SLOTS_EXIT_CODE = 75
"""ringrun's exit code when the hosts left cannot run ``--min-np`` ranks (EX_TEMPFAIL)."""


class ElasticError(Exception):
    """The job cannot go on: the discovery script failed, or too few slots are left."""


@dataclass(frozen=True)
class ElasticPlan:
    """What an elastic job may do, from ringrun's settings.

    Args:
        max_restarts: restarts allowed after the first start.
        min_np: the fewest ranks a start may have.
        max_np: the most ranks a start may have (``None``: every slot).
        discovery_script: the program that names the hosts available now, or ``None`` for
            the hosts of ``-H``/``--hostfile`` (or this machine) every time.
        slots_per_host: slots of a host the script names without a count.
        timeout_s: how long to wait for enough slots.
    """

    max_restarts: int
    min_np: int
    max_np: int | None
    discovery_script: str | None
    slots_per_host: int = 1
    timeout_s: float = DEFAULT_ELASTIC_TIMEOUT_S


def discover(
    script: str, slots_per_host: int, timeout_s: float = DISCOVERY_TIMEOUT_S
) -> list[Host]:
    """The hosts `script` names now, one ``host`` or ``host:slots`` a line.

    Raises:
        ElasticError: the script could not run, took longer than `timeout_s`, failed, or
            printed a line that names no host.
    """
    try:
        done = subprocess.run(
            [script], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise ElasticError(
            f"the host discovery script {script} did not answer within {timeout_s:g} s"
        ) from None
    except OSError as error:
        raise ElasticError(
            f"cannot run the host discovery script {script}: {error.strerror} (it must be an "
            "executable file, with a #! line for a script)"
        ) from None
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()[-1:] or ["(nothing on stderr)"]
        raise ElasticError(
            f"the host discovery script {script} exited with code {done.returncode}: {said[0]}"
        )
    hosts: dict[str, Host] = {}
    for number, line in enumerate(done.stdout.splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            host = parse_host_entry(text, where=f"{script} line {number}")
        except HostSpecError as error:
            raise ElasticError(str(error)) from None
        if ":" not in text and " " not in text:
            host = Host(host.name, slots_per_host)
        hosts[host.name] = host  # a host named twice: its last line
    return list(hosts.values())


@dataclass
class Blacklist:
    """Hosts kept out of the job until a time (``time.monotonic``)."""

    until: dict[str, float] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic

    def add(self, host: str) -> float:
        """Keep `host` out for a cool-down; returns its length in seconds."""
        cooldown = random.uniform(*BLACKLIST_COOLDOWN_S)
        self.until[host] = self.clock() + cooldown
        return cooldown

    def allows(self, host: str) -> bool:
        return self.until.get(host, 0.0) <= self.clock()


def choose_hosts(
    available: Sequence[Host], blacklist: Blacklist, plan: ElasticPlan
) -> tuple[list[Host], int]:
    """The hosts of the next start and its number of ranks (0: too few slots)."""
    hosts = [host for host in available if blacklist.allows(host.name)]
    slots = total_slots(hosts)
    np = slots if plan.max_np is None else min(slots, plan.max_np)
    return hosts, (np if np >= plan.min_np else 0)


def wait_for_slots(
    plan: ElasticPlan,
    static_hosts: Sequence[Host],
    blacklist: Blacklist,
    say: Callable[[str], None],
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[list[Host], int]:
    """Hosts and a rank count of at least ``min_np``, asking the discovery script every
    second until ``timeout_s`` has passed.

    Raises:
        ElasticError: too few slots when the time is up (what was there, and why).
    """
    deadline = time.monotonic() + plan.timeout_s
    waiting_said = False
    while True:
        if plan.discovery_script is not None:
            available = discover(plan.discovery_script, plan.slots_per_host)
        else:
            available = list(static_hosts)
        hosts, np = choose_hosts(available, blacklist, plan)
        if np:
            return hosts, np
        out = sorted(host.name for host in available if not blacklist.allows(host.name))
        left = f" ({', '.join(out)} kept out after they were lost)" if out else ""
        have = format_host_list(hosts) or "no host"
        if time.monotonic() >= deadline:
            raise ElasticError(
                f"too few slots for --min-np {plan.min_np}: {have} "
                f"({total_slots(hosts)} slot{'s' if total_slots(hosts) != 1 else ''}){left} "
                f"after waiting {plan.timeout_s:g} s (--elastic-timeout)"
            )
        if not waiting_said:
            say(
                f"waiting up to {plan.timeout_s:g} s for slots for --min-np {plan.min_np}: "
                f"{have} now{left}"
            )
            waiting_said = True
        sleep(1.0)


def plan_from_settings(settings: RunSettings) -> ElasticPlan:
    """The elastic plan of ringrun's settings (with Horovod's defaults: ``--min-np`` is
    ``-np`` when given)."""
    max_restarts = settings.max_restarts
    if max_restarts is None:
        max_restarts = DEFAULT_MAX_RESTARTS
    min_np = settings.min_np or settings.np or 1
    max_np = settings.max_np or settings.np
    if max_np is not None and min_np > max_np:
        raise ElasticError(f"--min-np {min_np} is more than --max-np (or -np) {max_np}")
    timeout = settings.elastic_timeout
    return ElasticPlan(
        max_restarts=max_restarts,
        min_np=min_np,
        max_np=max_np,
        discovery_script=settings.host_discovery_script,
        slots_per_host=settings.slots_per_host or 1,
        timeout_s=DEFAULT_ELASTIC_TIMEOUT_S if timeout is None else timeout,
    )


def run_elastic(
    plan: ElasticPlan,
    static_hosts: Sequence[Host],
    start: Callable[[list[Host], int, int], JobResult],
    cause: Callable[[JobResult], str],
    say: Callable[[str], None],
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Start the job, and start it again after each failure while restarts are left.

    `start(hosts, np, restart)` runs one start of the job (hosts empty: this machine, with
    ``max_np`` ranks) and reports how it ended; `cause` says in a few words why a start
    failed. Returns ringrun's exit code: 0 when a start ends well, else the last start's
    code, or `NOT_ENOUGH_SLOTS_EXIT_CODE`.
    """
    blacklist = Blacklist()
    restart = 0
    failed: tuple[JobResult, int] | None = None  # the start that failed, and its ranks
    announced = False  # whether this restart's line was said (once, however many tries)
    kept_out: list[str] = []  # hosts the last try's preflight could not start ranks on
    while True:
        try:
            if plan.discovery_script is None and not static_hosts:
                hosts, np = [], plan.max_np or plan.min_np
            else:
                hosts, np = wait_for_slots(plan, static_hosts, blacklist, say, sleep)
        except ElasticError as error:
            say(f"error: {error}")
            return NOT_ENOUGH_SLOTS_EXIT_CODE
        where = f" on {format_host_list(hosts)}" if hosts else ""
        ranks = f"{np} rank{'s' if np != 1 else ''}{where}"
        if failed is not None and not announced:
            result, before = failed
            say(
                f"restart {restart} of {plan.max_restarts} after {cause(result)}: {ranks} "
                f"(was {before})"
            )
            announced = True
        elif kept_out:
            say(f"starting again without {', '.join(kept_out)}: {ranks}")
        result = start(hosts, np, restart)
        if result.host_problems and not result.started:
            # The hosts could not start the job (the preflight, or ssh): without them.
            kept_out = [p.host for p in result.host_problems if blacklist.allows(p.host)]
            kept_out = list(dict.fromkeys(kept_out))
            for name in kept_out:
                say(f"host {name} is kept out of the job for {blacklist.add(name):.0f} s")
            if kept_out:  # each time one more host out: this ends
                continue
        kept_out = []
        if result.exit_code == 0 or result.stopped_by is not None:
            return result.exit_code
        if restart >= plan.max_restarts:
            if plan.max_restarts:
                say(
                    f"the job failed {restart + 1} times; no restart left "
                    f"(--max-restarts {plan.max_restarts})"
                )
            return result.exit_code
        for name in dict.fromkeys(problem.host for problem in result.host_problems):
            say(f"host {name} is kept out of the job for {blacklist.add(name):.0f} s")
        restart += 1
        failed = (result, np)
        announced = False
