"""Multi-rank worker: Lightning fit with RingStrategy equals one process on the union.

``python lightning_fit.py SCENARIO[,SCENARIO...] OUTDIR``, in the Lightning
`lightning_namespace` picks: the scenarios fit one after the other in the same ranks (one
job pays Lightning's imports once), each writing OUTDIR/SCENARIO-RANK.json.
Each rank also trains a plain torch reference on the full global batches, locally, and
compares. Scenarios: plain, by-name (``strategy="ring"``), accumulate (2 micro-batches per
step), clip (gradient clipping by norm), batchnorm (``sync_batchnorm=True``: the reference
is plain BatchNorm on the union) and buffers (plain BatchNorm: only the buffers' agreement is
checked) and compiled (``trainer.fit(torch.compile(model))``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning_namespace import L, RingStrategy, Strategy, other_namespace_imported
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ringplug  # registers strategy="ring" with the Lightning the script imports
import ringplug.torch as rpt

PER_RANK, STEPS = 4, 6
CLIP = 0.05  # well below the gradient norms here, so clipping changes every step


def make_net(scenario: str) -> torch.nn.Sequential:
    if scenario in ("batchnorm", "buffers"):
        return torch.nn.Sequential(
            torch.nn.Linear(6, 12),
            torch.nn.BatchNorm1d(12),
            torch.nn.Tanh(),
            torch.nn.Linear(12, 2),
        )
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))


class Regressor(L.LightningModule):
    def __init__(self, scenario: str) -> None:
        super().__init__()
        self.scenario = scenario
        torch.manual_seed(ringplug.rank() + 10)  # different on every rank: setup broadcasts
        self.net = make_net(scenario)
        self.after_backward_norms: list[float] = []

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.scenario != "compiled":  # Lightning compiles training_step too; self.log
            self.log("train_loss", loss, sync_dist=True, on_step=True)  # breaks dynamo there
        return loss

    def on_after_backward(self) -> None:
        norm = torch.cat([p.grad.reshape(-1) for p in self.parameters()]).norm()
        self.after_backward_norms.append(float(norm))

    def configure_optimizers(self):
        # A scheduler made before the strategy wraps the optimizer still steps it, and the
        # wrapped one (see the reference's schedule).
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def data(size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    rows = PER_RANK * size * STEPS
    return TensorDataset(
        torch.randn(rows, 6, generator=generator), torch.randn(rows, 2, generator=generator)
    )


def reference(scenario: str, size: int, root_state: dict, accumulate: int) -> torch.nn.Module:
    """Plain torch, one process: each step's batch is the union of every rank's batch.

    Lightning shuffles the training data with a DistributedSampler (seed 0, epoch 0);
    torch's sampler gives the same per-rank order here.
    """
    net = make_net(scenario)
    net.load_state_dict(root_state)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.2)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    dataset = data(size)
    orders = [
        list(DistributedSampler(dataset, num_replicas=size, rank=r, shuffle=True, seed=0))
        for r in range(size)
    ]
    for step in range(STEPS // accumulate):
        optimizer.zero_grad()
        for micro in range(accumulate):
            k = step * accumulate + micro
            rows = [i for order in orders for i in order[k * PER_RANK : (k + 1) * PER_RANK]]
            x, y = dataset[rows]
            (torch.nn.functional.mse_loss(net(x), y) / accumulate).backward()
        if scenario == "clip":
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        optimizer.step()
        schedule.step()
    return net


def main(scenario: str, outdir: Path) -> None:
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    accumulate = 2 if scenario == "accumulate" else 1
    model = Regressor(scenario)
    fitted = torch.compile(model, backend="eager") if scenario == "compiled" else model
    torch.manual_seed(10)  # rank 0's initial weights, for the reference
    root_state = {k: v.clone() for k, v in make_net(scenario).state_dict().items()}
    strategy = "ring" if scenario == "by-name" else RingStrategy()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=CLIP if scenario == "clip" else None,
        sync_batchnorm=scenario == "batchnorm",
    )
    loader = DataLoader(data(size), batch_size=PER_RANK, shuffle=False)
    engine = ringplug.core.runtime.engine()
    before = engine.collectives_run
    trainer.fit(fitted, loader)
    collectives = engine.collectives_run - before
    flat = torch.cat([t.detach().reshape(-1).float() for t in model.net.state_dict().values()])
    ref = reference(scenario, size, root_state, accumulate)
    expected = torch.cat([t.detach().reshape(-1).float() for t in ref.state_dict().values()])
    everyone = rpt.allgather(flat.unsqueeze(0))
    logged = float(trainer.callback_metrics.get("train_loss", 0.0))
    all_logged = ringplug.allgather_object(logged)
    buffers = torch.cat(
        [b.detach().reshape(-1).double() for b in model.net.buffers()]
        or [torch.zeros(1, dtype=torch.float64)]
    )
    all_buffers = rpt.allgather(buffers.unsqueeze(0))
    report = {
        # As DDP: rank 0's buffers are handed to every rank (before steps and at the end).
        "buffers_identical": all(torch.equal(row, all_buffers[0]) for row in all_buffers),
        "matches_one_process": bool(torch.allclose(flat, expected, atol=1e-5, rtol=0)),
        "max_difference": float((flat - expected).abs().max()),
        "ranks_identical": all(torch.equal(row, everyone[0]) for row in everyone),
        "logged_equal": len(set(all_logged)) == 1,
        "norms_equal": len(
            {
                tuple(n)
                for n in ringplug.allgather_object(
                    [round(v, 6) for v in model.after_backward_norms]
                )
            }
        )
        == 1,
        "strategy": type(trainer.strategy).__name__,
        "strategy_of_this_lightning": isinstance(trainer.strategy, Strategy),
        "other_lightning_imported": other_namespace_imported(),
        "sampler_replicas": trainer.train_dataloader.sampler.num_replicas
        if hasattr(trainer.train_dataloader, "sampler")
        else None,
        "collectives": collectives,
        "torch_threads": torch.get_num_threads(),
        # After fit the synchronized layers are plain BatchNorm again (as DDP leaves them).
        "layer_types": sorted({type(m).__name__ for m in model.net}),
        "compiled": getattr(model, "_compiler_ctx", None) is not None,
    }
    (outdir / f"{scenario}-{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    for name in sys.argv[1].split(","):
        main(name, Path(sys.argv[2]))
