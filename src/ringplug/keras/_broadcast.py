"""Root's values into Keras variables on every rank (RingBroadcast, BackupAndRestore and the
Horovod layer's elastic states use it)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from .. import core


def broadcast_variables(variables: list[Any], root_rank: int = 0, name: str = "keras") -> None:
    """Assign root's values to `variables` on every rank (one broadcast per dtype)."""
    values = [keras.ops.convert_to_numpy(v) for v in variables]
    groups: dict[np.dtype, list[int]] = {}
    for index, value in enumerate(values):
        groups.setdefault(value.dtype, []).append(index)
    for dtype, indices in groups.items():
        flat = np.concatenate([values[i].reshape(-1) for i in indices])
        core.broadcast(flat, root_rank, out=flat, name=f"{name}.broadcast.{dtype}")
        offset = 0
        for i in indices:
            count = values[i].size
            variables[i].assign(flat[offset : offset + count].reshape(values[i].shape))
            offset += count
