"""Every framework name ringplug wraps or calls exists in the versions installed here (a
framework release that drops one fails this test, not a user's fit), and a missing name is a
warning with the fallback, never an error."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys

import pytest

from ringplug import _patching

# One namespace per process: the patch modules import the framework modules they patch.
NAMESPACES = {
    "lightning": ("lightning", "ringplug.fabric.patches", "ringplug.lightning.patches"),
    "standalone": (
        "pytorch_lightning",
        "ringplug.lightning_fabric.patches",
        "ringplug.pytorch_lightning.patches",
    ),
}


def run_python(code: str, **env: str) -> list[str]:
    """The lines `code` printed in a fresh interpreter (frameworks import once per process),
    where a warning about a missing name is an error."""
    result = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


# Internals that Lightning added after the oldest release ringplug accepts (lightning>=2.4),
# with the release that added each: ringplug wraps them quietly where they exist and needs
# nothing in their place before (`make test-oldest` runs this file on Lightning 2.4).
ADDED_AFTER_THE_FLOOR = {
    # Before it, the loop reads `trainer.received_sigterm`, which SigtermFlag agrees.
    "loops.training_epoch_loop._TrainingEpochLoop._broadcast_sigterm_tensor": "2.5.2",
}


@pytest.mark.parametrize("namespace", list(NAMESPACES))
def test_every_patched_lightning_name_exists(namespace):
    package, *modules = NAMESPACES[namespace]
    pytest.importorskip(package)
    from packaging.version import Version  # Lightning's own dependency

    code = (
        f"import importlib, ringplug, {package}\nfrom ringplug import _patching\n"
        f"print({package}.__version__)\n"
        f"for name in {modules!r}:\n"
        "    patches = importlib.import_module(name)\n"
        "    print(name, len(patches.targets()), _patching.absent(patches.targets()))\n"
    )
    version, *lines = run_python(code)
    assert len(lines) == 2, lines
    for line in lines:
        module, count, absent = line.split(" ", 2)
        assert int(count) >= 3, line
        for name in ast.literal_eval(absent):
            since = next(
                (v for n, v in ADDED_AFTER_THE_FLOOR.items() if name.endswith("." + n)), None
            )
            assert since is not None and Version(version) < Version(since), (
                f"{package} {version} has no {name}, which {module} wraps"
            )


class _Framework:
    def present(self):
        return 1


def test_a_missing_name_is_a_warning_with_the_fallback_and_nothing_is_wrapped():
    with pytest.warns(RuntimeWarning, match=r"frame 1\.0 has no .*_Framework\.absent.*by hand"):
        assert not _patching.wrap(
            _Framework, "absent", lambda f: f, version="frame 1.0", fallback="do it by hand"
        )
    assert _patching.absent([(_Framework, "absent"), (_Framework, "present")]) == [
        f"{__name__}._Framework.absent"
    ]


def test_a_wrap_happens_once_unless_asked_again_from_the_original():
    class Framework(_Framework):
        pass

    def plus(n):
        return lambda f: lambda self: f(self) + n

    assert _patching.wrap(Framework, "present", plus(1), version="x", fallback="y")
    assert _patching.wrap(Framework, "present", plus(1), version="x", fallback="y")
    assert Framework().present() == 2  # a second import of the integration adds nothing
    instance = Framework()
    for n in (10, 20):  # an instance re-targeted for a later fit: from the original again
        bound = lambda method, n=n: lambda: method() + n  # noqa: E731 - a bound method's
        assert _patching.wrap(instance, "present", bound, version="x", fallback="y", again=True)
    assert instance.present() == 22  # Framework's own (2) + 20, not + 10 + 20


def test_every_keras_name_ringplug_overrides_exists_and_a_keras_without_one_is_refused():
    pytest.importorskip("keras")
    backend = "jax" if importlib.util.find_spec("jax") else "tensorflow"
    code = (
        "import keras\nfrom ringplug import _patching\nfrom ringplug.keras import patches\n"
        "from ringplug.keras.backup import BackupAndRestore\n"
        "from ringplug.keras.optimizer import _ReduceBeforeClipping as plain\n"
        "from ringplug.keras.optimizer import _ReduceBeforeFinitenessCheck as scaled\n"
        "print(len(patches.targets()), _patching.absent(patches.targets()))\n"
        "hooks = [n for n in patches.overridden(BackupAndRestore) if n.startswith('on_')]\n"
        "print(patches.overridden(plain) == sorted(patches.OPTIMIZER_OVERRIDES),\n"
        "      patches.overridden(scaled) == sorted(patches.LOSS_SCALE_OVERRIDES),\n"
        "      hooks == sorted(patches.BACKUP_OVERRIDES))\n"
        "class Old(keras.optimizers.SGD):\n"
        "    _clip_gradients = None  # as a Keras that no longer has it\n"
        "try:\n"
        "    patches.subclass_with(Old, plain)\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    lines = run_python(code, KERAS_BACKEND=backend)
    count, absent = lines[0].split(" ", 1)
    assert int(count) >= 5 and absent == "[]", lines
    # The declared lists are what ringplug's classes override, so targets() is complete.
    assert lines[1] == "True True True", lines
    refusal = lines[2]
    assert "reduces the gradients inside" in refusal and "_clip_gradients" in refusal
    assert "the ranks would each step with their own gradients" in refusal
