"""horovodrun's flags in ``ringrun``: its spellings of shared flags, its tuning flags, refusals.

People moving from Horovod replace ``horovodrun`` with ``ringrun`` and keep their flags.
:func:`add_horovodrun_flags` adds the ones ringrun can honour as one ``--help`` group: the
spellings of settings, which each setting declares with the rest of it (``horovodrun=`` in
:mod:`ringplug.run.settings`), and the few that are no setting. Flags
ringplug has no equivalent for are parsed too (so their values are not mistaken for the
command) but hidden from ``--help``; :func:`refusal` then names the first one given and says
what to do instead, and ``ringrun`` exits with code 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from ringplug.run.launch.elastic import BLACKLIST_COOLDOWN_S
from ringplug.run.settings import RunSettings, add_flags

REFUSED_DEST = "horovodrun_refused"
"""Namespace attribute listing the unsupported horovodrun flags given, in order."""


@dataclass(frozen=True)
class Unsupported:
    """horovodrun flags ringrun refuses, and why.

    Args:
        flags: every spelling of the flags that share this reason.
        values: how many values each flag takes on horovodrun's command line (0, 1 or 2).
        reason: what ringplug does instead, and what to do; follows "FLAG is not supported: ".
    """

    flags: tuple[str, ...]
    values: int
    reason: str


_ELASTIC = (
    "ringrun restarts a failed job with the hosts the discovery script names (--max-restarts, "
    "--min-np, --max-np, --host-discovery-script); a lost host stays out of the job for "
    f"{BLACKLIST_COOLDOWN_S[0]:g} to {BLACKLIST_COOLDOWN_S[1]:g} s; drop the flag"
)
_AUTOTUNE = (
    "ringplug's autotune (--autotune) searches a small grid guided by a cost model, not "
    "Horovod's Gaussian process, so it has no noise to set; drop the flag (its other flags: "
    "--autotune-log-file, --autotune-warmup-samples, --autotune-steps-per-sample, "
    "--autotune-bayes-opt-max-samples)"
)
_AUTOTUNE_FLAGS = (
    "ringplug's autotune takes --autotune, --autotune-log-file, --autotune-warmup-samples, "
    "--autotune-steps-per-sample and --autotune-bayes-opt-max-samples (its most samples); "
    "drop the flag"
)
_HIERARCHICAL = (
    "ringplug's allgather takes MPI's Allgatherv or one flat ring over all ranks, by size as "
    "its measured algorithm table says (RINGPLUG_CALIBRATION); drop the flag (only the "
    "allreduce has a hierarchical form: --hierarchical-allreduce)"
)
_DEVICE_OPERATIONS = (
    "ringplug picks the data plane by where a tensor lives: NCCL for GPU tensors, MPI for "
    "CPU ones (no Gloo or oneCCL to choose); drop the flag"
)

UNSUPPORTED = (
    Unsupported(
        ("--gloo",),
        0,
        "ringrun always starts ranks through MPI (mpiexec or mpirun), and ringplug runs its "
        "collectives over MPI on the CPU; drop --gloo",
    ),
    Unsupported(
        ("--jsrun",),
        0,
        "ringrun starts ranks with mpiexec or mpirun; start them with jsrun directly "
        "(`jsrun ... python train.py`, with the MPI library mpi4py uses), or run ringrun "
        "inside the allocation",
    ),
    Unsupported(("--blacklist-cooldown-range",), 2, _ELASTIC),
    Unsupported(("--autotune-gaussian-process-noise",), 1, _AUTOTUNE),
    Unsupported(("--hierarchical-allgather",), 0, _HIERARCHICAL),
    Unsupported(
        ("--cache-capacity",),
        1,
        "ringplug's cache of agreed tensor names has a fixed size; drop the flag",
    ),
    Unsupported(
        ("--num-nccl-streams",),
        1,
        "ringplug runs its NCCL collectives on one stream per rank, in the order the ranks "
        "agreed; drop the flag",
    ),
    Unsupported(
        ("--thread-affinity",),
        1,
        "ringplug does not pin its engine thread; pin whole ranks with --bind-to core instead",
    ),
    Unsupported(
        (
            "--gpu-operations",
            "--gpu-allreduce",
            "--gpu-allgather",
            "--gpu-broadcast",
            "--gpu-alltoall",
            "--gpu-reducescatter",
            "--cpu-operations",
        ),
        1,
        _DEVICE_OPERATIONS,
    ),
)

# Flags of these families that horovodrun versions added and UNSUPPORTED does not list
# reach ringrun as unrecognized options; they get the family's reason rather than argparse's
# "unrecognized arguments".
_FAMILIES = (
    ("--autotune-", _AUTOTUNE_FLAGS),
    ("--elastic-", _ELASTIC),
    ("--hierarchical-", _HIERARCHICAL),
    ("--gpu-", _DEVICE_OPERATIONS),
    ("--cpu-", _DEVICE_OPERATIONS),
)

TIMELINE_CYCLES_NOTE = (
    "--timeline-mark-cycles changes nothing: ringplug's timeline always marks every engine cycle"
)


class _Refuse(argparse.Action):
    """Remember that an unsupported flag was given; :func:`refusal` reports it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[str] | None,
        option_string: str | None = None,
    ) -> None:
        refused = getattr(namespace, self.dest, None) or []
        setattr(namespace, self.dest, [*refused, option_string or self.option_strings[0]])


def add_horovodrun_flags(parser: argparse.ArgumentParser) -> None:
    """Add horovodrun's flags to ringrun's parser: one help group, refusals hidden."""
    group = parser.add_argument_group(
        "horovodrun compatibility",
        "horovodrun's flags, for scripts that switch to ringrun. Other horovodrun flags "
        "(--gloo, --jsrun, --autotune-gaussian-process-noise, --hierarchical-allgather, "
        "--cache-capacity, "
        "--num-nccl-streams, --thread-affinity, --gpu-*/--cpu-operations) stop ringrun with "
        "a note on what to do instead.",
    )
    add_flags(RunSettings, group, horovodrun=True)
    group.add_argument(
        "--timeline-mark-cycles",
        action="store_true",
        help="accepted; ringplug's timeline always marks engine cycles",
    )
    group.add_argument(
        "-cb", "--check-build", dest="check", action="store_true", help="same as --check"
    )
    group.add_argument("--mpi", action="store_true", help="accepted; MPI is ringrun's only mode")
    # They ask for what ringplug does anyway.
    for flag in ("--no-hierarchical-allreduce", "--no-hierarchical-allgather"):
        group.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for entry in UNSUPPORTED:
        for flag in entry.flags:
            group.add_argument(
                flag,
                action=_Refuse,
                dest=REFUSED_DEST,
                nargs={0: 0, 1: None, 2: 2}[entry.values],
                default=[],
                help=argparse.SUPPRESS,
            )


def refusal(args: argparse.Namespace, unrecognized: Sequence[str] = ()) -> str | None:
    """The line refusing the first unsupported horovodrun flag given, or ``None``.

    Args:
        args: what ringrun's parser made of the command line.
        unrecognized: options the parser did not know (``parse_known_args``' leftovers);
            those of horovodrun's flag families are refused with their family's reason.
    """
    reasons = {flag: entry.reason for entry in UNSUPPORTED for flag in entry.flags}
    for flag in getattr(args, REFUSED_DEST, None) or []:
        return f"{flag} is not supported: {reasons[flag]}"
    for option in unrecognized:
        flag = option.split("=", 1)[0]
        for prefix, reason in _FAMILIES:
            if flag.startswith(prefix):
                return f"{flag} is not supported: {reason}"
    return None
