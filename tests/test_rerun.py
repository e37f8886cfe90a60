"""The self-launch's ranks: how they run the script and the command line the launching
process gives them (`ringplug.run.launch.rerun`); ringrun's hints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ringplug.run.launch.hints import CLASS_PATH_AS_NAME, RING_NOT_REGISTERED, hint_for
from ringplug.run.launch.rerun import _hydra_arguments, rank_command, split_command

SCRIPT = """\
import json, os, sys
from lightning_utilities.core.rank_zero import rank_zero_only
from ringplug.run.launch import rerun
before = rank_zero_only.rank
rerun.end_replay(1)
print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0],
                  "file": __file__, "before": before, "after": rank_zero_only.rank,
                  "replaying": rerun.replaying()}))
"""


def rerun(*args: str, cwd: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "ringplug.run.launch.rerun", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_a_script_runs_as_python_would_run_it_replaying_quietly_until_the_ring_starts(tmp_path):
    pytest.importorskip("lightning_utilities")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "train.py").write_text(SCRIPT)
    seen = rerun("app/train.py", "trainer=ring", "--flag", cwd=tmp_path)
    assert seen["name"] == "__main__"
    assert seen["argv"] == ["app/train.py", "trainer=ring", "--flag"]
    assert seen["path0"] == str(tmp_path / "app")  # the script's folder, as `python SCRIPT`
    assert seen["file"] == "app/train.py"
    assert seen["before"] == -1  # no rank is rank zero while replaying
    assert (seen["after"], seen["replaying"]) == (1, False)


def test_a_module_runs_as_python_dash_m_would_run_it(tmp_path):
    pytest.importorskip("lightning_utilities")
    (tmp_path / "trainpkg").mkdir()
    (tmp_path / "trainpkg" / "__init__.py").write_text("")
    (tmp_path / "trainpkg" / "main.py").write_text(SCRIPT)
    seen = rerun("-m", "trainpkg.main", "x=1", cwd=tmp_path)
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(tmp_path / "trainpkg" / "main.py"), "x=1"]
    assert seen["path0"] == str(tmp_path)


@pytest.mark.parametrize(
    ("orig_argv", "argv", "expected"),
    [
        (["py", "train.py", "a=1"], ["train.py", "a=1"], (["py"], ["train.py", "a=1"])),
        (["py", "-u", "-X", "dev", "t.py"], ["t.py"], (["py", "-u", "-X", "dev"], ["t.py"])),
        (
            ["py", "-m", "pkg.train", "a"],
            ["/abs/pkg/train.py", "a"],
            (["py"], ["-m", "pkg.train", "a"]),
        ),
        (["py", "-c", "code", "a"], ["-c", "a"], (["py"], ["-c", "code", "a"])),
        (["py", "-um", "pkg.train"], ["/abs/pkg/train.py"], None),  # joined options: as it is
    ],
)
def test_the_ranks_command_line_keeps_the_interpreters_options_and_the_program(
    monkeypatch, orig_argv, argv, expected
):
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    monkeypatch.setattr(sys, "argv", argv)
    assert split_command() == expected
    command, cwd = rank_command()  # not a Hydra app: the ranks start where this one did
    if expected is None:
        assert (command, cwd) == (orig_argv, None)
    else:
        assert (command, cwd) == (
            [*expected[0], "-m", "ringplug.run.launch.rerun", *expected[1]],
            None,
        )


def test_hydra_arguments_keep_config_options_and_drop_multirun():
    arguments = ["-cn", "train", "--config-dir=extra", "trainer=ring", "-m", "seed=1"]
    assert _hydra_arguments(arguments) == (
        ["-cn", "train", "--config-dir=extra"],
        ["trainer=ring", "seed=1"],
    )


def test_only_lightnings_unknown_ring_strategy_gets_the_hint():
    line = "ValueError: You selected an invalid strategy name: `strategy='ring'`. It must be ..."
    assert hint_for(line) == RING_NOT_REGISTERED
    assert (
        hint_for("ValueError: You selected an invalid strategy name: `strategy='rings'`.") is None
    )
    assert hint_for("strategy='ring' trained for 3 epochs") is None
    # LightningCLI's --trainer.strategy=ringplug.lightning.RingStrategy, lowercased by Lightning
    named = "invalid strategy name: `strategy='ringplug.lightning.ringstrategy'`. It must be"
    assert hint_for(named) == CLASS_PATH_AS_NAME
