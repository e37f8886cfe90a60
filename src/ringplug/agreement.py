"""Checking that every rank holds the same values: `ringplug.torch.check_agreement` and
`ringplug.keras.RingBroadcast`'s check build on this, framework-neutral part.

Data-parallel ranks must stay bitwise identical, and nothing else notices when they do not:
a step taken on some ranks only (Horovod's ``broadcast_optimizer_state`` did, with weight
decay), a rank-dependent hyperparameter, randomness in an update. Each rank sums the 64-bit
words of each tensor (integer sums: exact, the same whatever the threads, and blind to
NaN != NaN, which compares the values and not the bits) and hashes the list with the names;
one allreduce of two integers tells whether every rank has the same hash. Only when they
differ do the ranks exchange their lists, to name the first tensor that differs and which
ranks hold which value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from . import core
from .core.errors import RingplugError

__all__ = ["RanksDisagreeError", "compare", "numpy_checksum"]

# 62 bits, so that the negated hash (for the minimum, in the same Max allreduce) fits int64.
_HASH_BITS = (1 << 62) - 1


class RanksDisagreeError(RingplugError):
    """The ranks hold different values where they must hold the same (raised on every rank,
    with the same message: which tensor differs first, and which ranks hold which value).

    Attributes:
        tensor: the name of the first tensor that differs (None when the ranks compared
            different lists of tensors).
        groups: the ranks, grouped by the value they hold, the group of the lowest rank first.
    """

    def __init__(
        self, message: str, tensor: str | None = None, groups: Sequence[Sequence[int]] = ()
    ) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.groups = [list(g) for g in groups]


def numpy_checksum(array: np.ndarray) -> int:
    """The wrapping sum of `array`'s bytes as little-endian 64-bit words (the last, partial
    word padded with zeros): any change of one word changes it."""
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    whole = raw.size // 8 * 8
    total = int(raw[:whole].view(np.int64).sum(dtype=np.int64)) if whole else 0
    for shift, byte in enumerate(raw[whole:].tolist()):
        total += byte << (8 * shift)
    return _wrap(total)


def compare(
    names: Sequence[str],
    checksums: Sequence[int],
    *,
    where: str,
    signatures: Sequence[str] | None = None,
    values: Callable[[int], np.ndarray] | None = None,
) -> None:
    """Raise `RanksDisagreeError` on every rank unless every rank passed the same `checksums`
    and `signatures` (one collective of 16 bytes when they do). Every rank must call it.

    Args:
        names: the tensors' names, for the message (rank 0's are shown).
        checksums: one integer per tensor, e.g. `numpy_checksum`.
        signatures: what must match between the ranks besides the values, e.g.
            ``"fc.weight (3, 4) float32"``, so that another model's tensors differ too.
            Defaults to None: the names (give shapes and dtypes alone where the ranks may
            name the same tensor differently, as Keras's counters do).
        where: what was compared, for the message ("at the checkpoint of step 1200").
        values: `values(index)` gives this rank's tensor `index` as a numpy array, for the
            message to say how far apart the ranks are (one broadcast of that tensor, only
            when they disagree). Defaults to None: the message names the tensor only.
    """
    if len(names) != len(checksums) or (signatures is not None and len(signatures) != len(names)):
        raise ValueError("compare: give one checksum (and signature) per name.")
    labels = list(names if signatures is None else signatures)
    if core.size() == 1:
        return
    digest = hashlib.blake2b(digest_size=8)
    for label, checksum in zip(labels, checksums, strict=True):
        digest.update(label.encode())
        digest.update(_wrap(checksum).to_bytes(8, "little", signed=True))
    mine = int.from_bytes(digest.digest(), "little") & _HASH_BITS
    highest, negated_lowest = core.allreduce(
        np.array([mine, -mine], np.int64), "max", name="agreement.hash"
    )
    if highest == -negated_lowest:
        return
    _explain(list(names), labels, [_wrap(c) for c in checksums], where, values)


def _wrap(value: int) -> int:
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


_ADVICE = (
    "Every rank must hold the same values; something ran differently on some ranks (a "
    "step, optimizer state created on some ranks only, a rank-dependent setting, randomness "
    "in the update). Resume from a checkpoint rank 0 wrote (every rank then starts from "
    "rank 0's state), and look for what differs between the ranks."
)


def _explain(
    names: list[str],
    labels: list[str],
    checksums: list[int],
    where: str,
    values: Callable[[int], np.ndarray] | None,
) -> None:
    """The ranks' hashes differ: find the first tensor that differs and raise, on every rank."""
    everyone = core.allgather_object((labels, checksums, names), name="agreement.lists")
    lists = [other[0] for other in everyone]
    names = everyone[0][2]  # the same message on every rank
    if any(other != labels for other in lists):
        groups = _grouped([tuple(other) for other in lists])
        first = min(_first_difference(lists[0], other) for other in lists)
        entries = {
            _ranks(g): lists[g[0]][first] if first < len(lists[g[0]]) else "(no more tensors)"
            for g in groups
        }
        raise RanksDisagreeError(
            f"The ranks compared different tensors {where}: their lists differ first at entry "
            f"{first}: {entries}. Every rank must build the same model and optimizer; check "
            "that every rank gets the same configuration.",
            groups=groups,
        )
    differing = [i for i in range(len(names)) if len({other[1][i] for other in everyone}) > 1]
    first = differing[0]
    groups = _grouped([other[1][first] for other in everyone])
    holders = "; ".join(
        f"{_ranks(g)} {'holds' if len(g) == 1 else 'hold'} value {chr(ord('A') + k)}"
        for k, g in enumerate(groups)
    )
    how = _distances(values(first), groups) if values is not None else ""
    which = (
        "the only tensor that differs"
        if len(differing) == 1
        else f"the first of {len(differing)} tensors that differ"
    )
    raise RanksDisagreeError(
        f"The ranks disagree {where} on {names[first]!r} ({which}, of "
        f"{len(names)} compared): {holders}{how}. {_ADVICE}",
        tensor=names[first],
        groups=groups,
    )


def _distances(value: np.ndarray, groups: list[list[int]]) -> str:
    """How far each other group's value is from the lowest rank's (one broadcast of it)."""
    mine = np.ascontiguousarray(value)
    reference = mine.copy()
    raw = reference.reshape(-1).view(np.uint8)
    core.broadcast(raw, groups[0][0], out=raw, name="agreement.value")
    width = mine.itemsize
    changed = mine.reshape(-1).view(np.uint8).reshape(-1, width) != raw.reshape(-1, width)
    count = int(changed.any(axis=1).sum())
    largest = float("nan")
    if np.issubdtype(mine.dtype, np.number) and count:
        with np.errstate(all="ignore"):
            gap = np.abs(mine.astype(np.complex128) - reference.astype(np.complex128))
        if not np.all(np.isnan(gap)):
            largest = float(np.nanmax(gap))
    reports = core.allgather_object((count, largest), name="agreement.distance")
    base = groups[0][0]
    parts = []
    for group in groups[1:]:
        count, largest = reports[group[0]]
        by = ""
        if largest == 0:
            by = ", equal in value (signed zeros or NaN payloads)"
        elif largest == largest:
            by = f", by at most {largest:.4g}"
        parts.append(
            f"{_ranks(group)} differ{'s' if len(group) == 1 else ''} from rank {base} in "
            f"{count} of {mine.size} elements{by}"
        )
    return " (" + "; ".join(parts) + ")"


def _grouped(values: list) -> list[list[int]]:
    groups: dict = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return sorted(groups.values(), key=lambda g: g[0])


def _ranks(group: Sequence[int]) -> str:
    if len(group) == 1:
        return f"rank {group[0]}"
    return "ranks " + ", ".join(str(r) for r in group)


def _first_difference(a: list[str], b: list[str]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
