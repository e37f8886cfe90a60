"""ringplug.torch's differentiable collectives on real ranks: each gradient is the sum of
every rank's gradient reaching that input; grouped allgather and reducescatter, scale
factors, a handle over several requests, and `Compression` (one ringrun job)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytest.importorskip("torch")
pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "torch_autograd.py")
EXPECTED = {
    "allreduce-sum-scaled-grad",
    "allreduce-average-grad",
    "grouped-allreduce-grad",
    "broadcast-grad",
    "broadcast-async-new-tensor",
    "grouped-allgather",
    "grouped-allgather-grad",
    "grouped-allgather-async",
    "reducescatter-scaled",
    "reducescatter-average-grad",
    "grouped-reducescatter",
    "grouped-reducescatter-async",
    "alltoall-grad",
    "alltoall-float-splits-refused",
    "handle-over-several",
    "compression-fp16",
    "still-in-step",
}


@pytest.mark.parametrize("ranks", [2, 3])
def test_collective_gradients_sum_what_every_rank_sends_back(tmp_path, ranks):
    result = run_ringrun("-np", str(ranks), sys.executable, WORKER, str(tmp_path), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(ranks):
        checks = json.loads((tmp_path / f"autograd-{rank}.json").read_text())
        assert set(checks) == EXPECTED
        assert [name for name, ok in checks.items() if not ok] == []


def test_compression_is_one_definition_that_equals_its_value():
    torch = pytest.importorskip("torch")
    import ringplug.horovod.torch as hvd
    import ringplug.torch as rpt
    from ringplug.compression import Compression
    from ringplug.torch.optimizer import Compression as OptimizerCompression

    assert rpt.Compression is hvd.Compression is OptimizerCompression is Compression
    assert Compression.fp16 == "fp16" and Compression("none") is Compression.none
    sent, ctx = Compression.none.compress(torch.ones(2))
    assert sent.dtype == torch.float32 and ctx is None
    numpy = pytest.importorskip("numpy")
    half, dtype = Compression.fp16.compress(numpy.ones(2))
    assert half.dtype == numpy.float16 and Compression.fp16.decompress(half, dtype).dtype == dtype
