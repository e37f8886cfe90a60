"""What to do about errors a rank printed that ringplug recognises, said by ringrun after
the job ends: errors whose own text does not say that ringplug is the way out.

Each hint is matched against the ranks' output lines as ringrun relays them; a job that
printed none of them gets no hint.
"""

from __future__ import annotations

import re

_RING_NOT_REGISTERED = re.compile(r"invalid strategy name: `strategy='ring'`")

RING_NOT_REGISTERED = (
    "Lightning did not know strategy='ring': nothing imported ringplug before the Trainer "
    "(or Fabric) was made, and a name from a config file is looked up in Lightning's "
    "registry, which ringplug fills when it is imported (Lightning has no entry point for "
    "strategies). Name the class instead: in a Hydra config `strategy: {_target_: "
    "ringplug.lightning.RingStrategy}`, in a LightningCLI config `strategy: {class_path: "
    "ringplug.lightning.RingStrategy}`; in a script, `import ringplug` before the Trainer."
)


def hint_for(line: str) -> str | None:
    """The hint for an output `line`, or None."""
    if "strategy" in line and _RING_NOT_REGISTERED.search(line):
        return RING_NOT_REGISTERED
    return None
