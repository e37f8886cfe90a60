"""A chaos run in the suite: an elastic job loses a random rank at a random step.

One run of tests/measure_chaos.py (which runs 20 in a row): a Lightning fit or a
Horovod-style elastic torch training on 3 ranks under ``ringrun --max-restarts 2 --min-np 2``,
whose victim rank and step are drawn from a seed taken from the clock, so each run of the
suite kills somewhere else. The seed is in the failure message; ``python
tests/measure_chaos.py --runs 1 --seed SEED --kind KIND`` repeats the run.
"""

from __future__ import annotations

import random
import time

import pytest

from launch import processes_matching, unique_marker
from measure_chaos import KINDS, draw, run_chaos

pytest.importorskip("torch")


@pytest.mark.multirank
def test_a_rank_killed_at_a_random_step_costs_only_the_steps_since_the_last_commit(tmp_path):
    seed = time.time_ns() % 1_000_000
    rng = random.Random(seed)
    kind = KINDS[rng.randrange(len(KINDS))]
    if kind == "lightning":
        pytest.importorskip("lightning")
    chaos = draw(rng, kind)
    marker = unique_marker("chaos")
    verdict, output = run_chaos(chaos, tmp_path, marker)
    repeat = f"python tests/measure_chaos.py --runs 1 --kind {kind} --rank {chaos.rank} " + (
        f"--step {chaos.step}"
    )
    assert verdict.problems == [], (
        f"seed {seed}: {chaos.describe()}: {verdict.problems} (repeat: {repeat})\n{output[-4000:]}"
    )
    assert processes_matching(marker) == [], "ranks were left running"
