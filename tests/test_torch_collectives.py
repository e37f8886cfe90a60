"""ringplug.torch on real ranks: every dtype, in place and not, async, autograd, state."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytest.importorskip("torch")
pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "torch_collectives.py")
EXPECTED = {
    *(
        f"allreduce/torch.{d}"
        for d in (
            "float16",
            "bfloat16",
            "float32",
            "float64",
            "int8",
            "int16",
            "int32",
            "int64",
            "uint8",
            "bool",
        )
    ),
    *(
        f"allreduce_/torch.{d}"
        for d in (
            "float16",
            "bfloat16",
            "float32",
            "float64",
            "int8",
            "int16",
            "int32",
            "int64",
            "uint8",
            "bool",
        )
    ),
    "allreduce_/non-contiguous-average",
    *(f"integer-average/torch.{d}" for d in ("int8", "int32", "int64")),
    "integer-scaled-sum-in-place",
    "integer-average-grouped",
    "integer-average-reducescatter",
    "sparse-allreduce/sum",
    "sparse-allreduce/average",
    "sparse-in-place-refused",
    "sparse-max-refused",
    "sparse-still-in-step",
    "allreduce_async",
    "broadcast_/bfloat16",
    "allgather/uneven",
    "allgather/gradient",
    "reducescatter",
    "alltoall",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "unsupported-dtype-error",
    "bad-dtype-on-one-rank",
    "still-in-step",
    *(
        f"sync_batchnorm/{c}"
        for c in (
            "output",
            "input-gradient",
            "parameter-gradients",
            "running-stats",
            "eval",
            "revert",
            "too-few-values",
        )
    ),
}


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_torch_collective_gives_the_reference_on_every_rank(tmp_path, ranks):
    result = run_ringrun("-np", str(ranks), sys.executable, WORKER, str(tmp_path), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(ranks):
        checks = json.loads((tmp_path / f"torch-{rank}.json").read_text())
        assert set(checks) == EXPECTED
        assert [name for name, ok in checks.items() if not ok] == []
