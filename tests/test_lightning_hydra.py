"""A Hydra app in lightning-hydra-template's form under RingStrategy, both ways users start it:
``python train.py`` (the strategy starts the ranks) and ``ringrun -np 2 python train.py``.

The bar is Lightning's own DDP on the same app: one run folder with one checkpoint folder,
rank-zero logs once, and each rank knowing its rank from the script's first line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytest.importorskip("lightning")
pytest.importorskip("hydra")
pytestmark = pytest.mark.multirank

APP = str(Path(__file__).parent / "workers" / "hydra_app" / "train.py")


def run_folders(cwd: Path) -> list[Path]:
    return sorted(p for p in (cwd / "outputs").iterdir() if p.is_dir())


def rank_reports(folder: Path, ranks: int) -> list[dict]:
    return [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(ranks)]


def check_one_run(cwd: Path, output: str, ranks: int = 2) -> list[dict]:
    folders = run_folders(cwd)
    assert len(folders) == 1, (folders, output)
    reports = rank_reports(folders[0], ranks)
    for rank, report in enumerate(reports):
        assert report["rank"] == rank and report["world_size"] == ranks
        assert report["output_dir"] == str(folders[0])  # every rank writes into one folder
        assert report["cwd"] == str(cwd)  # relative paths mean what they meant to the user
        assert (
            report["checkpoints"] == reports[0]["checkpoints"]
            and "last.ckpt" in report["checkpoints"]
        )
        assert report["first_line"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(ranks),
        }
        assert not report["torchelastic_detected"]  # not taken for a torchrun job
    assert (folders[0] / "checkpoints").is_dir()
    for line in ("Instantiating datamodule", "Starting training!", "Starting testing!"):
        assert output.count(f"[rank: 0] {line}") == 1, output
    assert "[rank: 1]" not in output
    assert output.count("test/loss") == 1
    return reports


def run_app(cwd: Path, *arguments: str) -> tuple[int, str]:
    """``python train.py ARGUMENTS`` in `cwd`: its exit code and output."""
    result = subprocess.run(
        [sys.executable, APP, *arguments],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return result.returncode, result.stdout + result.stderr


def test_the_app_started_with_python_runs_its_ranks_in_its_own_run_folder(tmp_path):
    # The default run folder is outputs/<time to the second>: the ranks start a second or
    # more after this process, and would make folders of their own.
    returncode, output = run_app(tmp_path)
    assert returncode == 0, output
    reports = check_one_run(tmp_path, output)
    # The ranks replayed quietly what this process printed for rank 0 before fit.
    assert [r["rank_zero_only_at_import"] for r in reports] == [-1, -1]
    assert (run_folders(tmp_path)[0] / ".hydra" / "config.yaml").exists()


def test_the_app_under_ringrun_knows_each_rank_from_its_first_line(tmp_path):
    result = run_ringrun(
        "-np", "2", sys.executable, APP, "hydra.run.dir=outputs/one", cwd=tmp_path, timeout=300
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    reports = check_one_run(tmp_path, output)
    assert [r["rank_zero_only_at_import"] for r in reports] == [0, 1]


def test_a_multirun_sweep_that_would_start_its_own_ranks_is_refused_with_what_to_do(tmp_path):
    returncode, output = run_app(tmp_path, "--multirun", "model.lr=0.1,0.2")
    assert returncode != 0
    assert "A Hydra --multirun sweep cannot start its own ranks" in output, output
    assert "ringrun -np N python train.py --multirun" in output


def test_strategy_ring_by_name_without_ringplug_imported_gets_a_hint_from_ringrun(tmp_path):
    code = "import lightning as L\nL.Trainer(strategy='ring', accelerator='cpu', logger=False)\n"
    result = run_ringrun("-np", "2", sys.executable, "-c", code, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "invalid strategy name: `strategy='ring'`" in output
    assert "ringrun: hint: Lightning did not know strategy='ring'" in output
    assert "`strategy: {_target_: ringplug.lightning.RingStrategy}`" in output
