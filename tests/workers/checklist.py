"""What the Horovod-style workers share: named checks that record a failure (with its
traceback) instead of stopping the worker, so one broken call does not hide the others."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any


def checker(checks: dict[str, bool]) -> Callable[[str, Callable[[], Any]], None]:
    """``check(name, fn)``: ``checks[name]`` is whether ``fn()`` returned a true value."""

    def check(name: str, fn: Callable[[], Any]) -> None:
        try:
            checks[name] = bool(fn())
        except Exception:  # noqa: BLE001 - recorded as a failed check, with the traceback
            traceback.print_exc()
            checks[name] = False

    return check


def raises(call: Callable[[], Any], error: type[BaseException], words: str) -> bool:
    """Whether ``call()`` raises `error` with `words` in its message; what it did instead
    goes to stderr, so a failed check says what it saw."""
    try:
        returned = call()
    except error as exc:
        if words in str(exc):
            return True
        print(f"expected {error.__name__} saying {words!r}, got: {exc!r}", file=sys.stderr)
        return False
    except Exception as exc:  # noqa: BLE001 - reported, then the check fails
        print(f"expected {error.__name__} saying {words!r}, got: {exc!r}", file=sys.stderr)
        return False
    print(f"expected {error.__name__} saying {words!r}, returned: {returned!r}", file=sys.stderr)
    return False
