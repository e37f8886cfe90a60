"""Multi-rank worker: DistributedBucketSampler in a plain DataLoader (with workers), in
Lightning (DataLoader made outside and inside the hook), and the exact loss normalization
for token-budget batches.

``python data_sampler.py SCENARIO[,SCENARIO...] OUTDIR`` runs the scenarios one after the
other in the same ranks, each writing OUTDIR/<scenario>-<rank>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import ringplug
import ringplug.torch as rpt
from ringplug.data import DistributedBucketSampler, global_mean_scale, pad_collate

COUNT = 101  # not divisible by 2 or 3 ranks, so the sampler must equalize


class Lines(Dataset):
    """Sample i: an input of skewed length whose values are i, and a target sequence that
    is a function of i, so that any misalignment shows."""

    def __init__(self, count: int = COUNT) -> None:
        self.lengths = [1 + (i * 7919 % 97) ** 2 // 40 for i in range(count)]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int):
        return torch.full((2, self.lengths[i]), float(i)), target(i), i


def target(i: int) -> torch.Tensor:
    return torch.full((1 + i % 5,), i % 10 + 1, dtype=torch.int64)


def check_batches(loader, dataset: Lines) -> dict:
    """Walk one epoch; a collective per batch, as training would (unequal counts hang)."""
    ids, aligned, batches = [], True, 0
    for inputs, widths, targets, target_lengths, batch_ids in loader:
        rpt.allreduce(torch.ones(1), op="sum", name="step")
        batches += 1
        for row, i in enumerate(batch_ids.tolist()):
            ids.append(i)
            aligned &= int(widths[row]) == dataset.lengths[i]
            aligned &= bool((inputs[row, :, : dataset.lengths[i]] == i).all())
            aligned &= torch.equal(targets[row, : int(target_lengths[row])], target(i))
    return {"ids": ids, "aligned": bool(aligned), "batches": batches}


def scenario_loader() -> dict:
    dataset = Lines()
    sampler = DistributedBucketSampler(dataset.lengths, max_tokens=2000, seed=3)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=pad_collate, num_workers=2)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epochs.append(check_batches(loader, dataset))
    return {"epochs": epochs, "repeated": sampler.repeated_samples}


def lightning_fit(inside_hook: bool) -> dict:
    import lightning as L

    dataset = Lines()
    seen: list[int] = []

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch, _):
            inputs, widths, targets, target_lengths, ids = batch
            seen.extend(ids.tolist())
            return (self.weight * inputs.mean()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self):
            return make_loader()

    def make_loader() -> DataLoader:
        sampler = DistributedBucketSampler(dataset.lengths, batch_size=8, seed=1)
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=pad_collate)

    trainer = L.Trainer(
        strategy="ring",
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if inside_hook:
        trainer.fit(Model())
    else:
        trainer.fit(Model(), train_dataloaders=make_loader())
    return {
        "ids": seen,
        "batches": trainer.global_step,
        "kept": type(trainer.train_dataloader.batch_sampler).__name__,
    }


def scenario_normalize() -> dict:
    """Token-budget batches hold different sample counts per rank; scaling the summed loss
    by global_mean_scale trains like one process on the union with the plain mean."""
    dataset = Lines(48)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    reference = torch.nn.Linear(2, 1)
    reference.load_state_dict(model.state_dict())
    optimizer = rpt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    size = ringplug.size()
    samplers = [
        DistributedBucketSampler(
            dataset.lengths, max_tokens=3000, num_replicas=size, rank=r, seed=5
        )
        for r in range(size)
    ]
    counts = []

    def loss_of(net, batch_ids) -> torch.Tensor:
        x = torch.stack([dataset[i][0].mean(1) for i in batch_ids]) / 100
        y = torch.tensor([[float(i % 7)] for i in batch_ids])
        return ((net(x) - y) ** 2).reshape(-1)

    for batches in zip(*samplers, strict=True):
        mine = batches[ringplug.rank()]
        counts.append(len(mine))
        optimizer.zero_grad()
        (loss_of(model, mine).sum() * global_mean_scale(len(mine))).backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        loss_of(reference, [i for b in batches for i in b]).mean().backward()
        ref_optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    return {
        "matches_one_process": bool(torch.allclose(flat, expected, atol=1e-6)),
        "max_difference": float((flat - expected).abs().max()),
        "counts": counts,
        "steps": len(counts),
    }


def main(scenario: str, outdir: Path) -> None:
    ringplug.init()
    runs = {
        "loader": scenario_loader,
        "lightning-outside": lambda: lightning_fit(inside_hook=False),
        "lightning-hook": lambda: lightning_fit(inside_hook=True),
        "normalize": scenario_normalize,
    }
    report = runs[scenario]()
    (outdir / f"{scenario}-{ringplug.rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    for name in sys.argv[1].split(","):
        main(name, Path(sys.argv[2]))
