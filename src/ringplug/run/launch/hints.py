"""What to do about errors a rank printed that ringplug recognises, said by ringrun after
the job ends: errors whose own text does not say that ringplug is the way out.

Each hint is matched against the ranks' output lines as ringrun relays them; a job that
printed none of them gets no hint.
"""

from __future__ import annotations

import re

# "ring", and the sharded stages' "ring_zero1" / "ring_zero2" (RingStrategy.zero_names).
_RING_NOT_REGISTERED = re.compile(r"invalid strategy name: `strategy='ring(?:_zero[12])?'`")
_CLASS_PATH_AS_NAME = re.compile(r"invalid strategy name: `strategy='ringplug\.[\w.]*'`")

RING_NOT_REGISTERED = (
    "Lightning did not know strategy='ring' (or 'ring_zero1', 'ring_zero2'): nothing imported "
    "ringplug before the Trainer (or Fabric) was made, and a name from a config file is looked "
    "up in Lightning's registry, which ringplug fills when it is imported (Lightning has no "
    "entry point for strategies). Name the class instead: in a Hydra config `strategy: "
    "{_target_: ringplug.lightning.RingStrategy}`, in a LightningCLI config `strategy: "
    "{class_path: ringplug.lightning.RingStrategy}` (add `zero: 1` or `2` to its arguments "
    "for the sharded stages); in a script, `import ringplug` before the Trainer or the "
    "Fabric. If the script imports it, the interpreter the ranks run may lack ringplug "
    "(`python -c 'import ringplug'` with that python tells): install it there, "
    "`python -m pip install 'ringplug[lightning]'`."
)


CLASS_PATH_AS_NAME = (
    "Lightning took ringplug's class path for a strategy name (LightningCLI reads "
    "`--trainer.strategy=ringplug.lightning.RingStrategy` as a string). Give it as a class: "
    "`--trainer.strategy.class_path=ringplug.lightning.RingStrategy`, or in the YAML config "
    "`strategy: {class_path: ringplug.lightning.RingStrategy}`."
)


def hint_for(line: str) -> str | None:
    """The hint for an output `line`, or None."""
    if "invalid strategy name" not in line:
        return None
    if _RING_NOT_REGISTERED.search(line):
        return RING_NOT_REGISTERED
    if _CLASS_PATH_AS_NAME.search(line):
        return CLASS_PATH_AS_NAME
    return None
