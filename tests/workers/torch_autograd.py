"""Multi-rank worker: ringplug.torch's differentiable collectives, grouped allgather and
reducescatter, scale factors, handles over several requests, and `Compression`.

Every rank's loss is weighted by (rank + 1), so a gradient that should be the sum of the
ranks' gradients differs from one that is the average or this rank's own.
``python torch_autograd.py OUTDIR`` writes OUTDIR/autograd-<rank>.json: {check: true/false}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from checklist import checker, raises

import ringplug
import ringplug.torch as rpt
from ringplug.compression import Compression


def main(outdir: Path) -> None:
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    weight = float(rank + 1)
    weights = float(sum(r + 1 for r in range(size)))  # the sum of every rank's weight
    checks: dict[str, bool] = {}
    check = checker(checks)

    # allreduce: the gradient is the ranks' gradients reduced with the same op and factors.
    x = torch.full((3,), float(rank), requires_grad=True)
    y = rpt.allreduce(x, op="sum", prescale_factor=2.0, postscale_factor=0.5)
    (y * weight).sum().backward()
    check(
        "allreduce-sum-scaled-grad",
        lambda: y.tolist() == [float(sum(range(size)))] * 3 and x.grad.tolist() == [weights] * 3,
    )
    x = torch.ones(2, requires_grad=True)
    (rpt.allreduce(x, op="average") * weight).sum().backward()
    check(
        "allreduce-average-grad", lambda: torch.allclose(x.grad, torch.full((2,), weights / size))
    )
    p, q = torch.ones(2, requires_grad=True), torch.ones(1, 2, requires_grad=True)
    rp, rq = rpt.grouped_allreduce([p, q], op="sum")
    (rp.sum() * weight + rq.sum()).backward()
    check(
        "grouped-allreduce-grad",
        lambda: p.grad.tolist() == [weights] * 2 and q.grad.tolist() == [[float(size)] * 2],
    )

    # broadcast: root's tensor gets the sum of the ranks' gradients, the others zero.
    b = torch.full((2,), float(rank), requires_grad=True)
    got = rpt.broadcast(b, root_rank=size - 1)
    (got * weight).sum().backward()
    root_grad = [weights] * 2 if rank == size - 1 else [0.0, 0.0]
    check(
        "broadcast-grad",
        lambda: got.tolist() == [float(size - 1)] * 2 and b.grad.tolist() == root_grad,
    )
    source = torch.full((2,), float(rank))
    copy = rpt.broadcast_async(source, root_rank=0).wait()
    check(
        "broadcast-async-new-tensor",
        lambda: copy.tolist() == [0.0, 0.0] and source.tolist() == [float(rank)] * 2,
    )

    # grouped allgather: each tensor's rows from every rank; each rank's rows get the sum
    # of the ranks' gradients for them.
    a = torch.full((rank + 1,), float(rank), requires_grad=True)
    c = torch.full((2, 3), 1.0, requires_grad=True)
    ga, gc = rpt.grouped_allgather([a, c], name="gathered")
    (ga.sum() * weight + gc.sum()).backward()
    check(
        "grouped-allgather",
        lambda: (
            ga.tolist() == [float(r) for r in range(size) for _ in range(r + 1)]
            and gc.shape == (2 * size, 3)
        ),
    )
    check(
        "grouped-allgather-grad",
        lambda: a.grad.tolist() == [weights] * (rank + 1) and c.grad.tolist() == [[size] * 3] * 2,
    )
    handle = rpt.grouped_allgather_async([torch.full((1,), float(rank)), torch.ones(2)])
    check(
        "grouped-allgather-async",
        lambda: (
            [t.tolist() for t in handle.wait(timeout=60)]
            == [[float(r) for r in range(size)], [1.0] * 2 * size]
        ),
    )

    # reducescatter with scale factors, grouped, and its gradient (gathered back).
    rows = torch.ones(size * 2, 2, requires_grad=True)
    block = rpt.reducescatter(rows, op="sum", prescale_factor=3.0, postscale_factor=0.5)
    (block * weight).sum().backward()
    gathered_weights = [[float(r + 1) * 1.5] * 2 for r in range(size) for _ in range(2)]
    check(
        "reducescatter-scaled",
        lambda: block.tolist() == [[size * 1.5] * 2] * 2 and rows.grad.tolist() == gathered_weights,
    )
    rows = torch.ones(size, 2, requires_grad=True)
    (rpt.reducescatter(rows, op="average") * weight).sum().backward()
    check(
        "reducescatter-average-grad",
        lambda: torch.allclose(
            rows.grad, torch.tensor([[(r + 1) / size] * 2 for r in range(size)])
        ),
    )
    blocks = rpt.grouped_reducescatter([torch.ones(size, 2), torch.ones(size * 3)], op="sum")
    check(
        "grouped-reducescatter",
        lambda: [b.tolist() for b in blocks] == [[[float(size)] * 2], [float(size)] * 3],
    )
    handle = rpt.grouped_reducescatter_async([torch.ones(size)], op="sum", postscale_factor=2.0)
    check("grouped-reducescatter-async", lambda: handle.wait()[0].tolist() == [2.0 * size])

    # alltoall: each row's gradient comes back from the rank it went to.
    leaf = (torch.arange(size * (rank + 1), dtype=torch.float64) + 1).requires_grad_()
    received, counts = rpt.alltoall(leaf, splits=[rank + 1] * size)
    (received * received * weight).sum().backward()
    # Rows sent to rank r come back weighted by r + 1.
    sent_to = torch.arange(size).repeat_interleave(rank + 1).to(torch.float64)
    check(
        "alltoall-grad",
        lambda: (
            counts.tolist() == [r + 1 for r in range(size)]
            and torch.equal(leaf.grad, 2 * leaf.detach() * (sent_to + 1))
        ),
    )
    check(
        "alltoall-float-splits-refused",
        lambda: raises(lambda: rpt.alltoall(torch.ones(size), torch.ones(size)), ValueError, "int"),
    )

    # A handle over several requests waits for all of them and finishes once.
    parts = [rpt.allreduce_async(torch.full((1,), float(i)), op="sum") for i in range(3)]
    total = rpt.TensorHandle(parts, lambda results: sum(t.item() for t in results))
    check("handle-over-several", lambda: total.wait(timeout=60) == 3.0 * size and total.done())

    # Compression: floating tensors travel as float16 and come back in their dtype.
    sent, ctx = Compression.fp16.compress(torch.full((2,), 0.25 * (rank + 1)))
    back = Compression.fp16.decompress(rpt.allreduce(sent, op="sum"), ctx)
    ints, none = Compression.fp16.compress(torch.ones(2, dtype=torch.int32))
    check(
        "compression-fp16",
        lambda: (
            sent.dtype == torch.float16
            and back.dtype == torch.float32
            and back.tolist() == [0.25 * weights] * 2
            and ints.dtype == torch.int32
            and none is None
            and Compression("fp16") is Compression.fp16
        ),
    )

    check("still-in-step", lambda: rpt.allreduce(torch.ones(1), op="sum").item() == size)
    (outdir / f"autograd-{rank}.json").write_text(json.dumps(checks))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
