"""Multi-rank worker: ringplug.torch on CPU tensors, against references computed here.

``python torch_collectives.py OUTDIR``; each rank writes OUTDIR/torch-<rank>.json with a
boolean per check (and details for failures).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

import ringplug
import ringplug.torch as rpt

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def seeded(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    values = torch.randint(0, 2 if dtype is torch.bool else 20, shape, generator=generator)
    return values.to(dtype)


def main(outdir: Path) -> None:
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    checks: dict[str, bool] = {}

    for salt, dtype in enumerate(DTYPES):
        inputs = [seeded(r, (3, 5), dtype, salt) for r in range(size)]
        op = "max" if dtype is torch.bool else "sum"
        expected = (
            torch.stack([i.to(torch.float64) for i in inputs]).amax(0)
            if op == "max"
            else sum(i.to(torch.float64) for i in inputs)
        )
        mine = inputs[rank].clone()
        out = rpt.allreduce(mine, op=op)
        checks[f"allreduce/{dtype}"] = (
            out.dtype == dtype
            and torch.equal(out.to(torch.float64), expected)
            and torch.equal(mine, inputs[rank])  # the input is left alone
        )
        in_place = inputs[rank].clone()
        returned = rpt.allreduce_(in_place, op=op)
        checks[f"allreduce_/{dtype}"] = returned is in_place and torch.equal(
            in_place.to(torch.float64), expected
        )

    base = seeded(rank, (6, 4), torch.float32, 50)
    strided = base.t()  # not contiguous
    expected = sum(seeded(r, (6, 4), torch.float32, 50) for r in range(size)).t() / size
    rpt.allreduce_(strided)
    checks["allreduce_/non-contiguous-average"] = torch.allclose(strided, expected)

    handles = [
        rpt.allreduce_async(torch.full((4,), float(rank + i)), op="sum", name=f"h{i}")
        for i in range(5)
    ]
    results = [h.wait() for h in handles]
    checks["allreduce_async"] = all(
        torch.equal(r, torch.full((4,), float(sum(q + i for q in range(size)))))
        for i, r in enumerate(results)
    )

    checks.update(integer_scaling_checks(rank, size))
    checks.update(sparse_checks(rank, size))

    root_value = seeded(size - 1, (2, 3), torch.bfloat16, 60)
    buf = seeded(rank, (2, 3), torch.bfloat16, 60)
    rpt.broadcast_(buf, root_rank=size - 1)
    checks["broadcast_/bfloat16"] = torch.equal(buf, root_value)

    parts = [seeded(r, (r + 1, 2), torch.float32, 70) for r in range(size)]
    gathered = rpt.allgather(parts[rank])
    checks["allgather/uneven"] = torch.equal(gathered, torch.cat(parts))

    leaf = torch.full((rank + 1, 2), float(rank + 1), requires_grad=True)
    together = rpt.allgather(leaf)
    weights = torch.arange(together.numel(), dtype=torch.float32).reshape(together.shape)
    (together * weights).sum().backward()
    start = sum(r + 1 for r in range(rank))
    # Every rank computed the same loss over the same gathered rows, so the summed gradient
    # of this rank's rows is size x the weights of those rows.
    checks["allgather/gradient"] = torch.equal(leaf.grad, size * weights[start : start + rank + 1])

    block = rpt.reducescatter(torch.arange(8.0).reshape(4, 2) * (rank + 1), op="sum")
    full = torch.arange(8.0).reshape(4, 2) * sum(r + 1 for r in range(size))
    base, extra = divmod(4, size)  # earlier ranks get one row more
    start = rank * base + min(rank, extra)
    checks["reducescatter"] = torch.equal(block, full[start : start + base + (rank < extra)])

    received, counts = rpt.alltoall(torch.arange(size * 2) + 100 * rank)
    checks["alltoall"] = counts.tolist() == [2] * size and received.tolist() == [
        v for s in range(size) for v in (100 * s + 2 * rank, 100 * s + 2 * rank + 1)
    ]

    torch.manual_seed(rank)  # a different initialisation on every rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    rpt.broadcast_parameters(model.state_dict(), root_rank=0)
    flat = torch.cat([t.detach().reshape(-1).float() for t in model.state_dict().values()])
    everyone = rpt.allgather(flat.unsqueeze(0))
    checks["broadcast_parameters"] = all(torch.equal(row, everyone[0]) for row in everyone)

    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    if rank == 0:  # only root has state
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
    rpt.broadcast_optimizer_state(optimizer, root_rank=0)
    state = optimizer.state_dict()["state"]
    moments = torch.cat([s["exp_avg"].reshape(-1) for s in state.values()]) if state else None
    gathered_moments = rpt.allgather(moments.unsqueeze(0)) if moments is not None else None
    checks["broadcast_optimizer_state"] = gathered_moments is not None and all(
        torch.equal(row, gathered_moments[0]) for row in gathered_moments
    )

    try:
        rpt.allreduce(torch.zeros(2, dtype=torch.complex64))
        checks["unsupported-dtype-error"] = False
    except TypeError as exc:
        checks["unsupported-dtype-error"] = "unsupported dtype torch.complex64" in str(exc)

    # A bad tensor on one rank fails there and releases the others instead of hanging them.
    bad = torch.zeros(2, dtype=torch.complex64 if rank == 1 else torch.float32)
    try:
        rpt.allreduce(bad)
        checks["bad-dtype-on-one-rank"] = False
    except TypeError as exc:
        checks["bad-dtype-on-one-rank"] = rank == 1 and "complex64" in str(exc)
    except ringplug.PeerArgumentError as exc:
        checks["bad-dtype-on-one-rank"] = rank != 1 and "rank(s) 1 rejected" in str(exc)
    checks["still-in-step"] = rpt.allreduce(torch.ones(2), op="sum").tolist() == [size] * 2

    checks.update(sync_batchnorm_checks(rank, size))
    (outdir / f"torch-{rank}.json").write_text(json.dumps(checks))


def integer_scaling_checks(rank: int, size: int) -> dict[str, bool]:
    """Integers with Average or scale factors: the core sums; each rank's values (by the
    prescale) and the sum (by the postscale, over size for Average) are scaled in float64
    and truncated toward zero, as ringplug.tensorflow and Horovod do."""
    checks = {}

    def values(r: int) -> list[int]:  # negatives too: truncation is toward zero
        return [-7 * (r + 1), -3, 5 * (r + 1), 9, 1 - r]

    def truncated(vs: list[float], factor: float) -> list[int]:
        return [math.trunc(v * factor) for v in vs]

    sums = [sum(col) for col in zip(*(values(r) for r in range(size)), strict=True)]
    averaged = truncated(sums, 1.0 / size)
    for dtype in (torch.int8, torch.int32, torch.int64):
        mine = torch.tensor(values(rank), dtype=dtype)
        out = rpt.allreduce(mine)
        checks[f"integer-average/{dtype}"] = out.dtype == dtype and out.tolist() == averaged
    scaled_sums = [
        sum(col) for col in zip(*(truncated(values(r), 0.5) for r in range(size)), strict=True)
    ]
    in_place = torch.tensor(values(rank), dtype=torch.int64)
    rpt.allreduce_(in_place, "sum", prescale_factor=0.5, postscale_factor=3.0)
    checks["integer-scaled-sum-in-place"] = in_place.tolist() == truncated(scaled_sums, 3.0)
    grouped = rpt.grouped_allreduce(
        [torch.tensor(values(rank), dtype=torch.int32), torch.tensor([rank + 1], dtype=torch.int32)]
    )
    checks["integer-average-grouped"] = [g.tolist() for g in grouped] == [
        averaged,
        truncated([sum(r + 1 for r in range(size))], 1.0 / size),
    ]
    rows = torch.tensor(values(rank) * size, dtype=torch.int32).reshape(size, 5)
    block = rpt.reducescatter(rows, prescale_factor=0.5)
    checks["integer-average-reducescatter"] = block.tolist() == [truncated(scaled_sums, 1.0 / size)]
    return checks


def sparse_checks(rank: int, size: int) -> dict[str, bool]:
    """A sparse COO tensor is reduced by gathering indices and values: the same values as
    the dense tensor's allreduce; an in-place form or another op is refused on every rank."""
    dense = torch.zeros(5, 3)
    dense[rank % 5] = float(rank + 1)
    dense[4, 1] = 2.0
    total = sum(
        torch.zeros(5, 3).index_fill_(0, torch.tensor([r % 5]), float(r + 1)) for r in range(size)
    )
    total[4, 1] += 2.0 * size
    checks = {}
    for op, expected in (("sum", total), ("average", total / size)):
        out = rpt.allreduce_async(dense.to_sparse(), op, name=f"sparse.{op}").wait()
        checks[f"sparse-allreduce/{op}"] = out.is_sparse and torch.equal(out.to_dense(), expected)
    try:
        rpt.allreduce_(dense.to_sparse())
        checks["sparse-in-place-refused"] = False
    except TypeError as exc:
        checks["sparse-in-place-refused"] = "dense" in str(exc)
    try:
        rpt.allreduce(dense.to_sparse(), "max")
        checks["sparse-max-refused"] = False
    except ValueError as exc:
        checks["sparse-max-refused"] = "sums or averages" in str(exc)
    checks["sparse-still-in-step"] = rpt.allreduce(torch.ones(1), "sum").item() == size
    return checks


def sync_batchnorm_checks(rank: int, size: int) -> dict[str, bool]:
    """ringplug's SyncBatchNorm on uneven shards (rank r has 2r rows: rank 0 none) against
    torch's BatchNorm2d on the whole batch in one process."""
    checks: dict[str, bool] = {}
    generator = torch.Generator().manual_seed(80)
    shards = [
        torch.randn(2 * r, 3, 4, 5, generator=generator, dtype=torch.float64) * 3 + 7
        for r in range(size)
    ]
    weights = [
        torch.randn(2 * r, 3, 4, 5, generator=generator, dtype=torch.float64) for r in range(size)
    ]
    start = sum(2 * r for r in range(rank))
    rows = slice(start, start + 2 * rank)

    reference = torch.nn.BatchNorm2d(3).double()
    with torch.no_grad():
        reference.weight.copy_(torch.tensor([0.5, 1.5, -2.0]))
        reference.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    whole = torch.cat(shards).requires_grad_()
    expected = reference(whole)
    (expected * torch.cat(weights)).sum().backward()

    layer = rpt.SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm2d(3).double())
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([0.5, 1.5, -2.0]))
        layer.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    mine = shards[rank].clone().requires_grad_()
    out = layer(mine)
    (out * weights[rank]).sum().backward()
    summed = rpt.allreduce(torch.cat([layer.weight.grad, layer.bias.grad]), op="sum")

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=1e-9)

    checks["sync_batchnorm/output"] = close(out, expected[rows])
    checks["sync_batchnorm/input-gradient"] = close(mine.grad, whole.grad[rows])
    # Parameter gradients stay local; summed over ranks they are the whole batch's.
    checks["sync_batchnorm/parameter-gradients"] = close(
        summed, torch.cat([reference.weight.grad, reference.bias.grad])
    )
    checks["sync_batchnorm/running-stats"] = close(
        layer.running_mean, reference.running_mean
    ) and close(layer.running_var, reference.running_var)
    layer.eval()
    reference.eval()
    checks["sync_batchnorm/eval"] = close(layer(shards[rank]), reference(shards[rank]))

    reverted = rpt.sync_batchnorm.revert_sync_batchnorm(torch.nn.Sequential(layer))
    checks["sync_batchnorm/revert"] = (
        type(reverted[0]) is torch.nn.BatchNorm2d and reverted[0].weight is layer.weight
    )

    # One value per channel over all ranks has no variance: every rank raises.
    try:
        rpt.SyncBatchNorm(3).train()(torch.ones(1 if rank == 0 else 0, 3))
        checks["sync_batchnorm/too-few-values"] = False
    except ValueError as exc:
        checks["sync_batchnorm/too-few-values"] = "got 1" in str(exc)
    return checks


if __name__ == "__main__":
    main(Path(sys.argv[1]))
