"""Guarded changes to a framework's own functions: each names what it wraps, checks that the
name is there before wrapping it, and says what ringplug does without it.

A framework release that renames an internal must not turn into an ``AttributeError`` in the
middle of a fit: `wrap` warns once, naming the missing attribute, the installed version and
the documented fallback, and leaves the framework as it is. Every framework's patches live
in one module of ringplug's (`ringplug.lightning.patches`, `ringplug.fabric.patches`,
`ringplug.keras.patches`), each with a ``targets()`` function listing what it may wrap, so
that a test asserts that each name still exists in the versions CI installs
(tests/test_patches.py).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from types import MethodType, ModuleType
from typing import Any

_warned: set[str] = set()


def label(owner: Any) -> str:
    """``module.Class`` or ``module`` of `owner`, a class, a module or an instance."""
    if isinstance(owner, ModuleType):
        return owner.__name__
    cls = owner if isinstance(owner, type) else type(owner)
    return f"{cls.__module__}.{cls.__qualname__}"


def missing(owner: Any, name: str, *, version: str, fallback: str, quiet: bool = False) -> bool:
    """Whether ``owner.name`` is missing; if so, warn once (unless `quiet`), saying what
    ringplug does without it."""
    if callable(getattr(owner, name, None)):
        return False
    where = f"{label(owner)}.{name}"
    if not quiet and where not in _warned:
        _warned.add(where)
        warnings.warn(
            f"ringplug: {version} has no {where}, which ringplug wraps; {fallback}. "
            "Install a version that ringplug supports (see its README) or report this.",
            RuntimeWarning,
            stacklevel=3,
        )
    return True


def wrap(
    owner: Any,
    name: str,
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
    *,
    version: str,
    fallback: str,
    again: bool = False,
    quiet: bool = False,
) -> bool:
    """Replace ``owner.name`` (a class's, a module's or an instance's) by ``make(original)``.

    Args:
        owner: the class, module or object that holds the function.
        name: the attribute to wrap.
        make: builds the replacement from the original function.
        version: the framework's name and version, for the warning.
        fallback: what ringplug does when the attribute is missing (said in the warning).
        again: if ringplug wrapped it already, wrap the original anew (an instance patched
            for an earlier fit, now for another strategy); else leave the earlier wrap.
        quiet: a missing attribute is an expected difference between versions, and the
            fallback needs no warning.

    Returns:
        Whether the attribute was there (and is now wrapped).
    """
    if missing(owner, name, version=version, fallback=fallback, quiet=quiet):
        return False
    original = getattr(owner, name)
    if not isinstance(owner, (type, ModuleType)):
        # An instance: only a wrap set on the instance itself is this one's (its bound
        # method may be a wrap of the class's, which is the behaviour to wrap).
        ours = vars(owner).get(name)
        original = ours if ours is not None else original
    if getattr(original, "_ringplug_wrapped", False) and not isinstance(original, MethodType):
        if not again:
            return True
        original = original.__wrapped__  # functools.wraps kept the framework's own
    replacement = functools.wraps(original)(make(original))
    replacement._ringplug_wrapped = True  # type: ignore[attr-defined]
    setattr(owner, name, replacement)
    return True


def absent(targets: Iterable[tuple[Any, str]]) -> list[str]:
    """Those of `targets` (owner, attribute) that the installed framework lacks."""
    return [
        f"{label(owner)}.{name}"
        for owner, name in targets
        if not callable(getattr(owner, name, None))
    ]
