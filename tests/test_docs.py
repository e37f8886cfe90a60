"""The docs: the README stays an entrance, the site builds without a warning, every page is
in the navigation, and the ringrun command lines shown use flags ringrun has.

The site build needs mkdocs, mkdocs-material and mkdocstrings-python (the dev extra).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 400


def doc_pages() -> list[str]:
    """Every Markdown page under docs/, relative to it."""
    return sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))


def nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav names, in order."""
    yaml = pytest.importorskip("yaml")

    class Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml names a Python function for the toc's slugs; only the nav matters here.
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)

    def walk(entries):
        for entry in entries:
            if isinstance(entry, str):
                yield entry
            elif isinstance(entry, dict):
                for value in entry.values():
                    yield from [value] if isinstance(value, str) else walk(value)

    return list(walk(config["nav"]))


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def code_blocks(text: str) -> list[str]:
    """The fenced code blocks of a Markdown text."""
    return re.findall(r"^ *```[^\n]*\n(.*?)^ *```", text, flags=re.MULTILINE | re.DOTALL)


def ringrun_lines(block: str) -> list[str]:
    """The ringrun command lines in a code block (continuation lines joined), from
    `ringrun` on: after a shell prompt, variables (`NCCL_DEBUG=INFO ringrun ...`) or
    `srun --ntasks=1`, not in ringrun's own output that names a command."""
    lines = block.replace("\\\n", " ").splitlines()
    found = []
    for line in lines:
        words = line.strip().removeprefix("$ ").split()
        if "ringrun" not in words:
            continue
        before = words[: words.index("ringrun")]
        variables = all(re.match(r"[A-Z_][A-Z0-9_]*=", word) for word in before)
        srun = before[:1] == ["srun"] and all(word.startswith("-") for word in before[1:])
        if variables or srun:
            found.append(" ".join(words[len(before) :]))
    return found


def test_the_readme_is_an_entrance_of_at_most_400_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move the details to "
        "a page under docs/ and link to it"
    )
    headings = {line.lstrip("# ").strip() for line in lines if line.startswith("## ")}
    assert {"Quick start", "Install", "When a node dies"} <= headings


def test_every_page_in_the_nav_exists_and_every_page_is_in_the_nav():
    nav = nav_pages()
    pages = doc_pages()
    missing = [page for page in nav if not (DOCS / page).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"
    left_out = sorted(set(pages) - set(nav))
    assert not left_out, f"pages under docs/ that mkdocs.yml's nav leaves out: {left_out}"
    assert len(nav) == len(set(nav)), "a page appears twice in mkdocs.yml's nav"


def test_the_readmes_links_reach_pages_and_headings_that_exist():
    slugify = pytest.importorskip("pymdownx.slugs").slugify(case="lower")
    readme = (ROOT / "README.md").read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else ROOT / "README.md"
        if not file.is_file():
            broken.append(target)
            continue
        if anchor:
            text = re.sub(r"^ *```.*?^ *```", "", file.read_text(), flags=re.MULTILINE | re.DOTALL)
            titles = re.findall(r"^#+ (.*)$", text, flags=re.MULTILINE)
            if anchor not in {slugify(title.replace("`", ""), "-") for title in titles}:
                broken.append(target)
    assert not broken, f"README.md links to pages or headings that do not exist: {broken}"


def test_ringrun_command_lines_in_the_readme_and_docs_use_flags_ringrun_has():
    from ringplug.run.cli import build_parser

    options = build_parser()._option_string_actions
    unknown = []
    for file in markdown_files():
        for block in code_blocks(file.read_text()):
            for line in ringrun_lines(block):
                try:
                    words = shlex.split(line, comments=True)[1:]
                except ValueError:  # an unclosed quote in an example: nothing to check
                    continue
                while words and words[0].startswith("-") and words[0] != "--":
                    flag, inline, _ = words.pop(0).partition("=")
                    action = options.get(flag)
                    if action is None:
                        unknown.append(f"{file.relative_to(ROOT)}: {flag} in `{line}`")
                        break
                    if not inline and action.nargs not in (0, "?") and words:
                        words.pop(0)  # the flag's value
    assert not unknown, "ringrun flags that do not exist:\n" + "\n".join(unknown)


def test_the_site_builds_without_a_warning(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert result.returncode == 0, "mkdocs build --strict failed:\n" + (
        "\n".join(warnings) or result.stderr
    )
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "ringplug" / "index.html").is_file()
