"""tf.compat.v1 MonitoredTrainingSession code with Horovod's BroadcastGlobalVariablesHook.
``python hvd_tf1_hook.py OUTDIR`` writes OUTDIR/hook-<rank>.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

import ringplug.horovod.tensorflow as hvd  # noqa: E402


def main(outdir: Path) -> None:
    hvd.init()
    tf.compat.v1.disable_eager_execution()
    weights = tf.compat.v1.get_variable(
        "weights", initializer=tf.constant([1.0, 2.0, 3.0]) * (hvd.rank() + 1)
    )
    step = tf.compat.v1.train.get_or_create_global_step()
    hooks = [hvd.BroadcastGlobalVariablesHook(0)]
    with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as session:
        values = session.run(weights).tolist()
        global_step = int(session.run(step))
    (outdir / f"hook-{hvd.rank()}.json").write_text(
        json.dumps({"weights": values, "step": global_step})
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
