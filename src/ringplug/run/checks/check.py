"""``ringrun --check``: a report of the Python, MPI and framework setup ranks will run with.

The report is a list of sections, each built by one function from a :class:`CheckContext`.
New facts (timeline, GPUs, NCCL) are new functions appended to :data:`SECTIONS`. A section
may name problems (what would stop a job, each with its fix); they end the report as a
verdict, and make ``ringrun --check`` exit with 1.

With hosts (``ringrun --check -H a,b``), the preflight of :mod:`ringplug.run.checks.preflight`
runs once for the whole report, and the "Hosts" and "Network" sections show what it found.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from ringplug.run.checks.gpu import gpu_section
from ringplug.run.checks.preflight import HostReport
from ringplug.run.checks.report import CheckContext, Section
from ringplug.run.hosts.probe import FRAMEWORKS, framework_distribution, probe_mpi_library
from ringplug.run.hosts.spec import total_slots
from ringplug.run.launch.mpi import JobSpec, LauncherError, build_plan, find_launcher


def _distribution_version(name: str) -> str | None:
    """Installed version of a distribution, read from metadata without importing it."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def python_section(context: CheckContext) -> Section:
    """Interpreter version and location."""
    return Section(
        "Python",
        [("version", platform.python_version()), ("executable", context.python)],
    )


def ringplug_section(context: CheckContext) -> Section:
    """The installed ringplug."""
    return Section("ringplug", [("version", _distribution_version("ringplug") or "unknown")])


def venv_mpi_libraries(prefix: str) -> list[str]:
    """``libmpi`` files inside the virtualenv, i.e. from the ``mpich`` (or similar) wheel."""
    lib = Path(prefix) / "lib"
    return sorted(str(path) for path in lib.glob("libmpi.*")) if lib.is_dir() else []


def system_mpi_installations(context: CheckContext) -> list[str]:
    """MPI launchers on ``PATH`` and ``libmpi`` libraries known to the linker, outside the venv."""
    prefix = Path(context.prefix).resolve()
    found: list[str] = []
    for directory in context.environ.get("PATH", "").split(os.pathsep):
        if not directory:
            continue
        for name in ("mpiexec", "mpirun"):
            candidate = Path(directory) / name
            if not (candidate.is_file() and os.access(candidate, os.X_OK)):
                continue
            if not candidate.resolve().is_relative_to(prefix) and str(candidate) not in found:
                found.append(str(candidate))
    for line in context.ldconfig().splitlines():
        # Lines look like "\tlibmpi.so.40 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/...".
        name, _, path = line.strip().partition(" => ")
        if (
            name.startswith("libmpi.so")
            and path
            and not Path(path).is_relative_to(prefix)
            and path not in found
        ):
            found.append(path)
    return found


def mpi_section(context: CheckContext) -> Section:
    """mpi4py, the MPI library it loads, the launcher ringrun uses, and conflicts between MPIs."""
    section = Section("MPI")
    mpi4py_version = _distribution_version("mpi4py")
    section.rows.append(("mpi4py", mpi4py_version or "not installed"))
    if mpi4py_version is not None:
        try:
            version, path = probe_mpi_library(context.python, context.environ)
            section.rows.append(("library", version))
            section.rows.append(("library path", path or "unknown"))
        except RuntimeError as error:
            section.rows.append(("library", f"cannot be loaded: {error}"))
            section.warnings.append(
                "mpi4py cannot load an MPI library. Install one with "
                "`pip install 'ringplug[mpich]'`, or load your cluster's MPI module."
            )
    if "MPI4PY_LIBMPI" in context.environ:
        section.rows.append(("MPI4PY_LIBMPI", context.environ["MPI4PY_LIBMPI"]))
    try:
        launcher = find_launcher(context.environ, context.python)
    except LauncherError as error:
        section.rows.append(("launcher", f"unusable: {error}"))
    else:
        if launcher is None:
            section.rows.append(("launcher", "not found"))
            section.warnings.append(
                "no MPI launcher found: ringrun can only run single-process jobs. Install "
                "one with `pip install 'ringplug[mpich]'`, or load your cluster's MPI module."
            )
        else:
            section.rows.append(("launcher", launcher.path))
            section.rows.append(("launcher version", f"{launcher.version} ({launcher.kind})"))
    wheel = venv_mpi_libraries(context.prefix)
    system = system_mpi_installations(context)
    if wheel:
        section.rows.append(("MPI in virtualenv", ", ".join(wheel)))
    if system:
        section.rows.append(("system MPI", ", ".join(system)))
    if wheel and system:
        section.warnings.append(
            "two MPI installations: the pip `mpich` wheel in this virtualenv "
            f"({wheel[0]}) and a system MPI ({system[0]}). mpi4py loads the virtualenv's "
            "libmpi first, so ranks started with the system's mpiexec/mpirun would still "
            "use the wheel's MPICH, which fails or hangs at startup. To use the system MPI "
            "(usual on clusters, for the fast interconnect), remove the wheel with "
            "`pip uninstall mpich` or set MPI4PY_LIBMPI to the system's libmpi.so. To use "
            "the wheel, launch with ringrun (it picks the virtualenv's mpiexec) and keep the "
            "system MPI module unloaded."
        )
    return section


def keras_backend(environ: Mapping[str, str]) -> tuple[str, str]:
    """(backend, where it was chosen) that Keras 3 would load, read as Keras reads it
    (``KERAS_BACKEND``, else ``keras.json`` in ``KERAS_HOME`` or ``~/.keras``), without
    importing it."""
    if environ.get("KERAS_BACKEND"):
        return environ["KERAS_BACKEND"], "KERAS_BACKEND"
    if environ.get("KERAS_HOME"):
        folder = Path(environ["KERAS_HOME"])
    else:
        home = Path(environ.get("HOME") or Path.home())
        # Keras's own rule: a home it cannot write to means /tmp/.keras.
        folder = (home if os.access(home, os.W_OK) else Path("/tmp")) / ".keras"
    path = folder / "keras.json"
    try:
        chosen = json.loads(path.read_text()).get("backend")
    except (OSError, ValueError, AttributeError):
        chosen = None
    if isinstance(chosen, str) and chosen:
        return chosen, str(path)
    return "tensorflow", "Keras's default"


def _framework_row(module: str, environ: Mapping[str, str]) -> str:
    found = framework_distribution(module)
    if found is None:
        return "not installed"
    distribution, version = found
    text = version
    if distribution.replace("-", "_") != module:
        text += f" (from {distribution})"
    if module == "keras":
        major = version.split(".")[0]
        if major.isdigit() and int(major) < 3:
            text += ", backend tensorflow (Keras 2)"
        else:
            backend, origin = keras_backend(environ)
            text += f", backend {backend} ({origin})"
    return text


def frameworks_section(context: CheckContext) -> Section:
    """Deep-learning frameworks found, by installed metadata (none is imported), under the
    names they are imported by; Keras with the backend it would load."""
    rows = [(module, _framework_row(module, context.environ)) for module in FRAMEWORKS]
    return Section("Frameworks", rows)


def _host_summary(report: HostReport) -> str:
    """One line of what a host runs: how ssh went, then versions."""
    if report.facts is None:
        return f"NOT READY: {report.problem.reason if report.problem else 'no answer'}"
    facts = report.facts
    reached = "this machine" if report.local else f"ssh ok ({report.seconds or 0:.1f} s)"
    versions = facts.get("versions", {})
    parts = [
        reached,
        f"Python {facts.get('python')}",
        f"ringplug {versions.get('ringplug') or 'missing'}",
        f"mpi4py {versions.get('mpi4py') or 'missing'}",
    ]
    if facts.get("mpi_library"):
        parts.append(str(facts["mpi_library"]))
    elif versions.get("mpich"):
        parts.append(f"mpich {versions['mpich']}")
    parts += [f"{name} {versions[name]}" for name in FRAMEWORKS if versions.get(name)]
    return ", ".join(parts)


def hosts_section(context: CheckContext) -> Section | None:
    """Every host of ``-H``: reached over ssh without a prompt? what does it run?"""
    preflight = context.preflight()
    if preflight is None:
        return None
    section = Section("Hosts")
    for report in preflight.participants:
        name = report.label if report.in_job else f"{report.label} (launches, runs no ranks)"
        section.rows.append((name, _host_summary(report)))
    section.warnings += preflight.warnings
    section.problems += [
        problem for problem in preflight.problems if problem.reason != "no shared network"
    ]
    return section


def network_section(context: CheckContext) -> Section | None:
    """The interfaces that route between all hosts, and what MPI and NCCL would be told."""
    preflight = context.preflight()
    if preflight is None:
        return None
    section = Section("Network")
    if not preflight.probed and not preflight.requested:
        if len(preflight.participants) < 2:
            section.rows.append(("hosts", "one machine: its ranks talk over shared memory"))
        else:
            section.rows.append(("hosts", "not probed: fewer than two hosts answered"))
        return section
    how = (
        "named with --network-interface" if preflight.requested else "reached from every other host"
    )
    for report in preflight.participants:
        if report.facts is None:
            continue
        chosen = ", ".join(interface.describe() for interface in report.usable) or "none"
        section.rows.append((report.label, f"{chosen} ({how})"))
        for interface, why in report.rejected:
            section.rows.append(("", f"left out {interface.describe()}: {why}"))
    choice = preflight.network_choice()
    launcher = context.launcher()
    if choice is not None and launcher is not None and not preflight.problems:
        spec = JobSpec(
            np=total_slots(context.hosts),
            command=["PROGRAM"],
            hosts=list(context.hosts),
            network_interfaces=list(context.network_interfaces),
            ssh=context.ssh,
            network=choice,
        )
        section.rows.append(
            ("launch line", build_plan(spec, launcher, environ=context.environ).shell_line())
        )
    section.problems += [
        problem for problem in preflight.problems if problem.reason == "no shared network"
    ]
    return section


SECTIONS: list[Callable[[CheckContext], Section | None]] = [
    python_section,
    ringplug_section,
    mpi_section,
    frameworks_section,
    gpu_section,
    hosts_section,
    network_section,
]
"""Report sections in print order; append a builder here to add one (``None``: left out)."""


def build_report(context: CheckContext | None = None) -> list[Section]:
    """Gather every section of the report."""
    context = CheckContext() if context is None else context
    sections = (builder(context) for builder in SECTIONS)
    return [section for section in sections if section is not None]


def format_report(sections: list[Section], verdict: bool = False) -> str:
    """The report as text: a block per section, every warning, then the verdict.

    The verdict (problems, each with its fix) is printed when there are problems, or
    always with ``verdict=True``.
    """
    width = max((len(name) for section in sections for name, _ in section.rows), default=0)
    lines: list[str] = []
    for section in sections:
        lines.append(section.title)
        lines.extend(f"  {name.ljust(width)}  {value}" for name, value in section.rows)
        lines.append("")
    warnings = [warning for section in sections for warning in section.warnings]
    lines.extend(f"WARNING: {warning}" for warning in warnings)
    problems = [problem for section in sections for problem in section.problems]
    if problems:
        if warnings:
            lines.append("")
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        lines.append(f"Verdict: NOT READY, {count}")
        for number, problem in enumerate(problems, start=1):
            lines.append(f"  {number}. {problem.describe()}")
            lines.append(f"     fix: {problem.fix}")
    elif verdict:
        if warnings:
            lines.append("")
        lines.append(
            "Verdict: READY: every host answered over ssh without a prompt, runs the same "
            "ringplug and MPI, and the hosts reach each other"
            + (" (see the warnings above)" if warnings else "")
        )
    return "\n".join(lines).rstrip() + "\n"


def run_check(context: CheckContext | None = None) -> int:
    """Print the report; return the exit code for ``ringrun --check``: 1 if it found problems."""
    context = CheckContext() if context is None else context
    sections = build_report(context)
    sys.stdout.write(format_report(sections, verdict=bool(context.hosts)))
    sys.stdout.flush()
    return 1 if any(section.problems for section in sections) else 0
