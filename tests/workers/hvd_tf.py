"""Multi-rank worker: Horovod's TensorFlow API (``hvd.*`` names only) eagerly, inside
``tf.function`` and in a TF1 graph session, with gradients, as Horovod defines them.

``python hvd_tf.py OUTDIR`` writes OUTDIR/tf-<rank>.json: {check: true/false}.
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

    ranks_sum = sum(r + 1 for r in range(size))

    # Eagerly: values, integer Average truncated toward zero, gradient reduced too.
    x = tf.constant([1.0, 2.0]) * (rank + 1)
    check(
        "eager-sum",
        lambda: hvd.allreduce(x, op=hvd.Sum).numpy().tolist() == [ranks_sum, 2.0 * ranks_sum],
    )
    ints = tf.constant([-7, 5, 9]) * (rank + 1)
    check(
        "eager-int-average",
        lambda: (
            hvd.allreduce(ints).numpy().tolist()
            == np.trunc(np.array([-7, 5, 9]) * ranks_sum / size).astype(int).tolist()
        ),
    )
    v = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        y = hvd.allreduce(v * (rank + 1), op=hvd.Sum)
    check("eager-grad", lambda: tape.gradient(y, v).numpy().tolist() == [(rank + 1) * size] * 2)

    # Inside tf.function: graph ops with gradients, in program order.
    @tf.function
    def step(a):
        with tf.GradientTape() as t:
            t.watch(a)
            gathered = hvd.allgather(a)
            loss = tf.reduce_sum(gathered**2)
        root = hvd.broadcast(tf.ones(2) * (rank + 1), 0)
        return loss, t.gradient(loss, a), root, hvd.alltoall(tf.range(2.0 * size))

    loss, grad, root, swapped = step(tf.ones(rank + 1) * (rank + 1))
    check("function-allgather", lambda: float(loss) == sum((r + 1) ** 3 for r in range(size)))
    # d loss / d a = 2a on every rank's copy; the average of the ranks' gradients is 2a too.
    check(
        "function-allgather-grad", lambda: grad.numpy().tolist() == [2.0 * (rank + 1)] * (rank + 1)
    )
    check("function-broadcast", lambda: root.numpy().tolist() == [1.0, 1.0])
    check(
        "function-alltoall",
        lambda: (
            swapped.numpy().tolist() == [float(2 * rank + k) for _ in range(size) for k in range(2)]
        ),
    )

    # DistributedGradientTape, eagerly and inside tf.function (IndexedSlices included).
    weight = tf.Variable(1.0)
    table = tf.Variable(tf.zeros([4, 2]))

    def loss_fn():
        rows = tf.gather(table, [rank % 4, 3])
        return weight * 3.0 * (rank + 1) + tf.reduce_sum(rows) * (rank + 1)

    with tf.GradientTape() as tape:
        total = loss_fn()
    grads = hvd.DistributedGradientTape(tape).gradient(total, [weight, table])
    mean = ranks_sum / size
    check("tape-dense", lambda: abs(float(grads[0]) - 3.0 * mean) < 1e-6)
    check(
        "tape-indexed-slices",
        lambda: (
            isinstance(grads[1], tf.IndexedSlices)
            and np.allclose(tf.convert_to_tensor(grads[1]).numpy()[3], [mean] * 2)
        ),
    )

    @tf.function
    def tape_step():
        with tf.GradientTape() as t:
            total = loss_fn()
        return hvd.DistributedGradientTape(t, sparse_as_dense=True).gradient(total, [weight, table])

    in_function = tape_step()
    check(
        "tape-in-function",
        lambda: (
            abs(float(in_function[0]) - 3.0 * mean) < 1e-6
            and np.allclose(in_function[1].numpy()[3], [mean] * 2)
        ),
    )

    # Horovod's TF2 training loop: a tf.function step with the tape, and the variables
    # broadcast inside it after the first step (the model and the optimizer's).
    keras.utils.set_random_seed(10 + rank)
    mnist_like = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)]
    )
    adam = keras.optimizers.Adam(0.01 * size)
    crossentropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(images, labels, first_batch):
        with tf.GradientTape() as t:
            value = crossentropy(labels, mnist_like(images, training=True))
        t = hvd.DistributedGradientTape(t)
        grads = t.gradient(value, mnist_like.trainable_variables)
        adam.apply_gradients(zip(grads, mnist_like.trainable_variables, strict=True))
        if first_batch:
            hvd.broadcast_variables(mnist_like.variables, root_rank=0)
            hvd.broadcast_variables(adam.variables, root_rank=0)
        return value

    data_rng = np.random.default_rng(rank)
    for batch in range(4):
        images = tf.constant(data_rng.normal(size=(8, 6)), tf.float32)
        labels = tf.constant(data_rng.integers(0, 3, 8))
        train_step(images, labels, batch == 0)
    flat = tf.concat([tf.reshape(v, [-1]) for v in mnist_like.variables], 0)
    everyone = hvd.allgather(flat[None]).numpy()
    check("tf2-loop-ranks-identical", lambda: all(np.array_equal(e, everyone[0]) for e in everyone))

    # PartialDistributedGradientTape: local layers keep their own gradients.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    data = tf.ones([1, 3]) * (rank + 1)
    with tf.GradientTape() as tape:
        out = tf.reduce_sum(model(data))
    plain = tape.gradient(out, model.trainable_weights)
    with tf.GradientTape() as tape:
        out = tf.reduce_sum(model(data))
    partial = hvd.PartialDistributedGradientTape(tape, local_layers=[model.layers[1]])
    mixed = partial.gradient(out, model.trainable_weights)
    averaged = [hvd.allreduce(g) for g in plain]
    check(
        "partial-tape",
        lambda: (
            all(np.allclose(m, a) for m, a in zip(mixed[:2], averaged[:2], strict=True))
            and all(np.allclose(m, p / size) for m, p in zip(mixed[2:], plain[2:], strict=True))
        ),
    )

    # A local source named by the TF variable under a Keras variable is that variable.
    with tf.GradientTape() as tape:
        out = tf.reduce_sum(model(data))
    by_backend = hvd.DistributedGradientTape(tape)
    for weight_of_local in model.layers[1].trainable_weights:
        by_backend.register_local_source(weight_of_local.value)
    named_by_backend = by_backend.gradient(out, model.trainable_weights)
    check(
        "local-source-by-backend-variable",
        lambda: (
            all(np.allclose(m, a) for m, a in zip(named_by_backend[:2], averaged[:2], strict=True))
            and all(
                np.allclose(m, p / size)
                for m, p in zip(named_by_backend[2:], plain[2:], strict=True)
            )
        ),
    )

    # hvd.keras's object collectives take Horovod's arguments (obj, [root,] session, name).
    check(
        "keras-objects-horovod-arguments",
        lambda: (
            hvd.keras.allgather_object(rank, None, "objects") == list(range(size))
            and hvd.keras.broadcast_object(10 * (rank + 1), 0, None, "object") == 10
        ),
    )
    check(
        "keras-objects-refuse-non-sets",
        lambda: raises(
            lambda: hvd.keras.allgather_object(rank, process_set=object()),
            ValueError,
            "must be a hvd.ProcessSet",
        ),
    )

    # grouped_allreduce with a mix of dense tensors and IndexedSlices.
    slices = tf.IndexedSlices(
        tf.ones([1, 2]) * (rank + 1), tf.constant([rank]), tf.constant([4, 2])
    )
    dense, sparse = hvd.grouped_allreduce([tf.ones(3) * (rank + 1), slices], op=hvd.Sum)
    check(
        "grouped-mixed",
        lambda: (
            dense.numpy().tolist() == [float(ranks_sum)] * 3
            and tf.convert_to_tensor(sparse).numpy()[:size, 0].tolist()
            == [float(r + 1) for r in range(size)]
        ),
    )

    # A TF1 graph: many collectives in one session.run, in whatever order it runs them.
    graph = tf.Graph()
    with graph.as_default():
        outs = [hvd.allreduce(tf.ones([5]) * float(i), op=hvd.Sum) for i in range(24)]
        swap = hvd.alltoall(tf.range(size * 2))
        with tf.compat.v1.Session() as session:
            results, swapped = session.run([outs, swap])
    check(
        "graph-many-collectives",
        lambda: [r[0] for r in results] == [float(i * size) for i in range(24)],
    )
    check(
        "graph-alltoall",
        lambda: swapped.tolist() == [2 * rank + k for _ in range(size) for k in range(2)],
    )

    # A mismatch raises FailedPreconditionError on every rank; the ranks stay in step.
    check(
        "mismatch-failed-precondition",
        lambda: raises(
            lambda: hvd.allreduce(tf.ones(2 + rank)), tf.errors.FailedPreconditionError, "rank"
        ),
    )
    check("in-step", lambda: hvd.allgather_object(rank) == list(range(size)))

    # Inside tf.function and in a TF1 session too (shapes, then dtypes, differ by rank):
    # FailedPreconditionError with the same message on every rank, and the next graph
    # collective still matches.
    def graph_error(call) -> str:
        try:
            call()
        except tf.errors.OpError as exc:
            # TensorFlow wraps the op's message in where the node was defined (and the
            # node's name after it): keep ringplug's line.
            ours = [line for line in exc.message.splitlines() if "submitted" in line]
            return f"{type(exc).__name__}: {ours[0].strip() if ours else exc.message}"
        return "no error"

    @tf.function
    def mismatched_shapes():
        return hvd.allreduce(tf.ones(2 + rank))

    @tf.function
    def fine():
        return hvd.allreduce(tf.ones(2) * (rank + 1), op=hvd.Sum)

    seen_in_function = graph_error(mismatched_shapes)
    after_function = fine()
    graph = tf.Graph()
    with graph.as_default():
        mismatched_dtypes = hvd.allgather(tf.ones([1, 2], tf.float32 if rank else tf.int32))
        fine_in_graph = hvd.allreduce(tf.ones([2]) * (rank + 1), op=hvd.Sum)
        with tf.compat.v1.Session() as session:
            seen_in_session = graph_error(lambda: session.run(mismatched_dtypes))
            after_session = session.run(fine_in_graph)
    everyone = hvd.allgather_object((seen_in_function, seen_in_session))
    check(
        "function-mismatch-failed-precondition",
        lambda: (
            seen_in_function.startswith("FailedPreconditionError: ")
            and "does not match across ranks" in seen_in_function
            and "shapes (2,)" in seen_in_function
            and "shapes (3,)" in seen_in_function
        ),
    )
    check(
        "session-mismatch-failed-precondition",
        lambda: (
            seen_in_session.startswith("FailedPreconditionError: ")
            and "int32" in seen_in_session
            and "float32" in seen_in_session
        ),
    )
    check("graph-errors-same-on-every-rank", lambda: all(e == everyone[0] for e in everyone))
    check(
        "graph-in-step-after-errors",
        lambda: (
            after_function.numpy().tolist() == [float(ranks_sum)] * 2
            and after_session.tolist() == [float(ranks_sum)] * 2
        ),
    )

    # Arguments a collective refuses stay InvalidArgumentError in a graph, as eagerly.
    @tf.function
    def fractional_splits():
        return hvd.alltoall(tf.ones([2 * size]), splits=tf.constant([1.5] * size))

    check(
        "function-bad-splits-invalid-argument",
        lambda: graph_error(fractional_splits).startswith("InvalidArgumentError"),
    )
    check(
        "elastic-tf1-session-refused",
        lambda: raises(
            lambda: hvd.elastic.TensorFlowState([tf.Variable(1.0)], session=object()),
            NotImplementedError,
            "eagerly",
        ),
    )
    check(
        "eager-global-variables-refused",
        lambda: raises(
            lambda: hvd.broadcast_global_variables(0), RuntimeError, "broadcast_variables"
        ),
    )

    # Keras: PartialDistributedOptimizer, BroadcastGlobalVariablesCallback(local_variables),
    # load_model giving back a distributed optimizer with its state.
    keras.utils.set_random_seed(rank)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    local = net.layers[1]
    before_local = [w.numpy().copy() for w in local.weights]
    optimizer = hvd.keras.PartialDistributedOptimizer(
        keras.optimizers.SGD(0.1), local_layers=[local]
    )
    net.compile(optimizer=optimizer, loss="mse")
    features = np.full((4, 3), float(rank + 1), "float32")
    seen: dict[str, np.ndarray] = {}

    class AfterBroadcast(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen["local"] = local.kernel.numpy().copy()
            seen["shared"] = net.layers[0].kernel.numpy().copy()

    net.fit(
        features,
        np.ones((4, 1), "float32"),
        batch_size=4,
        epochs=1,
        verbose=0,
        callbacks=[
            hvd.keras.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local.weights),
            AfterBroadcast(),
        ],
    )
    shared = hvd.allgather(tf.reshape(net.layers[0].kernel, [1, -1])).numpy()
    mine = hvd.allgather(tf.reshape(local.kernel, [1, -1])).numpy()
    check(
        "partial-optimizer-shared-identical", lambda: all(np.allclose(s, shared[0]) for s in shared)
    )
    check("partial-optimizer-local-differs", lambda: not np.allclose(mine[0], mine[-1]))
    roots = hvd.broadcast(tf.constant(seen["shared"]), 0).numpy()
    check(
        "local-variables-kept-own-values",
        lambda: (
            np.array_equal(seen["local"], before_local[0]) and np.array_equal(seen["shared"], roots)
        ),
    )
    path = outdir / f"model-{rank}.keras"
    net.save(path)
    loaded = hvd.keras.load_model(path)
    check("load-model-distributed", lambda: hasattr(loaded.optimizer, "_ringplug"))
    check("load-model-state", lambda: int(loaded.optimizer.iterations.numpy()) == 1)

    (outdir / f"tf-{rank}.json").write_text(json.dumps(checks))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
