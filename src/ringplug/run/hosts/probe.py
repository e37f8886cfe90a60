"""The host side of ringrun's preflight: ``python -m ringplug.run.hosts.probe``, one per host.

ringrun starts one probe on every host of a job (over ssh, or directly on its own machine)
and talks to it in JSON lines on stdin/stdout, each prefixed with :data:`LINE_PREFIX` so
anything else a login shell prints is told apart:

1. The probe listens on a TCP port on all its addresses and answers every connection with a
   random token, then prints a ``hello``: the token and port, and the host's facts (hostname,
   interfaces, Python, versions, files the job needs).
2. ringrun sends ``connect`` with the addresses and ports of every other host's probe. The
   probe tries them all at once and reports, per address, whether it connected and which
   token answered. A token from another host than the one expected means the address is
   not that host's (``docker0``'s ``172.17.0.1`` exists on every Docker host; connecting to
   it reaches one's own bridge), so an address only counts when the expected host answers.
3. End of input ends the probe.

Standard library only, and nothing heavy imported: it must start fast on every host.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ringplug.run.hosts.netinfo import local_interfaces, rdma_devices

LINE_PREFIX = "ringplug-probe "
"""Every line the probe prints for ringrun starts with this."""

DISTRIBUTIONS = ("ringplug", "mpi4py", "mpich")
"""Installed versions reported for each host (read from metadata; nothing is imported)."""

FRAMEWORKS = ("torch", "lightning", "pytorch_lightning", "tensorflow", "keras", "jax")
"""Frameworks reported for each host, by the name they are imported by (their versions come
from whichever distribution installed them; nothing is imported)."""

# Distributions that install a framework under another name than its own: metadata asked for
# "tensorflow" knows nothing of `pip install tensorflow-cpu`.
_OTHER_DISTRIBUTIONS = {
    "tensorflow": (
        "tensorflow-cpu",
        "tensorflow-intel",
        "tensorflow-macos",
        "tensorflow-rocm",
        "tf-nightly",
        "tf-nightly-cpu",
    ),
}

_CONNECT_TIMEOUT_S = 3.0
MAX_PARALLEL_CONNECTS = 64
"""How many addresses one probe tries at a time."""


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def framework_distribution(module: str) -> tuple[str, str] | None:
    """(distribution, version) of the installed package that provides the importable
    `module` (``tensorflow`` from ``tensorflow-cpu``), or ``None`` where none does.

    Nothing is imported: the module is found on the path, its distribution by name, and
    only for an unknown name by the slower scan of every installed distribution.
    """
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    for name in (module.replace("_", "-"), *_OTHER_DISTRIBUTIONS.get(module, ())):
        version = _version(name)
        if version is not None:
            return name, version
    for name in importlib.metadata.packages_distributions().get(module, []):
        version = _version(name)
        if version is not None:
            return name, version
    return None


def framework_versions() -> dict[str, str | None]:
    """The version of each of :data:`FRAMEWORKS`, ``None`` where it is not installed."""
    found = {module: framework_distribution(module) for module in FRAMEWORKS}
    return {module: None if entry is None else entry[1] for module, entry in found.items()}


_LIBRARY_PROBE_TIMEOUT_S = 60.0

# Runs in a child interpreter: loading libmpi in ringrun itself could initialise MPI or clash
# with the launcher. rc.initialize=False loads the library without MPI_Init.
_LIBRARY_PROBE = """
import mpi4py
mpi4py.rc.initialize = False
from mpi4py import MPI
print(" ".join(MPI.Get_library_version().strip().splitlines()[0].split()))
with open("/proc/self/maps") as maps:
    paths = sorted({line.split()[-1] for line in maps if "libmpi" in line.split()[-1]})
print(paths[0] if paths else "")
"""


def probe_mpi_library(python: str, environ: Mapping[str, str]) -> tuple[str, str]:
    """Ask a child interpreter which MPI library mpi4py loads: (version line, path).

    Raises:
        RuntimeError: mpi4py could not load a library; the message has its last error line.
    """
    try:
        result = subprocess.run(
            [python, "-c", _LIBRARY_PROBE],
            capture_output=True,
            text=True,
            timeout=_LIBRARY_PROBE_TIMEOUT_S,
            env=dict(environ),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(str(error)) from None
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"exit code {result.returncode}")
    version, _, path = result.stdout.strip().partition("\n")
    return version.strip(), path.strip()


def host_facts(needed_files: Sequence[str] = (), mpi_library: bool = False) -> dict[str, Any]:
    """What ringrun wants to know about this host, as plain values.

    Args:
        needed_files: paths the job will execute here (the launcher's proxy); each is
            reported as present (an executable file) or not.
        mpi_library: also ask a child interpreter which MPI library mpi4py loads (slower:
            for ``ringrun --check``).
    """
    facts: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "versions": {
            **{name: _version(name) for name in DISTRIBUTIONS},
            **framework_versions(),
        },
        "interfaces": [interface.to_dict() for interface in local_interfaces()],
        "rdma": rdma_devices(),
        "files": {path: os.path.isfile(path) and os.access(path, os.X_OK) for path in needed_files},
    }
    if mpi_library:
        try:
            facts["mpi_library"] = probe_mpi_library(sys.executable, os.environ)[0]
        except RuntimeError as error:
            facts["mpi_library_error"] = str(error)
    return facts


class TokenServer:
    """A TCP listener on every IPv4 address that answers each connection with ``token``."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("0.0.0.0", 0))
        self.socket.listen(128)
        self.port = self.socket.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.socket.accept()
            except OSError:
                return
            with connection, contextlib.suppress(OSError):
                connection.sendall(f"{self.token}\n".encode())


def connect_once(address: str, port: int, timeout_s: float) -> dict[str, Any]:
    """Connect to ``address:port`` and read the token that answers.

    Returns ``{"ok": True, "token": ..., "source": local address used}`` or ``{"ok": False,
    "error": reason}``, the reason being the system's words ("Connection refused", "No
    route to host", "timed out").
    """
    try:
        with socket.create_connection((address, port), timeout=timeout_s) as connection:
            source = connection.getsockname()[0]
            data = b""
            while not data.endswith(b"\n") and len(data) < 256:
                chunk = connection.recv(256)
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        return {"ok": False, "error": "timed out"}
    except OSError as error:
        return {"ok": False, "error": error.strerror or str(error)}
    return {"ok": True, "token": data.decode(errors="replace").strip(), "source": source}


def connect_all(targets: Sequence[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
    """Try every target at once; each result repeats its target's ``key`` and ``address``."""
    if not targets:
        return []

    def attempt(target: dict[str, Any]) -> dict[str, Any]:
        result = connect_once(target["address"], int(target["port"]), timeout_s)
        return {"key": target["key"], "address": target["address"], **result}

    with ThreadPoolExecutor(max_workers=min(len(targets), MAX_PARALLEL_CONNECTS)) as pool:
        return list(pool.map(attempt, targets))


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(LINE_PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m ringplug.run.hosts.probe``."""
    parser = argparse.ArgumentParser(
        prog="python -m ringplug.run.hosts.probe",
        description="Report this host's facts and test connections for ringrun's preflight.",
    )
    parser.add_argument(
        "--need",
        action="append",
        default=[],
        metavar="FILE",
        help="report whether FILE is an executable here (repeatable)",
    )
    parser.add_argument(
        "--mpi-library", action="store_true", help="also report the MPI library mpi4py loads"
    )
    args = parser.parse_args(argv)
    server = TokenServer()
    _say(
        {
            "kind": "hello",
            "token": server.token,
            "port": server.port,
            "facts": host_facts(args.need, args.mpi_library),
        }
    )
    for line in sys.stdin:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        if request.get("kind") == "connect":
            timeout_s = float(request.get("timeout", _CONNECT_TIMEOUT_S))
            _say({"kind": "connected", "results": connect_all(request["targets"], timeout_s)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
