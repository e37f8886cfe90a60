"""Write docs/configuration.md's tables of the RINGPLUG_* settings from their declarations.

    python tools/settings_table.py            # rewrite the page's generated part
    python tools/settings_table.py --print    # print the tables instead

The declarations are in src/ringplug/config.py; tests/test_config.py fails when the
page and they differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"


def main(argv: list[str]) -> int:
    """Rewrite the page (or with ``--print``, print the tables); 2 for other arguments."""
    sys.path.insert(0, str(ROOT / "src"))
    from ringplug import config

    if argv == ["--print"]:
        sys.stdout.write(config.markdown())
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    PAGE.write_text(config.rewrite(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
