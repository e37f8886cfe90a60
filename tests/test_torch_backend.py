"""torch.distributed on the ``ringplug`` backend, on real ranks started by ringrun."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytest.importorskip("torch")
pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "torch_backend.py")


def run(scenario: str, ranks: int, outdir: Path, **kwargs) -> list[dict]:
    result = run_ringrun("-np", str(ranks), sys.executable, WORKER, scenario, str(outdir),
                         timeout=180, **kwargs)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    reports = [json.loads((outdir / f"{scenario}-{r}.json").read_text()) for r in range(ranks)]
    for report in reports:
        assert [name for name, ok in report["checks"].items() if not ok] == [], report
    return reports


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_torch_distributed_call_gives_the_reference_on_every_rank(tmp_path, ranks):
    reports = run("calls", ranks, tmp_path)
    assert len(reports[0]["checks"]) == 61 + 2 * ranks  # broadcast and reduce from each root
    assert all(r["checks"].keys() == reports[0]["checks"].keys() for r in reports)


@pytest.mark.parametrize("ranks", [2, 3])
def test_ddp_on_the_backend_equals_one_process_with_the_whole_batch(tmp_path, ranks):
    reports = run("ddp", ranks, tmp_path)
    assert set(reports[0]["checks"]) == {"ddp/equals-one-process", "ddp/ranks-bitwise-identical"}


def test_torchmetrics_syncs_over_the_backend(tmp_path):
    pytest.importorskip("torchmetrics")
    reports = run("torchmetrics", 2, tmp_path)
    assert set(reports[0]["checks"]) == {"torchmetrics/mean", "torchmetrics/accuracy"}
