"""Multi-rank worker written as a Horovod user would: only ``hvd.*`` names.

Every collective of ``ringplug.horovod.torch`` over dtypes and shapes against numpy
references computed here, the error cases, join, and autograd through the collectives.
``python hvd_collectives.py OUTDIR`` writes OUTDIR/hvd-<rank>.json: {check: true/false}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from checklist import checker

import ringplug.horovod.torch as hvd

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
]
SHAPES = [(1,), (17,), (3, 5), (2, 3, 4), (100_003,)]


def values(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    rng = np.random.default_rng([rank, salt])
    return torch.from_numpy(rng.integers(0, 5, shape).astype(np.float64)).to(dtype)


REDUCERS = {
    "sum": lambda s: s.sum(0),
    "min": lambda s: s.min(0),
    "max": lambda s: s.max(0),
    "product": lambda s: s.prod(0),
}


def sweep(
    checks: dict, rank: int, size: int, dtype: torch.dtype, shape: tuple[int, ...], salt: int
) -> None:
    """allreduce with every op (and the average flag) and broadcast, for one dtype and shape."""
    inputs = [values(r, shape, dtype, salt) for r in range(size)]
    stack = np.stack([x.double().numpy() for x in inputs])
    ops = {"sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}
    for op_name, op in ops.items():
        if op_name == "product" and shape == (100_003,):
            continue  # overflows every small dtype
        expected = REDUCERS[op_name](stack)
        out = hvd.allreduce(inputs[rank], op=op)
        checks[f"allreduce/{op_name}/{dtype}/{shape}"] = out.dtype == dtype and bool(
            np.allclose(out.double().numpy(), expected)
        )
    if dtype.is_floating_point:
        mean = hvd.allreduce(inputs[rank]).double().numpy()
        checks[f"allreduce/average/{dtype}/{shape}"] = bool(
            np.allclose(mean, stack.mean(0), rtol=1e-2)
        )
        summed = hvd.allreduce(inputs[rank], average=False).double().numpy()
        checks[f"allreduce-average-flag/{dtype}/{shape}"] = bool(
            np.allclose(summed, stack.sum(0), rtol=1e-2)
        )
    root = hvd.broadcast(inputs[rank], root_rank=size - 1)
    checks[f"broadcast/{dtype}/{shape}"] = torch.equal(root, inputs[size - 1])
    # allgather: ranks contribute different numbers of rows.
    rows = [x.reshape(-1, *shape[1:])[: r + 1] for r, x in enumerate(inputs)]
    gathered = hvd.allgather(rows[rank])
    checks[f"allgather/{dtype}/{shape}"] = torch.equal(gathered, torch.cat(rows))
    # reducescatter (sum): earlier ranks get a row more when the rows do not divide.
    block = hvd.reducescatter(inputs[rank], op=hvd.Sum)
    base, extra = divmod(shape[0], size)
    start = rank * base + min(rank, extra)
    expected = stack.sum(0)[start : start + base + (rank < extra)]
    checks[f"reducescatter/{dtype}/{shape}"] = bool(
        block.shape == expected.shape and np.allclose(block.double().numpy(), expected)
    )
    # alltoall: rank r sends rows [i*k, (i+1)*k) to rank i, k = rows // size.
    k = shape[0] // size
    sent = inputs[rank][: k * size]
    received, splits = hvd.alltoall(sent, splits=[k] * size)
    expected_rows = torch.cat([inputs[r][rank * k : (rank + 1) * k] for r in range(size)])
    checks[f"alltoall/{dtype}/{shape}"] = splits.tolist() == [k] * size and torch.equal(
        received, expected_rows
    )


def main(outdir: Path) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks: dict[str, bool] = {}

    check = checker(checks)

    for salt, (dtype, shape) in enumerate((d, s) for d in DTYPES for s in SHAPES):
        sweep(checks, rank, size, dtype, shape, salt)

    # In place, async, grouped, scaling.
    t = torch.full((4,), float(rank + 1))
    check(
        "allreduce_",
        lambda: hvd.allreduce_(t, op=hvd.Sum) is t and t.tolist() == [sum(range(1, size + 1))] * 4,
    )
    handle = hvd.allreduce_async(torch.full((3,), 2.0), name="async", op=hvd.Sum)
    check(
        "allreduce_async/synchronize", lambda: hvd.synchronize(handle).tolist() == [2.0 * size] * 3
    )
    check("poll", lambda: hvd.poll(handle))
    in_place = torch.ones(5)
    handle = hvd.allreduce_async_(in_place, op=hvd.Sum, name="async_")
    check(
        "allreduce_async_",
        lambda: hvd.synchronize(handle) is in_place and in_place.tolist() == [float(size)] * 5,
    )
    check(
        "scaling",
        lambda: (
            hvd.allreduce(
                torch.ones(2), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5
            ).tolist()
            == [float(size)] * 2
        ),
    )
    group = [torch.full((2,), float(rank)), torch.full((3, 2), 1.0)]
    check(
        "grouped_allreduce",
        lambda: (
            [g.tolist() for g in hvd.grouped_allreduce(group, op=hvd.Sum)]
            == [[float(sum(range(size)))] * 2, [[float(size)] * 2] * 3]
        ),
    )
    h = hvd.grouped_allreduce_async([torch.ones(2), torch.ones(1)], op=hvd.Sum)
    check(
        "grouped_allreduce_async",
        lambda: [x.tolist() for x in hvd.synchronize(h)] == [[float(size)] * 2, [float(size)]],
    )
    own = [torch.ones(2), torch.full((2,), 3.0)]
    check(
        "grouped_allreduce_",
        lambda: hvd.grouped_allreduce_(own) is not None and own[1].tolist() == [3.0, 3.0],
    )
    check(
        "fp16-compression",
        lambda: (
            hvd.allreduce(torch.full((3,), 0.5), op=hvd.Sum, compression=hvd.Compression.fp16).dtype
            == torch.float32
        ),
    )

    # Allgather (first dimension may differ), alltoall with splits, reducescatter.
    parts = [torch.full((r + 1, 3), float(r)) for r in range(size)]
    check("allgather", lambda: torch.equal(hvd.allgather(parts[rank]), torch.cat(parts)))
    h = hvd.allgather_async(parts[rank], name="gather-async")
    check("allgather_async", lambda: torch.equal(hvd.synchronize(h), torch.cat(parts)))
    rows = torch.arange(size * 2).reshape(size * 2, 1) + 100 * rank
    received, splits = hvd.alltoall(rows, splits=[2] * size)
    check(
        "alltoall",
        lambda: (
            splits.tolist() == [2] * size
            and received.reshape(-1).tolist()
            == [100 * s + 2 * rank + k for s in range(size) for k in range(2)]
        ),
    )
    block = hvd.reducescatter(torch.ones(size * 2, 2) * (rank + 1), op=hvd.Sum)
    check(
        "reducescatter",
        lambda: (
            block.shape == (2, 2) and block.tolist() == [[float(sum(range(1, size + 1)))] * 2] * 2
        ),
    )

    # Autograd as Horovod defines it.
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * torch.arange(3.0)).sum().backward()
    check("allreduce-grad", lambda: x.grad.tolist() == [float(size) * k for k in range(3)])
    y = torch.full((2,), 1.0, requires_grad=True)
    (hvd.broadcast(y, root_rank=0) * 3).sum().backward()
    check("broadcast-grad", lambda: y.grad.tolist() == ([3.0, 3.0] if rank == 0 else [0.0, 0.0]))

    # Objects, barrier, capability queries, what is not supported.
    check("broadcast_object", lambda: hvd.broadcast_object({"r": rank}, root_rank=0) == {"r": 0})
    check("allgather_object", lambda: hvd.allgather_object(rank) == list(range(size)))
    hvd.barrier()
    check(
        "queries",
        lambda: (
            hvd.mpi_enabled()
            and hvd.mpi_built()
            and not hvd.gloo_enabled()
            and hvd.mpi_threads_supported()
            and hvd.local_size() == size
        ),
    )

    def refused(call, error, words) -> bool:
        try:
            call()
        except error as exc:
            return words in str(exc)
        return False

    # Adasum reduces with allreduce only (its own checks: hvd_adasum.py).
    check(
        "adasum-refused-by-reducescatter",
        lambda: refused(
            lambda: hvd.reducescatter(torch.ones(size), op=hvd.Adasum),
            NotImplementedError,
            "Adasum",
        ),
    )
    # Mismatched shapes, dtypes and roots raise on every rank; so does a name in flight twice.
    check(
        "shape-mismatch",
        lambda: refused(
            lambda: hvd.allreduce(torch.ones(2 + rank), name="m1"), RuntimeError, "rank"
        ),
    )
    dtype = torch.float32 if rank == 0 else torch.float64
    check(
        "dtype-mismatch",
        lambda: refused(
            lambda: hvd.allreduce(torch.ones(2, dtype=dtype), name="m2"), RuntimeError, "dtype"
        ),
    )
    check(
        "root-mismatch",
        lambda: refused(
            lambda: hvd.broadcast(torch.ones(2), root_rank=rank, name="m3"), RuntimeError, "root"
        ),
    )
    # A name in flight twice: one rank at a time submits it twice while the others have not
    # submitted it yet, so that the first cannot have finished when the second comes.
    for turn in range(hvd.size()):
        name = f"twice-{turn}"
        second_refused = True
        if rank == turn:
            first = hvd.allreduce_async(torch.ones(1), name=name, op=hvd.Sum)
            second_refused = refused(
                lambda name=name: hvd.allreduce_async(torch.ones(1), name=name), ValueError, name
            )
        hvd.barrier()
        if rank != turn:
            first = hvd.allreduce_async(torch.ones(1), name=name, op=hvd.Sum)
        total = hvd.synchronize(first).item()
        check(f"duplicate-name-{turn}", lambda ok=second_refused, t=total: ok and t == size)
    check("still-in-step", lambda: hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == size)

    # join: the last rank runs extra steps; the others contribute zeros meanwhile.
    extra = []
    if rank == size - 1:
        for step in range(3):
            extra.append(hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"extra{step}").tolist())
    last = hvd.join()
    check("join", lambda: last == size - 1 and (rank != size - 1 or extra == [[1.0, 1.0]] * 3))

    (outdir / f"hvd-{rank}.json").write_text(json.dumps(checks))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
