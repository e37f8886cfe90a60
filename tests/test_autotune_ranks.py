"""Autotune on real ranks: 2 ranks train with ringplug.torch's DistributedOptimizer under
``ringrun --autotune`` (tests/workers/autotune.py), starting from a bad setting, and again
without autotune; one more job shows the ranks refusing autotune with a fixed setting, and
Lightning's and Keras's entry points are shown to take the setting from the environment."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launch import run_ringrun

WORKER = Path(__file__).parent / "workers" / "autotune.py"
BAD_START = ("65536", "0.02")  # 64 KiB, 20 ms
JOB_TIMEOUT_S = 180
# Every bucket through the algorithm table (none carried in the negotiation), and the fixed
# table (MPI's allreduce below 1 MiB, the ring from there on), in both jobs: the tuned job
# tries the others on the sizes of its buffers (about 100 KiB a step fused whole).
JOB_ENV = {"RINGPLUG_EAGER_THRESHOLD": "0", "RINGPLUG_CALIBRATION": "fixed"}
MIB = 1 << 20


def expected_algorithm(bands: list[list], nbytes: int) -> str:
    """The allreduce algorithm of `nbytes` bytes under the fixed table with `bands` (as the
    worker reports them: [algorithm, start, end or None]) laid over it."""
    for algorithm, start, end in bands:
        if start <= nbytes and (end is None or nbytes < end):
            return algorithm
    return "mpi" if nbytes < MIB else "ring"


def check_bands_taken(report: dict) -> set[tuple]:
    """Check that at each step's start the transport took, for every probed size, the
    algorithm of the bands the engine had applied (and the fixed table's elsewhere); return
    the bands every applied setting held, as tuples."""
    for step in report["steps"][1:]:
        bands = step["before"][2]
        assert step["taken"] == [expected_algorithm(bands, n) for n in report["probes"]], step
    return {tuple(band) for _, _, _, bands in report["applied"] for band in bands}


def _job(
    outdir: Path, *flags: str, start: tuple[str, ...] = (), ranks: int = 2, env=None
) -> list[dict]:
    outdir.mkdir(exist_ok=True)
    result = run_ringrun(
        "-np",
        str(ranks),
        *flags,
        sys.executable,
        str(WORKER),
        str(outdir),
        *start,
        extra_env={**JOB_ENV, **(env or {})},
        timeout=JOB_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return [json.loads((outdir / f"rank-{rank}.json").read_text()) for rank in range(ranks)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """(the tuned job's reports, its trial log, the untuned job's reports)."""
    tuned_dir = tmp_path_factory.mktemp("autotune-on")
    log = tuned_dir / "trials.csv"
    tuned = _job(
        tuned_dir,
        "--autotune",
        "--autotune-log-file",
        str(log),
        "--autotune-warmup-samples",
        "1",
        "--autotune-steps-per-sample",
        "2",
        "--autotune-bayes-opt-max-samples",
        "24",
        start=BAD_START,
    )
    plain = _job(tmp_path_factory.mktemp("autotune-off"))
    return tuned, log, plain


@pytest.mark.multirank
def test_every_rank_applies_the_same_settings_at_the_same_cycles(jobs):
    tuned, _, _ = jobs
    rank_0, rank_1 = tuned
    assert rank_0["tuned"] and rank_0["done"]
    assert len(rank_0["applied"]) >= 3
    # the same fusion thresholds, cycle times and allreduce bands, at the same cycles
    assert rank_0["applied"] == rank_1["applied"]
    # and each step ran with the same setting on both ranks
    assert [s["before"] for s in rank_0["steps"]] == [s["before"] for s in rank_1["steps"]]
    assert rank_0["final"] == rank_1["final"]


@pytest.mark.multirank
def test_every_rank_tries_the_same_bands_and_its_transport_takes_them(jobs):
    tuned, log, _ = jobs
    tried = [check_bands_taken(report) for report in tuned]
    assert tried[0] == tried[1]
    assert tuned[0]["offered"] == ["mpi", "doubling", "ring"]  # one host: no hierarchical
    # the step's buffers are under 1 MiB, where the fixed table takes MPI's: the other two
    # are tried there, on one range around the buffers' sizes, and never above 1 MiB
    assert {algorithm for algorithm, _, _ in tried[0]} == {"doubling", "ring"}
    assert len({(start, end) for _, start, end in tried[0]}) == 1
    assert all(0 < start < end <= MIB for _, start, end in tried[0])
    with open(log, newline="") as handle:
        rows = list(csv.DictReader(handle))
    logged = {(row["allreduce_algorithm"], row["allreduce_crossovers"]) for row in rows}
    assert ("table", "mpi<1M<ring") in logged
    assert {text.split("@")[0] for text, _ in logged} == {"table", "doubling", "ring"}


@pytest.mark.multirank
def test_on_ranks_of_two_hosts_the_hierarchical_allreduce_is_tried_too(tmp_path):
    # 4 ranks, 2 to a pretend host: the hierarchical allreduce is a candidate; every rank
    # forces the same algorithms at the same cycles, its transport takes them, and the
    # weights are those of the same job untuned (up to the order of additions).
    hosts = {"RINGPLUG_TEST_RANKS_PER_HOST": "2"}
    tuned = _job(
        tmp_path / "tuned",
        "--autotune",
        *("--autotune-warmup-samples", "1", "--autotune-steps-per-sample", "2"),
        *("--autotune-bayes-opt-max-samples", "30"),
        start=BAD_START,
        ranks=4,
        env=hosts,
    )
    plain = _job(tmp_path / "plain", ranks=4, env=hosts)
    assert tuned[0]["offered"] == ["mpi", "doubling", "ring", "hierarchical"]
    # every rank applied the same bands at the same cycles, and its transport took them
    assert all(report["applied"] == tuned[0]["applied"] for report in tuned)
    tried = [check_bands_taken(report) for report in tuned]
    assert all(bands == tried[0] for bands in tried)
    assert {algorithm for algorithm, _, _ in tried[0]} == {"doubling", "ring", "hierarchical"}
    assert all(0 < start < end <= MIB for _, start, end in tried[0])
    for report in tuned:
        # the ranks trained alike
        np.testing.assert_array_equal(report["parameters"][0], tuned[0]["parameters"][0])
    for tuned_p, plain_p in zip(tuned[0]["parameters"], plain[0]["parameters"], strict=True):
        np.testing.assert_allclose(tuned_p, plain_p, rtol=1e-6, atol=1e-7)


@pytest.mark.multirank
def test_tuning_moves_off_the_bad_start_and_ends_within_its_budget(jobs):
    tuned, _, _ = jobs
    report = tuned[0]
    settings_seen = [tuple(s["before"]) for s in report["steps"]]
    assert settings_seen[1][:2] == (65536, 0.02)  # the start the worker gave
    assert settings_seen[1][2] == []  # ... with the table's choice at every size
    assert settings_seen[-1][:2] != (65536, 0.02)  # 20 ms a cycle is never the best
    last_cycle, fusion, cycle_ms, bands = report["applied"][-1]
    assert tuple(report["final"]) == (fusion, cycle_ms * 1e-3, bands)
    # (1 warm-up + at most 24 scored samples) x 2 steps each
    assert report["tuning_steps"] <= 50
    # once done, the setting stays
    assert len({repr(s) for s in settings_seen[report["tuning_steps"] + 3 :]}) == 1


@pytest.mark.multirank
def test_the_trial_log_lists_each_scored_setting_in_the_order_applied(jobs):
    tuned, log, _ = jobs
    with open(log, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == [
        "sample",
        "fusion_threshold",
        "cycle_time_ms",
        "allreduce_algorithm",
        "allreduce_crossovers",
        "score",
        "best_score",
        "converged",
        "steps",
    ]

    def text(bands: list[list]) -> str:
        """The log's form of a setting's bands, written out: ``ring@[64K,128K)``."""
        return " ".join(
            f"{a}@[{s >> 10}K,{'inf' if e is None else f'{e >> 10}K'})" for a, s, e in bands
        )

    tried = [
        (int(r["fusion_threshold"]), float(r["cycle_time_ms"]), r["allreduce_algorithm"])
        for r in rows
    ]
    applied = [(f, c, text(bands) or "table") for _, f, c, bands in tuned[0]["applied"]]
    # the start is scored first; each later row is the setting applied before it
    assert tried[0] == (65536, 20.0, "table")
    assert tried[1:] == applied[: len(tried) - 1]
    assert [r["converged"] for r in rows] == ["0"] * (len(rows) - 1) + ["1"]
    assert all(float(r["score"]) > 0 for r in rows)


@pytest.mark.multirank
def test_results_equal_a_run_without_autotune(jobs):
    tuned, _, plain = jobs
    assert not plain[0]["tuned"]
    for with_tuning, without in zip(tuned, plain, strict=True):
        for tuned_p, plain_p in zip(with_tuning["parameters"], without["parameters"], strict=True):
            np.testing.assert_allclose(tuned_p, plain_p, rtol=1e-6, atol=1e-7)
    # the ranks trained alike
    np.testing.assert_array_equal(tuned[0]["parameters"][0], tuned[1]["parameters"][0])


@pytest.mark.multirank
def test_every_rank_refuses_autotune_with_a_fixed_setting_from_its_environment():
    # Through the environment ringrun passes on, which ringrun does not read itself.
    program = (
        "import ringplug\n"
        "try:\n"
        "    ringplug.init()\n"
        "except ValueError as e:\n"
        "    print('refused:', e, flush=True)\n"
    )
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        "-c",
        program,
        extra_env={"RINGPLUG_AUTOTUNE": "1", "RINGPLUG_FUSION_THRESHOLD": "8M"},
        timeout=60,
    )
    lines = [line for line in result.stdout.splitlines() if "refused:" in line]
    assert sorted(line[:3] for line in lines) == ["[0]", "[1]"], result.stdout + result.stderr
    for line in lines:
        assert "RINGPLUG_FUSION_THRESHOLD=8M is fixed too" in line
        assert "Drop the fixed value" in line


LIGHTNING_FIT = """
import lightning as L, torch
from ringplug.lightning import RingStrategy
from ringplug.core import runtime

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, _):
        return self.net(batch[0]).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = torch.utils.data.TensorDataset(torch.randn(8, 4))
trainer = L.Trainer(strategy=RingStrategy(), accelerator="cpu", devices=1, max_steps=2,
    logger=False, enable_progress_bar=False, enable_model_summary=False,
    enable_checkpointing=False)
trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=4))
engine = runtime.engine()
print("tuner", engine.tuner is not None, engine.tuner.max_samples)
"""

KERAS_INIT = """
import ringplug.keras as rk
from ringplug.core import runtime
rk.init()
engine = runtime.engine()
print("tuner", engine.tuner is not None, engine.tuner.max_samples)
"""


def test_lightning_and_keras_take_autotune_from_the_environment():
    # Neither takes the fusion threshold or the cycle time as an argument; all read the
    # RINGPLUG_* settings at init, autotune's with them. One process each, at once.
    env = {
        **os.environ,
        "RINGPLUG_AUTOTUNE": "1",
        "RINGPLUG_AUTOTUNE_MAX_SAMPLES": "5",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    started = [
        subprocess.Popen(
            [sys.executable, "-c", program],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for program in (LIGHTNING_FIT, KERAS_INIT)
    ]
    for process in started:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-3000:]
        assert out.splitlines()[-1] == "tuner True 5", out + err[-3000:]
