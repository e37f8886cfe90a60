"""The deal of sharded optimizer state (ZeRO), framework-neutral: which rank owns which tensor.

`ringplug.torch`'s ``DistributedOptimizer(zero=1|2)`` and `ringplug.keras`'s
``DistributedOptimizer(zero=1)`` deal the model's tensors out whole with `partition`, the same
deal on every rank, so that each rank's shard of the optimizer state is as close to 1/p of
the whole as whole tensors allow. Here, and not in either framework's package, so that a Keras
user on TensorFlow or JAX needs no torch.
"""

from __future__ import annotations


def partition(sizes: list[int], parts: int) -> list[int]:
    """The owner of each item: largest first, each to the least-loaded part (ties: lowest)."""
    loads = [0] * parts
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        part = min(range(parts), key=lambda r: (loads[r], r))
        owners[index] = part
        loads[part] += sizes[index]
    return owners
