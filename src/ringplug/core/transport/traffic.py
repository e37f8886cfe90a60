"""What one rank's engine sends: point-to-point messages and their bytes, by purpose, and
the MPI collectives it calls (whose own messages MPI sends, uncounted here).

The counts are exact and cheap (an addition per message); tests and `ringplug-bench`
read them to show how a cycle's cost grows with the number of ranks.
"""

from __future__ import annotations

import dataclasses

NEGOTIATION = "negotiation"
DATA = "data"
NOTICES = "notices"


@dataclasses.dataclass
class Traffic:
    """Messages and bytes this rank has sent, by purpose, and the MPI collectives it called.

    Args:
        messages: purpose (`NEGOTIATION`, `DATA`, `NOTICES`) -> point-to-point sends.
        bytes: purpose -> bytes of those sends.
        collectives: MPI collective (e.g. "Iallreduce") -> calls.

    Example:
        >>> traffic = Traffic()
        >>> traffic.sent(NEGOTIATION, 40)
        >>> traffic.snapshot()["messages"]
        {'negotiation': 1}
    """

    messages: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)

    def sent(self, purpose: str, nbytes: int, count: int = 1) -> None:
        """Count `count` sends of `nbytes` bytes in all, for `purpose`."""
        messages, sizes = self.messages, self.bytes
        messages[purpose] = messages.get(purpose, 0) + count
        sizes[purpose] = sizes.get(purpose, 0) + nbytes

    def called(self, collective: str) -> None:
        """Count one call of MPI's `collective`."""
        self.collectives[collective] = self.collectives.get(collective, 0) + 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A copy of the counts, as plain dicts (for JSON)."""
        return {
            "messages": dict(self.messages),
            "bytes": dict(self.bytes),
            "collectives": dict(self.collectives),
        }


def difference(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict:
    """`after` minus `before` (two snapshots), leaving out what did not change."""
    return {
        group: {
            key: value - before.get(group, {}).get(key, 0)
            for key, value in counts.items()
            if value != before.get(group, {}).get(key, 0)
        }
        for group, counts in after.items()
    }
