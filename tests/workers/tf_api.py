"""Multi-rank worker: ringplug.tensorflow's own API, eagerly and inside ``tf.function``,
checked against numpy on every rank: each collective and its async form, the gradient
tape, broadcast_variables, and a mismatch.

``python tf_api.py OUTDIR`` writes OUTDIR/rtf-<rank>.json: {check: true/false}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from checklist import checker, raises

import ringplug.tensorflow as rtf  # noqa: E402


def main(outdir: Path) -> None:
    rtf.init()
    rank, size = rtf.rank(), rtf.size()
    checks: dict[str, bool] = {}
    check = checker(checks)

    # Rank r holds (r + 1) * base; rows differ by rank for allgather (r + 1 rows).
    base = np.arange(6, dtype=np.float32).reshape(3, 2)
    mine = base * (rank + 1)
    every = [base * (r + 1) for r in range(size)]
    total = sum(every)
    rows = np.full((rank + 1, 2), rank, np.int32)
    gathered = np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(size)])
    matrix = np.arange(size * 2 * 3, dtype=np.float64).reshape(size * 2, 3) + 100 * rank
    # Rank r gets rows [2r, 2r + 2) of every rank's matrix, in rank order.
    exchanged = np.concatenate(
        [
            np.arange(size * 2 * 3.0).reshape(size * 2, 3)[2 * rank : 2 * rank + 2] + 100 * r
            for r in range(size)
        ]
    )
    blocks = np.array_split(sum(matrix + 100 * (r - rank) for r in range(size)), size)

    def collectives() -> dict[str, object]:
        return {
            "allreduce-sum": rtf.allreduce(mine, op="sum"),
            "allreduce-average": rtf.allreduce(mine),
            "allreduce-max": rtf.allreduce(mine, op=rtf.Max),
            "allreduce-scaled": rtf.allreduce(
                mine, op="sum", prescale_factor=2.0, postscale_factor=0.5
            ),
            "grouped-allreduce": rtf.grouped_allreduce([mine, rows[:1] * 0 + rank], op="sum"),
            "allgather": rtf.allgather(rows),
            "broadcast": rtf.broadcast(mine, root_rank=size - 1),
            "alltoall": rtf.alltoall(matrix, splits=[2] * size),
            "reducescatter": rtf.reducescatter(matrix, op="sum"),
            "allreduce-async": rtf.allreduce_async(mine, op="sum").wait(),
            "allgather-async": rtf.allgather_async(rows).wait(),
            "broadcast-async": rtf.broadcast_async(mine, root_rank=0).wait(),
            "alltoall-async": rtf.alltoall_async(matrix).wait(),
            "reducescatter-async": rtf.reducescatter_async(matrix, op="sum").wait(),
            "grouped-async": rtf.grouped_allreduce_async([mine, mine * 2], op="sum").wait(),
        }

    expected = {
        "allreduce-sum": total,
        "allreduce-average": total / size,
        "allreduce-max": base * size,
        "allreduce-scaled": total,
        "grouped-allreduce": [total, np.full((1, 2), sum(range(size)), np.int32)],
        "allgather": gathered,
        "broadcast": base * size,
        "alltoall": (exchanged, np.full(size, 2, np.int32)),
        "reducescatter": blocks[rank],
        "allreduce-async": total,
        "allgather-async": gathered,
        "broadcast-async": base,
        "alltoall-async": (exchanged, np.full(size, 2, np.int32)),
        "reducescatter-async": blocks[rank],
        "grouped-async": [total, total * 2],
    }

    def same(got: object, want: object) -> bool:
        if isinstance(want, (list, tuple)):
            return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))
        got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
        return got.dtype == want.dtype and got.shape == want.shape and np.allclose(got, want)

    for mode, results in (("eager", collectives()), ("function", tf.function(collectives)())):
        for key, want in expected.items():
            check(f"{mode}-{key}", lambda r=results, k=key, w=want: same(r[k], w))

    # The tape, inside tf.function: each rank's loss is (r + 1) * sum(w): the gradient
    # averaged over the ranks is the mean of (r + 1), the same on every rank.
    w = tf.Variable(tf.ones([2, 2]))

    @tf.function
    def gradient():
        with rtf.DistributedGradientTape() as tape:
            loss = tf.reduce_sum(w) * float(rank + 1)
        return tape.gradient(loss, [w])[0]

    mean = sum(r + 1 for r in range(size)) / size
    check("tape-averages", lambda: np.allclose(gradient().numpy(), mean))
    check("reduce-gradients-keeps-none", lambda: rtf.reduce_gradients([None])[0] is None)

    # broadcast_variables: rank 0's values everywhere, eagerly.
    v = tf.Variable(np.full(3, rank, np.float32))
    rtf.broadcast_variables([v], root_rank=0)
    check("broadcast-variables", lambda: v.numpy().tolist() == [0.0] * 3)

    # Differentiable collectives: allreduce's gradient is reduced too.
    x = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        y = rtf.allreduce(x * (rank + 1), op="sum")
    check(
        "allreduce-gradient",
        lambda: tape.gradient(y, x).numpy().tolist() == [(rank + 1) * size] * 2,
    )

    # A mismatch (shapes differ by rank) is FailedPreconditionError on every rank, eagerly
    # and in tf.function, and the ranks stay in step.
    mismatch = lambda: rtf.allreduce(tf.ones(2 + rank))  # noqa: E731
    check("eager-mismatch", lambda: raises(mismatch, tf.errors.FailedPreconditionError, "rank"))
    check(
        "function-mismatch",
        lambda: raises(tf.function(mismatch), tf.errors.FailedPreconditionError, "shapes"),
    )
    check(
        "in-step", lambda: rtf.allgather(tf.constant([rank])).numpy().tolist() == list(range(size))
    )
    (outdir / f"rtf-{rank}.json").write_text(json.dumps(checks))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
