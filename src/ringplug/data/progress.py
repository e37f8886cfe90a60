"""An epoch's progress as a checkpointable state: which samples the ranks have trained, so
that a restarted job, with the same or another number of ranks, trains the rest of the
epoch and each of its samples once (framework-neutral: numpy and the standard library).

The state is a plain dict of ints and strings (the trained samples as a base64 bitmap, one
bit per sample), so it survives ``pickle``, ``torch.save`` / ``torch.load`` (weights-only
loading included) and JSON alike. `DistributedBucketSampler` and `ElasticSampler` save and
load it through their ``state_dict`` / ``load_state_dict``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

VERSION = 1  # of the state's layout; raise it when the keys or their meaning change

_KEYS = ("version", "sampler", "epoch", "seed", "samples", "batches", "done", "done_samples")


@dataclasses.dataclass
class EpochProgress:
    """What is done of one epoch, over all ranks.

    Attributes:
        epoch, seed: the epoch and the seed of its order.
        done: one bool per sample: trained this epoch, by some rank.
        batches: the batches each rank has trained this epoch, those before a resume
            included (the count that Lightning keeps as ``batch_progress.current.completed``).
    """

    epoch: int
    seed: int
    done: np.ndarray
    batches: int = 0

    @classmethod
    def fresh(cls, epoch: int, seed: int, samples: int) -> EpochProgress:
        """An epoch with nothing done yet."""
        return cls(epoch, seed, np.zeros(samples, dtype=bool), 0)

    def remaining(self) -> np.ndarray:
        """The samples still to train, in id order."""
        return np.flatnonzero(~self.done)

    def with_trained(self, samples: np.ndarray, batches: int) -> EpochProgress:
        """This progress and `samples` trained in `batches` more batches per rank."""
        done = self.done.copy()
        done[samples] = True
        return EpochProgress(self.epoch, self.seed, done, self.batches + batches)

    def to_state(self, sampler: str, num_replicas: int) -> dict[str, Any]:
        """The state to checkpoint; `sampler` names the class it is for, `num_replicas` the
        ranks that saved it (said in the log of the resume)."""
        bitmap = np.packbits(self.done.astype(bool)).tobytes()
        return {
            "version": VERSION,
            "sampler": sampler,
            "epoch": int(self.epoch),
            "seed": int(self.seed),
            "samples": len(self.done),
            "num_replicas": int(num_replicas),
            "batches": int(self.batches),
            "done": base64.b64encode(bitmap).decode("ascii"),
            "done_samples": int(self.done.sum()),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], sampler: str, samples: int) -> EpochProgress:
        """The progress in `state`, checked against the sampler that loads it: a
        `sampler` over `samples` samples.

        Raises:
            ValueError: the state is not a sampler state, is of a newer or unknown
                version, of another kind of sampler, of a dataset of another length, or
                damaged.
        """
        if not isinstance(state, Mapping) or "version" not in state:
            raise ValueError(
                f"{sampler}.load_state_dict: this is not a sampler state (a dict with "
                f"{', '.join(repr(key) for key in _KEYS)}); pass what "
                f"{sampler}.state_dict() returned."
            )
        if state["version"] != VERSION:
            raise ValueError(
                f"{sampler}.load_state_dict: the state has version {state['version']!r}; this "
                f"ringplug reads version {VERSION}. Load it with the ringplug that saved it "
                "(or a newer one), or start the epoch afresh without it."
            )
        missing = [key for key in _KEYS if key not in state]
        if missing:
            raise ValueError(
                f"{sampler}.load_state_dict: the state lacks {', '.join(missing)}; pass what "
                f"{sampler}.state_dict() returned, unchanged."
            )
        if state["sampler"] != sampler:
            raise ValueError(
                f"{sampler}.load_state_dict: the state is a {state['sampler']}'s; its batch "
                f"counts mean that sampler's batches. Load it into a {state['sampler']}."
            )
        if state["samples"] != samples:
            raise ValueError(
                f"{sampler}.load_state_dict: the state is of a dataset of {state['samples']} "
                f"samples, but this sampler has {samples}. Load it into a sampler over the "
                "same dataset (the same samples in the same order), or start the epoch afresh "
                "without it (a state marks samples by their index)."
            )
        try:
            bitmap = np.frombuffer(base64.b64decode(state["done"], validate=True), np.uint8)
        except (binascii.Error, TypeError, ValueError) as error:
            raise ValueError(
                f"{sampler}.load_state_dict: the state's 'done' bitmap is not base64 ({error})."
            ) from None
        if len(bitmap) != (samples + 7) // 8:
            raise ValueError(
                f"{sampler}.load_state_dict: the state's 'done' bitmap has {len(bitmap)} bytes, "
                f"not the {(samples + 7) // 8} of {samples} samples; the state is damaged."
            )
        done = np.unpackbits(bitmap, count=samples).astype(bool)
        if int(done.sum()) != state["done_samples"]:
            raise ValueError(
                f"{sampler}.load_state_dict: the state's 'done' bitmap marks {int(done.sum())} "
                f"samples but says {state['done_samples']}; the state is damaged."
            )
        return cls(int(state["epoch"]), int(state["seed"]), done, int(state["batches"]))
