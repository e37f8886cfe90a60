"""Multi-rank worker: one job of a mid-epoch resume. Trains `STOP` batches of epoch 2 (or, with
-1, the rest of the epoch) through a DataLoader with workers, a collective per batch as
training would do; rank 0 then saves the sampler's state for the next job, which may have
another number of ranks and loads it on every rank.

``python data_resume.py KIND STOP OUTDIR`` (KIND: bucket or elastic) writes
OUTDIR/<KIND>-<ranks>-<rank>.json and OUTDIR/<KIND>-state.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import ringplug
import ringplug.torch as rpt
from ringplug.data import DistributedBucketSampler, ElasticSampler

COUNT = 101  # not divisible by 2 or 3 ranks
EPOCH = 2


class Ids(Dataset):
    """Sample i is i, so the batches say which samples were trained."""

    def __init__(self) -> None:
        self.lengths = [1 + (i * 7919 % 97) for i in range(COUNT)]

    def __len__(self) -> int:
        return COUNT

    def __getitem__(self, i: int) -> int:
        return i


def main(kind: str, stop: int, outdir: Path) -> None:
    ringplug.init()
    dataset = Ids()
    # The world is ringplug's: no num_replicas or rank given.
    if kind == "bucket":
        sampler = DistributedBucketSampler(dataset.lengths, max_tokens=400, seed=5)
        loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2)
    else:
        sampler = ElasticSampler(dataset, seed=5, batch_size=4)
        loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2)
    state_file = outdir / f"{kind}-state.pt"
    if state_file.exists():
        sampler.load_state_dict(torch.load(state_file))
    sampler.set_epoch(EPOCH)
    ids, batches = [], 0
    length = len(loader)
    for batch in loader:
        if batches == stop:
            break  # the workers have fetched batches ahead: the trained count is `batches`
        rpt.allreduce(torch.ones(1), op="sum", name="step")
        ids.extend(batch.tolist())
        batches += 1
    if ringplug.rank() == 0:
        state = sampler.state_dict(batches_done=sampler.resumed_batches + batches)
        torch.save(state, state_file)
    report = {"ids": ids, "batches": batches, "len": length}
    name = f"{kind}-{ringplug.size()}-{ringplug.rank()}.json"
    (outdir / name).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
