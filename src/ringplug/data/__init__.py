"""Variable-length data (OCR, speech) over ranks: whole samples per rank, batches of similar
lengths, and the same number of batches on every rank.

- `plan_batches`: the framework-neutral plan (numpy only).
- `DistributedBucketSampler`, `pad_collate`, `global_mean_scale`: for torch DataLoaders and
  Lightning (they import torch on first use).
- `ringplug.keras.bucketed_dataset`: the same plan as a tf.data pipeline.
"""

from __future__ import annotations

from typing import Any

from .plan import Plan, pad_numpy, plan_batches

_TORCH_NAMES = ("DistributedBucketSampler", "global_mean_scale", "pad_collate")


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from . import torch_sampler

        return getattr(torch_sampler, name)
    raise AttributeError(f"module 'ringplug.data' has no attribute {name!r}")


__all__ = [
    "DistributedBucketSampler",
    "Plan",
    "global_mean_scale",
    "pad_collate",
    "pad_numpy",
    "plan_batches",
]
