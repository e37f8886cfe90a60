"""Guarded changes to a framework's own functions: each names what it wraps, checks that the
name is there before wrapping it, and says what ringplug does without it.

A framework release that renames an internal must not turn into an ``AttributeError`` in the
middle of a fit: `wrap` warns once, naming the missing attribute, the installed version and
the documented fallback, and leaves the framework as it is. `applied` lists every wrap that
was asked for, so a test can assert that each wrapped name still exists in the versions CI
installs (tests/test_patches.py).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Wrapped:
    """One wrap of ``owner.name``: done (`found`) or skipped, and what ringplug does then."""

    owner: str
    name: str
    found: bool
    fallback: str


applied: list[Wrapped] = []
"""Every wrap asked for in this process, in order."""


def wrap(
    owner: Any,
    name: str,
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
    *,
    version: str,
    fallback: str,
) -> bool:
    """Replace ``owner.name`` by ``make(original)``, once, if `owner` has it.

    Args:
        owner: the class or module that holds the function.
        name: the attribute to wrap.
        make: builds the replacement from the original function.
        version: the framework's name and version, for the warning.
        fallback: what ringplug does when the attribute is missing (said in the warning).

    Returns:
        Whether the attribute was there (and is now wrapped).
    """
    label = f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', owner)}"
    original = getattr(owner, name, None)
    found = callable(original)
    applied.append(Wrapped(label, name, found, fallback))
    if not found:
        warnings.warn(
            f"ringplug: {version} has no {label}.{name}, which ringplug wraps; {fallback}. "
            "Install a version that ringplug supports (see its README) or report this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    if getattr(original, "_ringplug_wrapped", False):
        return True  # a second import of the same integration
    replacement = functools.wraps(original)(make(original))
    replacement._ringplug_wrapped = True  # type: ignore[attr-defined]
    setattr(owner, name, replacement)
    return True
