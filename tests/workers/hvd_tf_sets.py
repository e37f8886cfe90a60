"""Multi-rank worker: Horovod's TensorFlow process sets (``hvd.*`` names only), even and odd
ranks, eagerly, inside ``tf.function`` and in a TF1 graph session, against numpy.

``python hvd_tf_sets.py OUTDIR`` writes OUTDIR/tf_sets-<rank>.json: {check: true/false}.
Every check's name starts with "tfps-".
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from checklist import checker, raises

import ringplug.horovod.tensorflow as hvd  # noqa: E402


def main(outdir: Path) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks: dict[str, bool] = {}
    check = checker(checks)

    evens = hvd.add_process_set(range(0, size, 2))
    odds = hvd.add_process_set(range(1, size, 2))
    mine, other = (evens, odds) if rank % 2 == 0 else (odds, evens)
    members = list(mine.ranks)
    here = members.index(rank)  # this rank's place in its set
    root = members[-1]  # a world rank; at 3 ranks the evens' root 2 is their rank 1
    check(
        "tfps-size-and-included-ops",
        lambda: (
            int(hvd.size_op(process_set_id=mine.process_set_id)) == len(members)
            and int(hvd.process_set_included_op(process_set_id=mine.process_set_id)) == 1
            and int(hvd.process_set_included_op(process_set_id=other.process_set_id)) == 0
        ),
    )

    # Eagerly, every collective against numpy over the set's ranks.
    values = {r: np.array([r + 1.0, 10.0 * (r + 1), -(r + 1.0)], np.float32) for r in range(size)}
    mine_t = tf.constant(values[rank])
    check(
        "tfps-eager-allreduce-sum",
        lambda: np.array_equal(
            hvd.allreduce(mine_t, op=hvd.Sum, process_set=mine).numpy(),
            sum(values[r] for r in members),
        ),
    )
    check(
        "tfps-eager-allreduce-average-max",
        lambda: (
            np.allclose(
                hvd.allreduce(mine_t, process_set=mine).numpy(),
                np.mean([values[r] for r in members], axis=0),
            )
            and np.array_equal(
                hvd.allreduce(mine_t, op=hvd.Max, process_set=mine).numpy(),
                np.max([values[r] for r in members], axis=0),
            )
        ),
    )
    check(
        "tfps-eager-integer-average-truncates",
        lambda: (
            hvd.allreduce(tf.constant([-7 * (rank + 1)]), process_set=mine).numpy().tolist()
            == [int(np.trunc(sum(-7 * (r + 1) for r in members) / len(members)))]
        ),
    )
    check(
        "tfps-eager-grouped-allreduce",
        lambda: all(
            np.array_equal(got.numpy(), want)
            for got, want in zip(
                hvd.grouped_allreduce(
                    [mine_t, tf.constant([rank], tf.int64)], op=hvd.Sum, process_set=mine
                ),
                [sum(values[r] for r in members), [sum(members)]],
                strict=True,
            )
        ),
    )
    rows = tf.fill([rank + 1, 2], float(rank))  # ranks give different numbers of rows
    gathered_want = np.concatenate([np.full([r + 1, 2], float(r)) for r in members])
    check(
        "tfps-eager-allgather",
        lambda: np.array_equal(hvd.allgather(rows, process_set=mine).numpy(), gathered_want),
    )
    check(
        "tfps-eager-grouped-allgather",
        lambda: all(
            np.array_equal(got.numpy(), want)
            for got, want in zip(
                hvd.grouped_allgather([rows, tf.constant([rank])], process_set=mine),
                [gathered_want, members],
                strict=True,
            )
        ),
    )
    check(
        "tfps-eager-broadcast-world-root",
        lambda: np.array_equal(
            hvd.broadcast(mine_t, root_rank=root, process_set=mine).numpy(), values[root]
        ),
    )
    variable = tf.Variable(values[rank])
    check(
        "tfps-eager-broadcast-variables",
        lambda: (
            hvd.broadcast_variables([variable], root_rank=root, process_set=mine) is None
            and np.array_equal(variable.numpy(), values[root])
        ),
    )
    # alltoall: rank r sends (k + 1) rows of value 100 r + k to its set's k-th member.
    splits = [k + 1 for k in range(len(members))]
    sent = np.concatenate([np.full([k + 1], 100.0 * rank + k) for k in range(len(members))])
    received, counts = hvd.alltoall(tf.constant(sent), splits=splits, process_set=mine)
    check(
        "tfps-eager-alltoall",
        lambda: (
            np.array_equal(
                received.numpy(),
                np.concatenate([np.full([here + 1], 100.0 * r + here) for r in members]),
            )
            and counts.numpy().tolist() == [here + 1] * len(members)
        ),
    )
    block = np.arange(2.0 * len(members) * 3).reshape(2 * len(members), 3)
    check(
        "tfps-eager-reducescatter",
        lambda: np.array_equal(
            hvd.reducescatter(
                tf.constant(block * (rank + 1)), op=hvd.Sum, process_set=mine
            ).numpy(),
            (block * sum(r + 1 for r in members))[2 * here : 2 * here + 2],
        ),
    )
    check(
        "tfps-eager-grouped-reducescatter",
        lambda: np.allclose(
            hvd.grouped_reducescatter([tf.constant(block * (rank + 1))], process_set=mine)[
                0
            ].numpy(),
            (block * np.mean([r + 1 for r in members]))[2 * here : 2 * here + 2],
        ),
    )
    check(
        "tfps-eager-objects",
        lambda: (
            hvd.broadcast_object({"from": rank}, root_rank=root, process_set=mine) == {"from": root}
            and hvd.allgather_object(rank, process_set=mine) == members
        ),
    )
    check("tfps-eager-barrier", lambda: hvd.barrier(process_set=mine) is None)

    # Gradients run on their forward's set, wherever the tape computes them.
    v = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        y = hvd.allreduce(v * (rank + 1), op=hvd.Sum, process_set=mine)
    check(
        "tfps-eager-allreduce-grad",
        lambda: tape.gradient(y, v).numpy().tolist() == [(rank + 1) * len(members)] * 2,
    )

    # Inside tf.function: graph ops that keep their set each time the function runs.
    @tf.function
    def step(a: tf.Tensor) -> tuple[tf.Tensor, ...]:
        with tf.GradientTape() as t:
            t.watch(a)
            gathered = hvd.allgather(a, process_set=mine)
            loss = tf.reduce_sum(gathered**2)
        summed = hvd.allreduce(a[:1], op=hvd.Sum, process_set=mine)
        world = hvd.allreduce(a[:1], op=hvd.Sum)
        return loss, t.gradient(loss, a), summed, world

    for run in (1, 2):
        loss, grad, summed, world = step(tf.fill([rank + 1], float(rank + 1)))
        check(
            f"tfps-function-run{run}",
            lambda loss=loss, grad=grad, summed=summed, world=world: (
                float(loss) == sum((r + 1) ** 3 for r in members)
                and grad.numpy().tolist() == [2.0 * (rank + 1)] * (rank + 1)
                and float(summed[0]) == sum(r + 1 for r in members)
                and float(world[0]) == sum(r + 1 for r in range(size))
            ),
        )

    # A TF1 session: the members build one set op more than the others before a world op;
    # the set's ops are named apart, so the world op's name agrees on every rank.
    graph = tf.Graph()
    with graph.as_default():
        if evens.included():
            extra = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, process_set=evens)
        set_sum = hvd.allreduce(tf.constant([rank + 1.0]), op=hvd.Sum, process_set=mine)
        set_root = hvd.broadcast(tf.constant([float(rank)]), root_rank=root, process_set=mine)
        swapped = hvd.alltoall(tf.constant(sent), splits=splits, process_set=mine)[0]
        world_sum = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
        fetches = [set_sum, set_root, swapped, world_sum]
        if evens.included():
            fetches.append(extra)
        with tf.compat.v1.Session(graph=graph) as session:
            results = [session.run(fetches) for _ in range(2)]
    check(
        "tfps-graph-session",
        lambda: all(
            result[0].tolist() == [sum(r + 1.0 for r in members)]
            and result[1].tolist() == [float(root)]
            and result[2].tolist() == received.numpy().tolist()
            and result[3].tolist() == [float(size)]
            and (not evens.included() or result[4].tolist() == [float(evens.size())])
            for result in results
        ),
    )

    # DistributedGradientTape on the evens: their average there, odd ranks' own gradient.
    x = tf.constant(float(rank))
    with tf.GradientTape() as g:
        g.watch(x)
        loss = x * x
    dx = hvd.DistributedGradientTape(g, process_set=evens).gradient(loss, [x])[0]
    want = 2.0 * np.mean(evens.ranks) if evens.included() else 2.0 * rank
    check("tfps-gradient-tape-on-evens", lambda: float(dx) == want)

    # Keras DistributedOptimizer on the evens: the same rule.
    weight = keras.Variable(np.zeros(1, np.float32))
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=evens)
    optimizer.apply_gradients([(tf.constant([float(rank)]), weight)])
    step_want = -np.mean(evens.ranks) if evens.included() else -float(rank)
    check("tfps-keras-optimizer-on-evens", lambda: float(weight.numpy()[0]) == step_want)

    # Refusals, at once and on every rank concerned.
    check(
        "tfps-nonmember-refused",
        lambda: (
            raises(
                lambda: hvd.allreduce(mine_t, process_set=other),
                tf.errors.InvalidArgumentError,
                "not a member",
            )
            and raises(
                lambda: hvd.allgather(rows, process_set=other),
                tf.errors.InvalidArgumentError,
                "not a member",
            )
        ),
    )
    outside = next(r for r in range(size) if r not in members) if size > 1 else None
    check(
        "tfps-root-outside-set-refused",
        lambda: raises(
            lambda: hvd.broadcast(mine_t, root_rank=outside, process_set=mine),
            tf.errors.InvalidArgumentError,
            "invalid root rank",
        ),
    )
    loose = hvd.ProcessSet([0])
    check(
        "tfps-unregistered-refused",
        lambda: raises(lambda: hvd.allreduce(mine_t, process_set=loose), ValueError, "registered"),
    )
    hvd.remove_process_set(odds)
    hvd.remove_process_set(evens)
    check(
        "tfps-removed-refused",
        lambda: raises(lambda: hvd.allreduce(mine_t, process_set=mine), ValueError, "removed"),
    )
    check(
        "tfps-removed-id-given-again",
        lambda: hvd.add_process_set(range(0, size, 2)).process_set_id == 1,
    )

    (outdir / f"tf_sets-{rank}.json").write_text(json.dumps(checks))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
