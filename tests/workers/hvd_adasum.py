"""Multi-rank worker: Adasum (``op=hvd.Adasum``) on the core and through ``hvd.*`` (torch).

On a power of two ranks every result is compared with a numpy reference of the pairwise
tree written here from the paper's formula (Maleki et al., MLSys 2021): two vectors a, b
combine as (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b, ranks 2k and 2k+1 first, then the
results of those pairs, and so on. On any other number of ranks every Adasum call must be
refused at once, on every rank, and the job must go on.
``python hvd_adasum.py OUTDIR`` writes OUTDIR/adasum-<rank>.json: {check: true/false}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from checklist import checker, raises

import ringplug.horovod.torch as hvd
from ringplug.core import collectives as core_collectives


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The paper's pairwise combination of two whole tensors, in float64."""
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    dot, a_squared, b_squared = a @ b, a @ a, b @ b
    a_factor = 1.0 - dot / (2.0 * a_squared) if a_squared > 0 else 1.0
    b_factor = 1.0 - dot / (2.0 * b_squared) if b_squared > 0 else 1.0
    return a_factor * a + b_factor * b


def tree(per_rank: list[np.ndarray]) -> np.ndarray:
    """Ranks combined pairwise, level by level: (0 1)(2 3) ..., then ((0 1)(2 3)) ..."""
    shape = per_rank[0].shape
    level = [np.asarray(x, np.float64).ravel() for x in per_rank]
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0].reshape(shape)


def values(rank: int, shape: tuple[int, ...], salt: int) -> np.ndarray:
    return np.random.default_rng([rank, salt]).standard_normal(shape)


def close(result: np.ndarray, expected: np.ndarray, dtype: np.dtype) -> bool:
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
    tolerance = {np.float16: 4e-3, np.float32: 2e-6, np.float64: 1e-12}[np.dtype(dtype).type]
    return float(np.abs(np.asarray(result, np.float64) - expected).max(initial=0.0)) <= (
        tolerance * scale
    )


def same_everywhere(result: torch.Tensor, name: str) -> bool:
    """Whether every rank holds `result` bit for bit."""
    gathered = hvd.allgather(result.detach().reshape(1, -1).double(), name=name)
    return bool((gathered == gathered[0]).all())


def supported(check, rank: int, size: int) -> None:
    # The core on numpy arrays: shapes whose halves split inside a tensor, an empty one.
    shapes = [(1,), (7,), (3, 5), (1000,), (0,), (2, 3, 4)]
    for dtype in (np.float64, np.float32, np.float16):
        for salt, shape in enumerate(shapes):
            inputs = [values(r, shape, salt).astype(dtype) for r in range(size)]
            expected = tree([x.astype(np.float64) for x in inputs])
            name = f"core.{np.dtype(dtype).name}.{salt}"
            out = core_collectives.adasum(inputs[rank], name=name)
            check(
                f"core/{np.dtype(dtype).name}/{shape}",
                lambda out=out, expected=expected, dtype=dtype: (
                    out.dtype == dtype
                    and out.shape == expected.shape
                    and close(out, expected, dtype)
                ),
            )
    # A burst of tensors of one dtype runs fused; each keeps its own dot products and norms
    # (a tensor 1000 times larger than the others must not change their coefficients).
    sizes = [3, 1, 50, 2, 17, 999, 4]
    burst = [
        values(rank, (n,), 100 + i) * (1000.0 if n == 999 else 1.0) for i, n in enumerate(sizes)
    ]
    handles = [core_collectives.adasum_async(x, name=f"burst.{i}") for i, x in enumerate(burst)]
    results = [h.wait() for h in handles]
    for i, n in enumerate(sizes):
        scale = 1000.0 if n == 999 else 1.0
        expected = tree([values(r, (n,), 100 + i) * scale for r in range(size)])
        check(f"core/fused-burst/{i}", lambda i=i, e=expected: close(results[i], e, np.float64))
    # In place: the input array is the output.
    own = values(rank, (33,), 200)
    expected = tree([values(r, (33,), 200) for r in range(size)])
    core_collectives.adasum(own, out=own, name="core.in-place")
    check("core/in-place", lambda: close(own, expected, np.float64))

    # The paper's two limits: orthogonal vectors add up, parallel ones average.
    basis = np.eye(size * 3)[:size]
    result = core_collectives.adasum(basis[rank].copy(), name="core.orthogonal")
    check("orthogonal-is-the-sum", lambda: np.allclose(result, basis.sum(0), atol=1e-15))
    direction = values(0, (20,), 300)
    factors = [1.0, 3.0, 0.5, 7.0, 2.0, 0.25, 4.0, 1.5][:size]
    result = core_collectives.adasum(direction * factors[rank], name="core.parallel")
    check(
        "parallel-is-the-average",
        lambda: np.allclose(result, direction * np.mean(factors), rtol=1e-12),
    )
    # A rank with zeros: its partner's vector passes through (coefficient 1, no 0/0).
    mine = np.zeros(9) if rank == 0 else values(rank, (9,), 400)
    result = core_collectives.adasum(mine, name="core.zeros")
    inputs = [np.zeros(9)] + [values(r, (9,), 400) for r in range(1, size)]
    check(
        "zeros-pass-the-other-through",
        lambda: np.all(np.isfinite(result)) and close(result, tree(inputs), np.float64),
    )

    # hvd.* (torch): every form, float16/32/64, results identical on every rank.
    for dtype in (torch.float64, torch.float32, torch.float16):
        numpy_type = torch.empty(0, dtype=dtype).numpy().dtype
        inputs = [values(r, (5, 6), 500).astype(numpy_type) for r in range(size)]
        expected = tree(inputs)
        mine_t = torch.from_numpy(inputs[rank].copy())
        out = hvd.allreduce(mine_t, op=hvd.Adasum, name=f"hvd.{dtype}")
        check(
            f"hvd/allreduce/{dtype}",
            lambda out=out, e=expected, t=numpy_type, m=mine_t: (
                out.dtype == m.dtype and close(out.numpy(), e, t)
            ),
        )
        check(
            f"hvd/allreduce/{dtype}/same-on-every-rank",
            lambda out=out, d=dtype: same_everywhere(out, f"same.{d}"),
        )
        check(
            f"hvd/allreduce/{dtype}/input-unchanged",
            lambda m=mine_t, i=inputs[rank]: np.array_equal(m.numpy(), i),
        )
    inputs = [values(r, (11,), 600).astype(np.float32) for r in range(size)]
    expected = tree(inputs)
    tensor = torch.from_numpy(inputs[rank].copy())
    returned = hvd.allreduce_(tensor, op=hvd.Adasum, name="hvd.in-place")
    check(
        "hvd/allreduce_", lambda: returned is tensor and close(tensor.numpy(), expected, np.float32)
    )
    tensor = torch.from_numpy(inputs[rank].copy())
    handle = hvd.allreduce_async_(tensor, op=hvd.Adasum, name="hvd.async-in-place")
    check(
        "hvd/allreduce_async_",
        lambda: hvd.synchronize(handle) is tensor and close(tensor.numpy(), expected, np.float32),
    )
    handle = hvd.allreduce_async(
        torch.from_numpy(inputs[rank].copy()), op=hvd.Adasum, name="hvd.async"
    )
    check(
        "hvd/allreduce_async", lambda: close(hvd.synchronize(handle).numpy(), expected, np.float32)
    )
    scaled = hvd.allreduce(
        torch.from_numpy(inputs[rank].copy()),
        op=hvd.Adasum,
        prescale_factor=2.0,
        postscale_factor=0.25,
        name="hvd.scaled",
    )
    check("hvd/scale-factors", lambda: close(scaled.numpy(), expected * 0.5, np.float32))
    # Grouped: each tensor its own Adasum (not one over their concatenation).
    group = [values(rank, (n,), 700 + n) for n in (4, 9, 2)]
    expected_group = [tree([values(r, (n,), 700 + n) for r in range(size)]) for n in (4, 9, 2)]
    results = hvd.grouped_allreduce(
        [torch.from_numpy(g.copy()) for g in group], op=hvd.Adasum, name="hvd.group"
    )
    check(
        "hvd/grouped_allreduce",
        lambda: all(
            close(r.numpy(), e, np.float64) for r, e in zip(results, expected_group, strict=True)
        ),
    )
    tensors = [torch.from_numpy(g.copy()) for g in group]
    handle = hvd.grouped_allreduce_async_(tensors, op=hvd.Adasum, name="hvd.group-async")
    check(
        "hvd/grouped_allreduce_async_",
        lambda: (
            hvd.synchronize(handle) == tensors
            and all(
                close(t.numpy(), e, np.float64)
                for t, e in zip(tensors, expected_group, strict=True)
            )
        ),
    )
    # Autograd: the gradient is the Adasum of the ranks' gradients (all ones: parallel, so
    # their average, ones).
    leaf = torch.from_numpy(values(rank, (6,), 800)).requires_grad_()
    hvd.allreduce(leaf, op=hvd.Adasum, name="hvd.grad").sum().backward()
    check("hvd/gradient", lambda: torch.allclose(leaf.grad, torch.ones(6, dtype=torch.float64)))

    # Bad input: every rank raises, naming the tensor, and the job goes on.
    check(
        "mismatched-shape-names-the-tensor",
        lambda: raises(
            lambda: hvd.allreduce(torch.ones(3 + rank), op=hvd.Adasum, name="bad.shape"),
            RuntimeError,
            "bad.shape",
        ),
    )
    check(
        "adasum-against-sum-names-the-tensor",
        lambda: raises(
            lambda: hvd.allreduce(
                torch.ones(3), op=hvd.Adasum if rank == 0 else hvd.Sum, name="bad.op"
            ),
            RuntimeError,
            "bad.op",
        ),
    )
    wrong = torch.ones(3, dtype=torch.int32 if rank == 0 else torch.float32)
    check(
        "integers-refused-on-every-rank",
        lambda: raises(
            lambda: hvd.allreduce(wrong, op=hvd.Adasum, name="bad.dtype"),
            RuntimeError if rank else TypeError,
            "" if rank else "float16, float32 or float64",
        ),
    )
    # A joined rank has no tensor to combine: the others' Adasum fails, naming it.
    if rank == size - 1:
        check("join-with-adasum-pending", lambda: hvd.join() in range(size))
    else:
        check(
            "adasum-refused-while-a-rank-has-joined",
            lambda: raises(
                lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum, name="joined"),
                RuntimeError,
                f"rank(s) {size - 1} have joined",
            ),
        )
        hvd.join()
    check(
        "reducescatter-refuses-adasum",
        lambda: raises(
            lambda: hvd.reducescatter(torch.ones(size * 2), op=hvd.Adasum),
            NotImplementedError,
            "Adasum",
        ),
    )
    check(
        "still-working-after",
        lambda: float(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after")) == size,
    )

    # DistributedOptimizer(op=Adasum): each rank steps from the same parameters with its own
    # gradient; the parameters become start + Adasum(steps), the same on every rank.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr = 0.1
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr),
        named_parameters=model.named_parameters(),
        op=hvd.Adasum,
    )
    features = torch.from_numpy(values(rank, (8, 4), 900))
    optimizer.zero_grad()
    model(features).pow(2).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    every = {n: hvd.allgather(g.reshape(1, -1), name=f"grads.{n}") for n, g in grads.items()}
    optimizer.step()
    for n, p in model.named_parameters():
        steps = [(-lr * every[n][r]).reshape(p.shape).numpy() for r in range(size)]
        expected = start[n].numpy() + tree(steps)
        check(
            f"delta-optimizer/{n}", lambda p=p, e=expected: close(p.detach().numpy(), e, np.float64)
        )
        check(
            f"delta-optimizer/{n}/same-on-every-rank",
            lambda p=p, n=n: same_everywhere(p, f"params.{n}"),
        )
    check(
        "delta-optimizer/skip_synchronize-refused",
        lambda: raises(lambda: optimizer.skip_synchronize().__enter__(), AssertionError, "Adasum"),
    )


def unsupported(check, rank: int, size: int) -> None:
    """Not a power of two: every Adasum call raises at once on every rank, saying what to
    do, and nothing is left in flight."""
    words = "power of two"
    check(
        "hvd/allreduce-refused",
        lambda: raises(
            lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum), NotImplementedError, words
        ),
    )
    check(
        "hvd/allreduce_async_-refused",
        lambda: raises(
            lambda: hvd.allreduce_async_(torch.ones(3), op=hvd.Adasum), NotImplementedError, words
        ),
    )
    check(
        "hvd/grouped-refused",
        lambda: raises(
            lambda: hvd.grouped_allreduce([torch.ones(3)], op=hvd.Adasum),
            NotImplementedError,
            words,
        ),
    )
    below = 1 << (size.bit_length() - 1)
    check(
        "core-refused",
        lambda: raises(
            lambda: core_collectives.adasum(np.ones(3)),
            NotImplementedError,
            f"Run on {below} or {below * 2} ranks",
        ),
    )
    model = torch.nn.Linear(2, 1)
    check(
        "optimizer-refused",
        lambda: raises(
            lambda: hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum
            ),
            NotImplementedError,
            words,
        ),
    )
    check("still-working-after", lambda: float(hvd.allreduce(torch.ones(1), op=hvd.Sum)) == size)


def main(outdir: str) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks: dict[str, bool] = {}
    check = checker(checks)
    if size & (size - 1) == 0:
        supported(check, rank, size)
    else:
        unsupported(check, rank, size)
    Path(outdir, f"adasum-{rank}.json").write_text(json.dumps(checks))


if __name__ == "__main__":
    main(sys.argv[1])
