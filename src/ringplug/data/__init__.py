"""Variable-length data (OCR, speech) over ranks: whole samples per rank, batches of similar
lengths, and the same number of batches on every rank; epochs that resume where they
stopped, with as many ranks or another number.

- `plan_batches`, `trained_samples`: the framework-neutral plan (numpy only).
- `DistributedBucketSampler`, `pad_collate`, `global_mean_scale`: for torch DataLoaders and
  Lightning (they import torch on first use).
- `ElasticSampler`: torch's ``DistributedSampler``, resumable mid-epoch by another number
  of ranks (imports torch on first use).
- `ringplug.keras.bucketed_dataset`: the same plan as a tf.data pipeline.
"""

from __future__ import annotations

from typing import Any

from .plan import Plan, pad_numpy, plan_batches, trained_samples

_TORCH_NAMES = {
    "DistributedBucketSampler": "torch_sampler",
    "global_mean_scale": "torch_sampler",
    "pad_collate": "torch_sampler",
    "ElasticSampler": "elastic_sampler",
}


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        import importlib

        return getattr(importlib.import_module(f".{_TORCH_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'ringplug.data' has no attribute {name!r}")


__all__ = [
    "DistributedBucketSampler",
    "ElasticSampler",
    "Plan",
    "global_mean_scale",
    "pad_collate",
    "pad_numpy",
    "plan_batches",
    "trained_samples",
]
