"""Mirrored packages: a ringplug package's own source, imported a second time against other
framework packages.

Lightning ships the same code twice: as ``lightning.pytorch`` / ``lightning.fabric`` inside
the ``lightning`` package, and as the standalone ``pytorch_lightning`` / ``lightning_fabric``
packages. Their classes are distinct (``pytorch_lightning.Trainer`` refuses a strategy built
on ``lightning.pytorch``), so a strategy must be built once against each. ringplug writes
its integrations once, against ``lightning.*`` (`ringplug.lightning`, `ringplug.fabric`), and
`mirror` executes those same files as a second package (`ringplug.pytorch_lightning`,
`ringplug.lightning_fabric`) whose import statements name the standalone packages.

What is rewritten: the module names of ``import`` and ``from ... import`` statements (at any
depth), by longest matching prefix in `STANDALONE`; relative imports are resolved against the
original package first, so ``from .environment import X`` in ``ringplug.lightning.strategy``
becomes ``from ringplug.pytorch_lightning.environment import X``. Nothing else changes, line
numbers included: tracebacks and ``inspect.getsource`` show the original files. Mirrored
modules must name frameworks in import statements only (no ``importlib.import_module`` of
a ``lightning`` name, no bare ``import lightning.pytorch``); `mirror` refuses what it cannot
rewrite rather than import the wrong namespace.

The rewritten code is cached beside the original's bytecode
(``__pycache__/strategy.cpython-311.opt-ringplugpytorchlightning.pyc``), or in
``~/.cache/ringplug/mirror`` where the install is read-only, and checked against a hash of the
source; so, once cached, importing a mirrored module costs about what importing a module costs.
Nothing is written under ``PYTHONDONTWRITEBYTECODE``.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import marshal
import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

STANDALONE: Mapping[str, str] = {
    "lightning.pytorch": "pytorch_lightning",
    "lightning.fabric": "lightning_fabric",
    "ringplug.lightning": "ringplug.pytorch_lightning",
    "ringplug.fabric": "ringplug.lightning_fabric",
}
"""From the ``lightning`` package's namespaces to the standalone packages', and from each
ringplug integration to its mirror."""

_FORMAT = b"ringplug-mirror-1"  # part of the cache key: change it when the rewrite changes


class MirrorError(Exception):
    """A mirrored module has an import that cannot be rewritten (a bug in ringplug)."""


def mirror(namespace: MutableMapping[str, Any], source: str, renames: Mapping[str, str]) -> None:
    """Make the package whose globals are `namespace` the mirror of package `source`.

    Call it from the mirror package's ``__init__.py`` with ``globals()``: it executes
    `source`'s ``__init__.py``, rewritten by `renames`, in `namespace` (keeping the mirror's
    own docstring), and makes the mirror's submodules load from `source`'s files the same way.
    `source` itself is not imported.
    """
    name = namespace["__name__"]
    spec = importlib.util.find_spec(source)  # imports source's parent package, not source
    if spec is None or not spec.submodule_search_locations:
        raise MirrorError(f"{source} is not a package ringplug can mirror")
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not any(isinstance(f, _MirrorFinder) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _MirrorFinder(name, source, directory, renames))
    doc = namespace.get("__doc__")
    exec(_code(directory / "__init__.py", source, True, name, renames), namespace)  # noqa: S102
    namespace["__doc__"] = doc


class _MirrorFinder(importlib.abc.MetaPathFinder):
    """Finds ``<name>.x.y`` as ``<source>.x.y``'s file, to be loaded rewritten."""

    def __init__(self, name: str, source: str, directory: Path, renames: Mapping[str, str]) -> None:
        self.name, self.source, self.directory, self.renames = name, source, directory, renames

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith(self.name + "."):
            return None
        parts = fullname[len(self.name) + 1 :].split(".")
        base = self.directory.joinpath(*parts)
        for file, is_package in ((base / "__init__.py", True), (base.with_suffix(".py"), False)):
            if file.is_file():
                source_name = ".".join([self.source, *parts])
                loader = _MirrorLoader(file, source_name, is_package, self.name, self.renames)
                return importlib.util.spec_from_file_location(
                    fullname,
                    file,
                    loader=loader,
                    submodule_search_locations=[] if is_package else None,
                )
        return None


class _MirrorLoader(importlib.abc.Loader):
    def __init__(
        self,
        file: Path,
        source_name: str,
        is_package: bool,
        mirror_name: str,
        renames: Mapping[str, str],
    ) -> None:
        self.file, self.source_name, self.is_package = file, source_name, is_package
        self.mirror_name, self.renames = mirror_name, renames

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        code = _code(self.file, self.source_name, self.is_package, self.mirror_name, self.renames)
        exec(code, module.__dict__)  # noqa: S102


def _code(
    file: Path, source_name: str, is_package: bool, mirror_name: str, renames: Mapping[str, str]
) -> CodeType:
    """The rewritten code of `file` (module `source_name`), from a cache when one is fresh."""
    data = file.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [
                _FORMAT,
                data,
                repr(sorted(renames.items())).encode(),
                mirror_name.encode(),
                str(file).encode(),
            ]
        )
    ).digest()[:16]
    header = importlib.util.MAGIC_NUMBER + key
    caches = _cache_paths(file, mirror_name, key)
    for cache in caches:
        try:
            cached = cache.read_bytes()
            if cached.startswith(header):
                return marshal.loads(cached[len(header) :])
        except (OSError, ValueError, EOFError, TypeError):
            pass  # no cache there yet, or an unreadable one
    package = source_name if is_package else source_name.rpartition(".")[0]
    tree = ast.parse(data, str(file))
    _Renamer(file, package, renames).rename(tree)
    code = compile(tree, str(file), "exec", dont_inherit=True)
    if not sys.dont_write_bytecode:
        payload = header + marshal.dumps(code)
        any(_write_cache(cache, payload) for cache in caches)  # the first that takes it
    return code


def _cache_paths(file: Path, mirror_name: str, key: bytes) -> list[Path]:
    """Where the rewritten code may be cached: beside the original's bytecode, else (a
    read-only install) in the user's cache directory, as Python's own pycache_prefix would."""
    tag = "".join(c for c in mirror_name if c.isalnum())
    beside = Path(importlib.util.cache_from_source(str(file), optimization=tag))
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [beside, user / "ringplug" / "mirror" / f"{file.stem}.{tag}.{key.hex()}.pyc"]


def _write_cache(cache: Path, payload: bytes) -> bool:
    """Write atomically (ranks start together); False where the directory is not writable."""
    temporary = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_bytes(payload)
        os.replace(temporary, cache)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        return False


class _Renamer:
    """Rewrites the module names of import statements by `renames`, in place."""

    def __init__(self, file: Path, package: str, renames: Mapping[str, str]) -> None:
        self.file, self.package = file, package
        self.renames = sorted(renames.items(), key=lambda item: -len(item[0]))
        # What must not be imported after renaming: the top-level packages moved away from.
        self.replaced = {
            old.partition(".")[0]
            for old, new in renames.items()
            if old.partition(".")[0] != new.partition(".")[0]
        }

    def _rename(self, name: str, lineno: int) -> str:
        for old, new in self.renames:
            if name == old or name.startswith(old + "."):
                name = new + name[len(old) :]
                break
        if name.partition(".")[0] in self.replaced:
            raise MirrorError(
                f"{self.file}:{lineno}: `{name}` has no standalone counterpart in the mirror; "
                "import from a namespace the mirror renames."
            )
        return name

    def rename(self, tree: ast.Module) -> None:
        # Imports are statements: walking the statement lists alone (not every expression)
        # keeps the rewrite cheap next to the compile.
        pending: list[Any] = list(tree.body)
        while pending:
            node = pending.pop()
            if isinstance(node, ast.Import):
                self._import(node)
            elif isinstance(node, ast.ImportFrom):
                self._import_from(node)
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                pending.extend(getattr(node, field, None) or ())

    def _import(self, node: ast.Import) -> None:
        for alias in node.names:
            renamed = self._rename(alias.name, node.lineno)
            if renamed != alias.name and alias.asname is None:
                # `import a.b` binds `a`, which the code then names: renaming would break it.
                raise MirrorError(
                    f"{self.file}:{node.lineno}: `import {alias.name}` binds a name the mirror "
                    f"cannot rename; write `import {alias.name} as ...` or a from-import."
                )
            alias.name = renamed

    def _import_from(self, node: ast.ImportFrom) -> None:
        if node.module == "__future__":
            return
        module = node.module or ""
        if node.level:
            module = importlib.util.resolve_name("." * node.level + module, self.package)
        node.module, node.level = self._rename(module, node.lineno), 0
