"""Every framework name ringplug wraps exists in the versions installed here: a framework
release that drops one fails this test, not a user's fit."""

from __future__ import annotations

import subprocess
import sys

import pytest

# One namespace per process: the integrations import the framework's modules they patch.
NAMESPACES = {
    "lightning": "import ringplug, lightning.fabric, lightning.pytorch",
    "standalone": "import ringplug, lightning_fabric, pytorch_lightning",
}


@pytest.mark.parametrize("namespace", list(NAMESPACES))
def test_every_patched_lightning_name_exists(namespace):
    pytest.importorskip("lightning")
    if namespace == "standalone":
        pytest.importorskip("pytorch_lightning")
        pytest.importorskip("lightning_fabric")
    code = (
        f"{NAMESPACES[namespace]}\nimport warnings\nfrom ringplug import _patching\n"
        "for w in _patching.applied: print(w.found, w.owner, w.name)\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    names = {line.split()[-1] for line in lines}
    # Fabric's connector and Fabric itself, the Trainer's connector and Trainer itself.
    assert {"_choose_strategy", "__init__", "launch"} <= names, lines
    assert len(lines) == 5, lines
    assert all(line.startswith("True ") for line in lines), lines
