"""ringplug._mirror: a package's own files imported again with their imports renamed (how
`ringplug.pytorch_lightning` and `ringplug.lightning_fabric` are built)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import marshal
import sys
import traceback
from pathlib import Path

import pytest

from ringplug import _mirror

# As Lightning's: a subpackage of one framework ("bundle.core", like "lightning.fabric") is a
# top-level package of its own elsewhere ("standalone_fw", like "lightning_fabric").
RENAMES = {"bundle.core": "standalone_fw", "src_integration": "mirror_integration"}


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """Two "frameworks" with the same classes in distinct copies, an integration written
    against the first, and its mirror package; everything is unloaded afterwards."""
    write(
        tmp_path,
        {
            "bundle/__init__.py": "",
            "bundle/core/__init__.py": "",
            "bundle/core/base.py": "class Base:\n    where = 'bundle.core'\n",
            "standalone_fw/__init__.py": "",
            "standalone_fw/base.py": "class Base:\n    where = 'standalone_fw'\n",
            "src_integration/__init__.py": (
                '"""The integration."""\nfrom .strategy import Strategy\n'
            ),
            "src_integration/helper.py": "def double(x):\n    return 2 * x\n",
            "src_integration/strategy.py": (
                "from __future__ import annotations\n"
                "from bundle.core.base import Base\n"
                "from . import helper\n"
                "class Strategy(Base):\n"
                "    def run(self):\n"
                "        from bundle.core import base  # imports inside functions are renamed too\n"
                "        return helper.double(1), base.Base.where\n"
                "    def fail(self):\n"
                "        raise ValueError('from the original file')\n"
            ),
            "mirror_integration/__init__.py": (
                '"""The mirror."""\nfrom ringplug._mirror import mirror\n'
                f"mirror(globals(), 'src_integration', {RENAMES!r})\n"
            ),
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    finders = list(sys.meta_path)
    yield tmp_path
    sys.meta_path[:] = finders
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_the_mirror_builds_on_the_other_framework_without_importing_the_original(packages):
    mirrored = importlib.import_module("mirror_integration")
    from standalone_fw.base import Base

    assert issubclass(mirrored.Strategy, Base)
    assert mirrored.Strategy.__module__ == "mirror_integration.strategy"
    assert mirrored.Strategy().run() == (2, "standalone_fw")
    assert mirrored.__doc__ == "The mirror."  # its own docstring, not the original's
    assert sys.modules["mirror_integration.helper"].double(3) == 6  # a mirrored sibling
    assert not {"src_integration", "bundle"} & set(sys.modules)


def test_tracebacks_and_source_lookups_point_at_the_original_files(packages):
    strategy = importlib.import_module("mirror_integration").Strategy
    original = packages / "src_integration" / "strategy.py"
    assert Path(inspect.getsourcefile(strategy)) == original
    with pytest.raises(ValueError) as caught:
        strategy().fail()
    last = traceback.extract_tb(caught.value.__traceback__)[-1]
    assert (Path(last.filename), last.lineno) == (original, 9)
    assert last.line == "raise ValueError('from the original file')"


def test_rewritten_code_is_cached_and_a_changed_source_is_compiled_again(packages, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as without PYTHONDONTWRITEBYTECODE
    importlib.import_module("mirror_integration")
    source = packages / "src_integration" / "helper.py"
    cached = list((source.parent / "__pycache__").glob("helper.*.opt-mirrorintegration.pyc"))
    assert len(cached) == 1

    def reimport() -> int:
        for name in [n for n in sys.modules if n.startswith("mirror_integration")]:
            del sys.modules[name]
        importlib.import_module("mirror_integration")
        return sys.modules["mirror_integration.helper"].double(3)

    # The cache is what runs while it matches the source: replace its code, keep its key.
    header = cached[0].read_bytes()[: len(importlib.util.MAGIC_NUMBER) + 16]
    planted = compile("def double(x):\n    return 7\n", str(source), "exec")
    cached[0].write_bytes(header + marshal.dumps(planted))
    assert reimport() == 7
    source.write_text("def double(x):\n    return 20 * x\n")  # the cache no longer matches
    assert reimport() == 60


@pytest.mark.parametrize(
    ("statement", "message"),
    [
        ("import bundle.core.base\n", "binds a name the mirror cannot rename"),
        ("import bundle as fw\n", "`bundle` has no standalone counterpart"),
    ],
)
def test_imports_the_mirror_cannot_rename_are_refused_naming_file_and_line(
    packages, statement, message
):
    helper = packages / "src_integration" / "helper.py"
    helper.write_text("X = 1\n" + statement)
    with pytest.raises(_mirror.MirrorError, match=message) as caught:
        importlib.import_module("mirror_integration")
    assert f"{helper}:2" in str(caught.value)


def test_a_read_only_install_caches_in_the_users_cache_directory(packages, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(packages / "user-cache"))
    (packages / "src_integration" / "__pycache__").write_text("")  # no cache directory here
    importlib.import_module("mirror_integration")
    cached = sorted(p.name.split(".")[0] for p in (packages / "user-cache").rglob("*.pyc"))
    assert cached == ["__init__", "helper", "strategy"]
