"""Multi-rank worker: Adasum through Horovod's TensorFlow API, eagerly, inside
``tf.function`` and in a TF1 graph session, and DistributedGradientTape(op=hvd.Adasum),
against a numpy reference of the paper's pairwise tree written here.

``python hvd_tf_adasum.py OUTDIR`` writes OUTDIR/tf_adasum-<rank>.json: {check: true/false}.
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

import ringplug.horovod.tensorflow as hvd  # noqa: E402


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b, over whole tensors, in float64."""
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    dot = a @ b
    return (1.0 - dot / (2.0 * (a @ a))) * a + (1.0 - dot / (2.0 * (b @ b))) * b


def tree(per_rank: list[np.ndarray]) -> np.ndarray:
    shape = np.shape(per_rank[0])
    level = list(per_rank)
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return np.asarray(level[0]).reshape(shape)


def values(rank: int, shape: tuple[int, ...], salt: int) -> np.ndarray:
    return np.random.default_rng([rank, salt]).standard_normal(shape)


def close(result: object, expected: np.ndarray, tolerance: float) -> bool:
    result = np.asarray(result, np.float64)
    return result.shape == expected.shape and bool(
        np.abs(result - expected).max() <= tolerance * np.abs(expected).max()
    )


def main(outdir: Path) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks: dict[str, bool] = {}
    check = checker(checks)

    inputs = [values(r, (3, 4), 1) for r in range(size)]
    expected = tree(inputs)
    for dtype, tolerance in ((tf.float64, 1e-12), (tf.float32, 2e-6), (tf.float16, 4e-3)):
        mine = tf.constant(inputs[rank], dtype=dtype)
        out = hvd.allreduce(mine, op=hvd.Adasum, name=f"eager.{dtype.name}")
        check(
            f"eager/{dtype.name}",
            lambda out=out, t=tolerance, d=dtype: out.dtype == d and close(out, expected, t),
        )

    @tf.function
    def in_function(x: tf.Tensor) -> tf.Tensor:
        return hvd.allreduce(x, op=hvd.Adasum, name="in-function")

    check(
        "tf.function",
        lambda: close(in_function(tf.constant(inputs[rank])), expected, 1e-12),
    )
    group = [values(rank, (n,), 10 + n) for n in (5, 2, 8)]
    expected_group = [tree([values(r, (n,), 10 + n) for r in range(size)]) for n in (5, 2, 8)]
    results = hvd.grouped_allreduce([tf.constant(g) for g in group], op=hvd.Adasum, name="group")
    check(
        "grouped (each tensor its own norms)",
        lambda: all(close(r, e, 1e-12) for r, e in zip(results, expected_group, strict=True)),
    )
    # TF1 graph: the op runs when the session runs it.
    with tf.Graph().as_default():
        node = hvd.allreduce(tf.constant(inputs[rank]), op=hvd.Adasum, name="graph")
        with tf.compat.v1.Session() as session:
            graph_result = session.run(node)
    check("tf1-graph", lambda: close(graph_result, expected, 1e-12))

    # DistributedGradientTape(op=Adasum): the gradients are the Adasum of the ranks'.
    weights = tf.Variable(np.ones(4))
    features = tf.constant(values(rank, (6, 4), 20))
    with tf.GradientTape() as plain:
        loss = tf.reduce_sum(tf.square(tf.linalg.matvec(features, weights)))
    own = plain.gradient(loss, weights).numpy()
    every = hvd.allgather(tf.constant(own[None, :]), name="own-grads").numpy()
    with tf.GradientTape() as inner:
        loss = tf.reduce_sum(tf.square(tf.linalg.matvec(features, weights)))
    tape = hvd.DistributedGradientTape(inner, op=hvd.Adasum)
    reduced = tape.gradient(loss, [weights])[0]
    check("gradient-tape", lambda: close(reduced, tree(list(every)), 1e-12))

    # Refusals.
    slices = tf.IndexedSlices(tf.ones((1, 3)), tf.constant([rank]))
    check(
        "indexed-slices-refused",
        lambda: raises(lambda: hvd.allreduce(slices, op=hvd.Adasum), NotImplementedError, ""),
    )
    check(
        "keras-optimizer-refused",
        lambda: raises(
            lambda: hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), op=hvd.Adasum),
            ValueError,
            "DistributedGradientTape",
        ),
    )
    (outdir / f"tf_adasum-{rank}.json").write_text(json.dumps(checks))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
