"""Multi-rank worker: more concurrent graph collectives than TensorFlow has inter-op threads
(one), each rank creating them in its own order, in a TF1 session, a TF1 training loop
(one allreduce per gradient, under MonitoredTrainingSession) and a ``tf.function``.

A collective that held its thread while it waited left each rank's only thread in a
collective the other rank had not reached, until RINGPLUG_TIMEOUT ended the job.

``python tf_threads.py OUTDIR`` writes OUTDIR/threads-<rank>.json: {check: true/false}.
Run it first in its process (``in_turn.py``): it sizes TensorFlow's pool before TensorFlow's
first operation.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from checklist import checker, raises  # noqa: E402

import ringplug.tensorflow as rtf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)  # before TensorFlow's first op
ONE_THREAD = tf.compat.v1.ConfigProto(
    inter_op_parallelism_threads=1, intra_op_parallelism_threads=1, use_per_session_threads=True
)


def main(outdir: Path) -> None:
    rtf.init()
    rank, size = rtf.rank(), rtf.size()
    checks: dict[str, bool] = {}
    check = checker(checks)

    rows = np.full((rank + 1, 2), rank, np.int32)
    matrix = np.arange(size * 2 * 3, dtype=np.float64).reshape(size * 2, 3) + 100 * rank
    total = sum(np.arange(size * 2 * 3.0).reshape(size * 2, 3) + 100 * r for r in range(size))
    builders = {
        **{
            f"allreduce{i}": lambda i=i: rtf.allreduce(
                tf.fill([4], float(i + rank)), op="sum", name=f"allreduce{i}"
            )
            for i in range(8)
        },
        "scalar": lambda: rtf.allreduce(tf.constant(float(rank)), op="sum", name="scalar"),
        "grouped": lambda: rtf.grouped_allreduce(
            [tf.ones([3]) * rank, tf.fill([2], rank)], op="sum", name="grouped"
        ),
        "allgather": lambda: rtf.allgather(rows, name="allgather"),
        "broadcast": lambda: rtf.broadcast(tf.fill([2], rank), root_rank=size - 1, name="bcast"),
        "alltoall": lambda: rtf.alltoall(matrix, name="alltoall")[1],
        "reducescatter": lambda: rtf.reducescatter(matrix, op="sum", name="reducescatter"),
    }
    ranks_sum = sum(range(size))
    expected = {
        **{f"allreduce{i}": np.full(4, size * i + ranks_sum, np.float32) for i in range(8)},
        "scalar": np.full((), ranks_sum, np.float32),
        "grouped": [np.full(3, ranks_sum, np.float32), np.full(2, ranks_sum, np.int32)],
        "allgather": np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(size)]),
        "broadcast": np.full(2, size - 1, np.int32),
        "alltoall": np.full(size, 2, np.int32),
        "reducescatter": np.array_split(total, size)[rank],
    }
    # Each rank creates them in another order (rotated by its rank, odd ranks backwards),
    # so with one thread each rank's executor starts a different one first.
    order = list(builders)
    order = order[rank:] + order[:rank]
    if rank % 2:
        order.reverse()

    def build(keys: list[str] = order) -> dict[str, object]:
        return {key: builders[key]() for key in keys}

    def same(got: object, want: object) -> bool:
        if isinstance(want, list):
            return all(same(g, w) for g, w in zip(got, want, strict=True))
        got = np.asarray(got)
        return got.dtype == want.dtype and got.shape == want.shape and np.allclose(got, want)

    def matches(results: dict[str, object]) -> bool:
        wrong = [key for key, want in expected.items() if not same(results[key], want)]
        if wrong:
            print(f"rank {rank}: wrong results for {wrong}", file=sys.stderr)
        return not wrong

    # A TF1 session of one inter-op thread, two runs of every collective at once, then a
    # join (alone: a joined rank adds zeros to the others' collectives).
    with tf.Graph().as_default():
        fetches = build()
        joined = rtf.join()
        with tf.compat.v1.Session(config=ONE_THREAD) as session:
            check("session-run-1", lambda: matches(session.run(fetches)))
            check("session-run-2", lambda: matches(session.run(fetches)))
            check("session-join", lambda: 0 <= int(session.run(joined)) < size)

    # A mismatch fails the step with FailedPreconditionError, as eagerly; the ranks stay
    # in step.
    with tf.Graph().as_default():
        wrong = rtf.allreduce(tf.ones([2 + rank]), name="mismatch")
        gathered = rtf.allgather(tf.constant([rank]), name="in-step")
        with tf.compat.v1.Session(config=ONE_THREAD) as session:
            check(
                "session-mismatch",
                lambda: raises(
                    lambda: session.run(wrong), tf.errors.FailedPreconditionError, "shapes"
                ),
            )
            check("session-in-step", lambda: session.run(gathered).tolist() == list(range(size)))

    # Horovod's TF1 training: one allreduce per gradient (unnamed), the variables from
    # rank 0 by the hook, under MonitoredTrainingSession with one inter-op thread.
    with tf.Graph().as_default():
        weights = [
            tf.compat.v1.get_variable(f"w{i}", initializer=tf.fill([3], float(rank + 1)))
            for i in range(12)
        ]
        loss = sum(tf.reduce_sum(w) for w in weights) * float(rank + 1)
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        grads = optimizer.compute_gradients(loss, var_list=weights)
        reduced = [(rtf.allreduce(g), v) for g, v in grads]
        step = optimizer.apply_gradients(
            reduced, global_step=tf.compat.v1.train.get_or_create_global_step()
        )
        with tf.compat.v1.train.MonitoredTrainingSession(
            hooks=[rtf.BroadcastVariablesHook(0)], config=ONE_THREAD
        ) as session:
            for _ in range(3):
                session.run(step)
            values = session.run(weights)
        mean = sum(r + 1 for r in range(size)) / size
        check("tf1-training", lambda: np.allclose(values, 1.0 - 3 * 0.1 * mean))

    # tf.function: its ops run on the eager context's pool, one thread here. A function
    # runs its stateful ops in program order (as eagerly), so the ranks create them in the
    # same order there.
    check("function", lambda: matches(tf.function(lambda: build(list(builders)))()))
    check("function-join", lambda: 0 <= int(tf.function(rtf.join)()) < size)
    (outdir / f"threads-{rank}.json").write_text(json.dumps(checks))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
