"""ssh for ringrun: the options every connection gets, and what ssh's complaints mean.

Both MPI launchers start remote ranks with ``ssh HOST command``, and ringrun's preflight does
the same, with the same options, so that what the preflight sees is what the launcher will
see. ssh's error lines are short and cryptic; :func:`diagnose` turns them into a reason
("ssh refused", "host key", "no route", "wrong Python") and the fix, naming the host.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

DEFAULT_CONNECT_TIMEOUT_S = 10


@dataclass(frozen=True)
class SshOptions:
    """How to reach remote hosts; ``None`` fields leave ssh's own configuration alone.

    Args:
        port: the port sshd listens on (``ssh -p``).
        identity_file: the private key to log in with (``ssh -i``).
        config_file: an ssh configuration file used instead of ``~/.ssh/config``
            (``ssh -F``); it may set all of the above per host.
        connect_timeout_s: how long to wait for sshd to answer. Defaults to 10.
    """

    port: int | None = None
    identity_file: str | None = None
    config_file: str | None = None
    connect_timeout_s: int = DEFAULT_CONNECT_TIMEOUT_S

    @property
    def customized(self) -> bool:
        """Whether the user gave any ssh option on ringrun's command line."""
        return any(value is not None for value in (self.port, self.identity_file, self.config_file))

    def arguments(self) -> list[str]:
        """Options for every ssh command line, before the host.

        ``BatchMode=yes``: a job must never wait at a password or passphrase prompt that
        nobody sees; ssh fails at once instead, and ringrun says what to fix.
        """
        words = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout_s}"]
        if self.config_file is not None:
            words += ["-F", self.config_file]
        if self.identity_file is not None:
            words += ["-i", self.identity_file]
        if self.port is not None:
            words += ["-p", str(self.port)]
        return words

    def command(self, host: str, remote_command: str) -> list[str]:
        """``ssh OPTIONS HOST REMOTE_COMMAND`` (``-T``: no terminal, so no prompts either)."""
        return ["ssh", "-T", *self.arguments(), host, remote_command]


@dataclass(frozen=True)
class HostProblem:
    """Something on one host that stops ranks from starting there, and how to fix it.

    Args:
        host: the host as given in ``-H`` or the hostfile (or as ssh named it).
        reason: a few words: "ssh refused", "no route", "host key", ...
        detail: what happened, in a sentence (the tool's own words in quotes).
        fix: what to do about it, with commands where there are any.
    """

    host: str
    reason: str
    detail: str
    fix: str

    def describe(self) -> str:
        """One line: host, reason and detail; the fix goes on its own line in reports."""
        return f"host {self.host}: {self.reason}: {self.detail}"


@dataclass
class _Rule:
    pattern: re.Pattern[str]
    reason: str
    detail: str
    fix: str


_RULES = [
    _Rule(
        re.compile(r"connect to host (?P<host>\S+) port (?P<port>\d+): Connection refused"),
        "ssh refused",
        'nothing accepts ssh connections on port {port} ("Connection refused")',
        "start the ssh server on {host} (on Debian/Ubuntu `sudo apt-get install "
        "openssh-server && sudo systemctl start ssh`), or if it listens on another port, "
        "give that port with `ringrun -p PORT` (or in an ssh config file: --ssh-config-file)",
    ),
    _Rule(
        re.compile(
            r"connect to host (?P<host>\S+) port (?P<port>\d+): "
            r"(?P<why>No route to host|Network is unreachable|Connection timed out|"
            r"Operation timed out|Host is down)"
        ),
        "no route",
        'this machine cannot reach it ("{why}" on port {port})',
        "check that {host} is up and that its address is one this machine can reach (`ssh "
        "{host} true` from here); in -H or the hostfile use the name or address of the "
        "network the hosts share",
    ),
    _Rule(
        re.compile(r"Could not resolve hostname (?P<host>[^:\s]+)"),
        "unknown host name",
        "the name does not resolve to an address",
        "give the address of {host} in -H or the hostfile instead, or add {host} to DNS or "
        "to /etc/hosts on this machine",
    ),
    _Rule(
        re.compile(r"Host key for (?P<host>\S+) has changed"),
        "host key changed",
        "its ssh host key differs from the one in known_hosts (reinstalled, or not the "
        "machine you think)",
        "if the host was reinstalled, remove the old key with `ssh-keygen -R {host}`, then "
        "accept the new one after checking its fingerprint (`ssh {host} true`)",
    ),
    _Rule(
        re.compile(r"No \S+ host key is known for (?P<host>\S+)"),
        "host key",
        "its ssh host key is not in known_hosts, and ssh will not ask in a batch job",
        "accept the key once: `ssh {host} true` and answer yes after checking the "
        "fingerprint, or add it with `ssh-keyscan -H {host} >> ~/.ssh/known_hosts`",
    ),
    _Rule(
        re.compile(r"(?:\S+@)?(?P<host>[^@\s:]+): Permission denied \((?P<methods>[^)]*)\)"),
        "ssh login refused",
        'no key this machine offers is accepted ("Permission denied ({methods})"), and '
        "ringrun never waits at a password prompt",
        "install your public key on {host} with `ssh-copy-id {host}` (or give the right key "
        "with `ringrun -i KEY`), then check that `ssh -o BatchMode=yes {host} true` works",
    ),
    _Rule(
        re.compile(r"Connection (?:to (?P<host>\S+) )?closed by remote host"),
        "connection closed",
        'the ssh server closed the connection ("Connection closed by remote host")',
        "check the ssh server's log on {host} (MaxStartups, AllowUsers, a full disk)",
    ),
]

_HOST_KEY_FAILED = re.compile(r"Host key verification failed")
# "bash: line 1: /venv/bin/python: No such file or directory", "env: '/venv/bin/python': No
# such file or directory" (quotes differ by locale), "sh: 1: /venv/bin/python: not found".
_MISSING_PROGRAM = re.compile(
    r"['\"\u2018]?(?P<path>/[^\s'\"\u2019:]+)['\"\u2019]?:? "
    r"(?:No such file or directory|not found|command not found)"
)
_NO_MODULE = re.compile(r"No module named '?(?P<module>[\w.]+)'?")


def diagnose_line(line: str, host: str | None = None) -> HostProblem | None:
    """What one line of ssh's output says about a host, or ``None`` if it says nothing.

    ``host`` is the host the line is about when the line itself does not name it.
    """
    for rule in _RULES:
        match = rule.pattern.search(line)
        if match is None:
            continue
        values = {key: value for key, value in match.groupdict().items() if value is not None}
        values.setdefault("host", host)
        if values["host"] is None:
            continue
        return HostProblem(
            host=values["host"],
            reason=rule.reason,
            detail=rule.detail.format(**values),
            fix=rule.fix.format(**values),
        )
    return None


def diagnose(
    host: str,
    output: Iterable[str],
    returncode: int | None,
    python: str,
    needed: Iterable[str] = (),
) -> HostProblem:
    """Explain why ``ssh HOST python -m ringplug.run.hosts.probe`` failed.

    Args:
        host: the host as the user named it.
        output: the lines ssh and the remote command printed (stderr and stray stdout).
        returncode: ssh's exit status; ``None`` when it did not finish in time.
        python: the interpreter path that was run on the host.
        needed: other paths the job runs on the host (the launcher's proxy).
    """
    lines = [line.strip() for line in output if line.strip()]
    if returncode is None:
        return HostProblem(
            host,
            "no answer",
            "ssh did not finish in time (no route that drops packets silently, a firewall, "
            "or a login that waits for something)",
            f"check that `ssh -o BatchMode=yes {host} true` returns at once from this "
            "machine; give a longer --start-timeout if the host is just slow",
        )
    for line in lines:
        problem = diagnose_line(line, host)
        if problem is not None:
            return problem
    if any(_HOST_KEY_FAILED.search(line) for line in lines):
        return HostProblem(
            host,
            "host key",
            'ssh could not verify the host key ("Host key verification failed")',
            f"accept the key once with `ssh {host} true` after checking the fingerprint, or "
            f"add it with `ssh-keyscan -H {host} >> ~/.ssh/known_hosts`",
        )
    for line in lines:
        match = _MISSING_PROGRAM.search(line)
        if match and match.group("path") in (python, *needed):
            return wrong_python(host, python, f'"{match.group("path")}" does not exist there')
        match = _NO_MODULE.search(line)
        if match and match.group("module").startswith("ringplug"):
            return wrong_python(host, python, f'{python} there has no ringplug ("{line}")')
    last = lines[-1] if lines else "no output"
    return HostProblem(
        host,
        "ssh failed",
        f'ssh exited with code {returncode} ("{last}")',
        f"run `ssh -o BatchMode=yes {host} {python} -m ringplug.run.hosts.probe </dev/null` by "
        "hand to see the whole message",
    )


def wrong_python(host: str, python: str, detail: str) -> HostProblem:
    """The problem of a host without the job's interpreter or without ringplug in it."""
    return HostProblem(
        host,
        "wrong Python",
        detail,
        f"every host runs the ranks with {python} (the Python that runs ringrun, at the same "
        f"path): create the same virtualenv at that path on {host} with the same packages "
        "(`pip install ringplug[mpich]` and your framework), or put it on a filesystem all "
        "hosts share",
    )


@dataclass
class LaunchDiagnosis:
    """What the launcher's own output said about hosts while starting a job.

    Fed line by line with the launcher's stderr (ssh's complaints pass through it); keeps
    the first problem named for each host.
    """

    problems: list[HostProblem] = field(default_factory=list)
    unnamed: list[str] = field(default_factory=list)

    def feed(self, line: str) -> None:
        """Note the host problem ``line`` reports, if any.

        Lines that explain a failed start but name no host (a remote shell's "No such file
        or directory", ssh's "Host key verification failed") are kept in ``unnamed``.
        """
        problem = diagnose_line(line)
        if problem is not None:
            if all(known.host != problem.host for known in self.problems):
                self.problems.append(problem)
            return
        text = line.strip()
        unnamed = (
            _HOST_KEY_FAILED.search(text)
            or _MISSING_PROGRAM.search(text)
            or (_NO_MODULE.search(text) and "ringplug" in text)
        )
        if unnamed and text not in self.unnamed:
            self.unnamed.append(text)
