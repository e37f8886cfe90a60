"""Worker: RingStrategy(zero=1/2), sharded optimizer state in Lightning
(tests/test_lightning_zero.py).

``python lightning_zero.py job OUTDIR [CHECKPOINT]`` under ringrun: every case fits in turn in
the same ranks with ``zero=0``, ``1`` and ``2``, and each rank writes OUTDIR/zero-RANK.json:
per case and stage, the largest weight difference from the ``zero=0`` fit relative to the
largest weight, whether the ranks ended bitwise identical, and the optimizer-state and
gradient bytes this rank holds. The data make every step's global batch the same whatever
the number of ranks: an epoch is one optimizer step over the 12 rows of a table, and the
table is chosen by the epoch (so a run on 3 ranks and one on 2 train the same steps).
The "adam" fits with ``zero=0`` and ``zero=2`` save a checkpoint after fitting
(OUTDIR/adam-zeroZ-P.ckpt); rank 0 writes the ``zero=0`` fit's weights to
OUTDIR/uninterrupted-P.pt. On 3 ranks a ``zero=2`` fit of RESUME_AT epochs leaves
OUTDIR/resume.ckpt (ModelCheckpoint); given CHECKPOINT (such a file), the ranks resume from it
with ``zero=2`` and fit on to STEPS. Last, an LBFGS fit with ``zero=1``, which must be refused.

``python lightning_zero.py plain CHECKPOINT OUTDIR``: one process, a plain Trainer (ringplug
not imported) resumes CHECKPOINT on the whole batch and writes OUTDIR/plain.pt (its weights,
and whether ringplug stayed out).

``python lightning_zero.py alone OUTDIR``: one process, no ranks: the registered names in
both Lightning packages, LightningCLI configs, and the refusals that come before any rank
trains; writes OUTDIR/alone.json.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import lightning as L  # noqa: N812 - the name Lightning's docs use
import torch
from torch.utils.data import DataLoader, TensorDataset

STEPS, RESUME_AT, GLOBAL_BATCH = 20, 10, 12
CLIP_NORM, CLIP_VALUE = 0.05, 0.002  # below the gradients here: every step clips
# Adam's epsilon: with torch's 1e-8 its first steps go by the sign of each gradient element,
# and an element near zero turns the rounding of a sum taken in another order (3 ranks, 2
# ranks, one process) into 1e-4 of the weights; with 1e-3 the three agree to 2e-7.
EPS = 1e-3
# What each case changes (Trainer arguments, and the optimizers in configure_optimizers).
CASES: dict[str, dict] = {
    "adam": {},
    "clip-norm": {"gradient_clip_val": CLIP_NORM, "gradient_clip_algorithm": "norm"},
    "clip-value": {"gradient_clip_val": CLIP_VALUE, "gradient_clip_algorithm": "value"},
    "accumulate": {"accumulate_grad_batches": 2},
    "bf16": {"precision": "bf16-mixed"},
    "manual": {},  # manual optimization, two optimizers, each clipped by norm
}


def table() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (STEPS, 12, 8) and targets (STEPS, 12, 4): step s trains on row s."""
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(STEPS, GLOBAL_BATCH, 8, generator=generator)
    return inputs, torch.randn(STEPS, GLOBAL_BATCH, 4, generator=generator)


def make_net() -> torch.nn.Sequential:
    torch.manual_seed(42)
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, 32)]
    for _ in range(6):
        layers += [torch.nn.Tanh(), torch.nn.Linear(32, 32)]
    layers += [torch.nn.Tanh(), torch.nn.Linear(32, 4)]
    return torch.nn.Sequential(*layers)


class Net(L.LightningModule):
    def __init__(self, case: str = "adam") -> None:
        super().__init__()
        self.case = case
        self.net = make_net()
        self.inputs, self.targets = table()
        self.automatic_optimization = case != "manual"
        self.before_clipping: list[float] = []  # the whole gradients' norm or largest value

    def loss(self, batch) -> torch.Tensor:
        (index,) = batch
        step = self.current_epoch  # one optimizer step per epoch
        prediction = self.net(self.inputs[step][index])
        return torch.nn.functional.mse_loss(prediction.float(), self.targets[step][index])

    def training_step(self, batch, _):
        loss = self.loss(batch)
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            self.clip_gradients(optimizer, CLIP_NORM, "norm")
            optimizer.step()
        return None

    def on_before_optimizer_step(self, optimizer) -> None:
        grads = [p.grad.reshape(-1) for p in self.parameters() if p.grad is not None]
        if grads:  # with zero=0 every gradient: what clipping sees
            whole = torch.cat(grads)
            value = whole.norm() if self.case == "clip-norm" else whole.abs().max()
            self.before_clipping.append(float(value))

    def configure_optimizers(self):
        if self.case == "lbfgs":
            return torch.optim.LBFGS(self.parameters())
        if self.case == "manual":
            layers = list(self.net)
            first = [p for m in layers[:7] for p in m.parameters()]
            rest = [p for m in layers[7:] for p in m.parameters()]
            return [
                torch.optim.Adam(first, lr=0.01, eps=EPS),
                torch.optim.SGD(rest, lr=0.05, momentum=0.9),
            ]
        if self.case.startswith("clip"):
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, eps=EPS, weight_decay=0.1)
        else:
            optimizer = torch.optim.Adam(self.parameters(), lr=0.01, eps=EPS)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def loader(size: int, accumulate: int = 1) -> DataLoader:
    batch = GLOBAL_BATCH // size // accumulate
    return DataLoader(TensorDataset(torch.arange(GLOBAL_BATCH)), batch_size=batch)


def trainer_for(strategy, epochs: int, callbacks=(), **settings) -> L.Trainer:
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1 if strategy == "auto" else "auto",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **settings,
    )


def flat(model: Net) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.net.parameters()])


def bytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# ---------------------------------------------------------------------- job (under ringrun)
def fit(case: str, zero: int, epochs: int = STEPS, ckpt_path=None, callbacks=()) -> dict:
    import ringplug
    from ringplug.lightning import RingStrategy

    settings = CASES.get(case, {})
    # The "adam" case picks its strategy by the registered names.
    names = {0: "ring", 1: "ring_zero1", 2: "ring_zero2"}
    strategy = names[zero] if case == "adam" else RingStrategy(zero=zero)
    trainer = trainer_for(strategy, epochs, callbacks, **settings)
    model = Net(case)
    size = ringplug.size()
    trainer.fit(
        model, loader(size, settings.get("accumulate_grad_batches", 1)), ckpt_path=ckpt_path
    )
    optimizers = trainer.strategy.optimizers
    return {
        "trainer": trainer,
        "model": model,
        "flat": flat(model),
        "strategy": f"{type(trainer.strategy).__name__}(zero={trainer.strategy.zero})",
        "steps": trainer.global_step,
        "state_bytes": bytes_of(
            v for o in optimizers for state in o.state.values() for v in state.values()
        ),
        "grad_bytes": bytes_of(p.grad for p in model.parameters()),
        "before_clipping": model.before_clipping,
    }


def compare(mine: torch.Tensor, expected: torch.Tensor) -> dict:
    import ringplug.torch as rpt

    everyone = rpt.allgather(mine.unsqueeze(0))
    return {
        "relative_difference": float((mine - expected).abs().max() / expected.abs().max()),
        "ranks_identical": all(torch.equal(row, everyone[0]) for row in everyone),
    }


def one_process_adam() -> torch.Tensor:
    """Plain torch, no Lightning: the "adam" case on the whole batch of each step."""
    net = make_net()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01, eps=EPS)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    inputs, targets = table()
    for step in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(inputs[step]), targets[step]).backward()
        optimizer.step()
        schedule.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def job(outdir: Path, checkpoint: Path | None) -> None:
    import ringplug

    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    report: dict = {}
    for case in CASES:
        unsharded = fit(case, 0)
        if case == "adam":
            unsharded["trainer"].save_checkpoint(outdir / f"adam-zero0-{size}.ckpt")
            if rank == 0:
                torch.save(unsharded["flat"], outdir / f"uninterrupted-{size}.pt")
            report["adam-zero0"] = compare(unsharded["flat"], one_process_adam())
        for zero in (1, 2):
            sharded = fit(case, zero)
            if case == "adam" and zero == 2:
                sharded["trainer"].save_checkpoint(outdir / f"adam-zero2-{size}.ckpt")
            report[f"{case}-zero{zero}"] = {
                **compare(sharded["flat"], unsharded["flat"]),
                "strategy": sharded["strategy"],
                "steps": sharded["steps"],
                "state_bytes": sharded["state_bytes"],
                "grad_bytes": sharded["grad_bytes"],
                "unsharded_state_bytes": unsharded["state_bytes"],
                "unsharded_grad_bytes": unsharded["grad_bytes"],
                "unsharded_before_clipping": unsharded["before_clipping"],
            }
        if case == "adam":
            uninterrupted = unsharded
    if size == 3:
        from lightning.pytorch.callbacks import ModelCheckpoint

        saver = ModelCheckpoint(dirpath=outdir, filename="resume", every_n_epochs=RESUME_AT)
        fit("adam", 2, epochs=RESUME_AT, callbacks=[saver])
    if checkpoint is not None:
        resumed = fit("adam", 2, ckpt_path=checkpoint)
        report["resumed"] = {
            **compare(resumed["flat"], uninterrupted["flat"]),
            "steps": resumed["steps"],
            "state_bytes": resumed["state_bytes"],
            "unsharded_state_bytes": uninterrupted["state_bytes"],
        }
    try:
        fit("lbfgs", 1, epochs=1)
        report["lbfgs_refused"] = None
    except ValueError as error:
        report["lbfgs_refused"] = str(error)
    (outdir / f"zero-{rank}.json").write_text(json.dumps(report, indent=1))


# ---------------------------------------------------------------------- plain (one process)
def plain(checkpoint: Path, outdir: Path) -> None:
    trainer = trainer_for("auto", STEPS)
    model = Net("adam")
    trainer.fit(model, loader(1), ckpt_path=checkpoint)
    optimizer = trainer.optimizers[0]
    torch.save(
        {
            "flat": flat(model),
            "steps": trainer.global_step,
            "strategy": type(trainer.strategy).__name__,
            "optimizer_class": type(optimizer).__name__,
            "ringplug_imported": any(name.startswith("ringplug") for name in sys.modules),
        },
        outdir / "plain.pt",
    )


# ---------------------------------------------------------------------- alone (no ranks)
def refused(make) -> str | None:
    try:
        make()
    except (ValueError, SystemExit) as error:
        return str(error)
    return None


def alone(outdir: Path) -> None:
    import pytorch_lightning as pl
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.plugins.precision import MixedPrecision

    import ringplug  # registers the names with both Lightning packages
    from ringplug.lightning import RingStrategy

    report: dict = {"names": {}}
    for package, trainer_class in (("lightning", L.Trainer), ("pytorch_lightning", pl.Trainer)):
        for name in ("ring", "ring_zero1", "ring_zero2"):
            strategy = trainer_class(strategy=name, accelerator="cpu", logger=False).strategy
            report["names"][f"{package}:{name}"] = [type(strategy).__module__, strategy.zero]

    config = outdir / "config.yaml"
    report["cli"] = {}
    for form, strategy in {
        "by-name": "ring_zero2",
        "class-path": {"class_path": "ringplug.lightning.RingStrategy", "init_args": {"zero": 1}},
    }.items():
        config.write_text(json.dumps({"trainer": {"strategy": strategy, "logger": False}}))
        cli = LightningCLI(Net, run=False, args=["--config", str(config)])
        report["cli"][form] = [type(cli.trainer.strategy).__name__, cli.trainer.strategy.zero]
    config.write_text(
        json.dumps(
            {
                "trainer": {
                    "strategy": {
                        "class_path": "ringplug.lightning.RingStrategy",
                        "init_args": {"zero": 3},
                    }
                }
            }
        )  # fmt: skip
    )
    said = io.StringIO()
    with contextlib.redirect_stderr(said):  # jsonargparse prints its error, then exits
        exited = refused(lambda: LightningCLI(Net, run=False, args=["--config", str(config)]))
    report["cli_zero_3"] = None if exited is None else said.getvalue().partition("error:")[2]

    report["zero_3"] = refused(lambda: RingStrategy(zero=3))
    report["zero_true"] = refused(lambda: RingStrategy(zero=True))
    report["zero2_fp16"] = refused(lambda: RingStrategy(zero=2, compression="fp16"))
    report["zero1_fp16"] = refused(lambda: RingStrategy(zero=1, compression="fp16"))
    # A gradient scaler (what precision="16-mixed" brings on a GPU), in a world of one.
    scaler = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    for zero in (2, 1):
        trainer = L.Trainer(
            strategy=RingStrategy(zero=zero), plugins=[scaler], accelerator="cpu", devices=1,
            max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip
        report[f"scaler_zero{zero}"] = refused(lambda t=trainer: t.fit(Net("adam"), loader(1)))
    report["world"] = ringplug.size()
    (outdir / "alone.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "job":
        job(Path(args[0]), Path(args[1]) if len(args) > 1 else None)
    elif mode == "plain":
        plain(Path(args[0]), Path(args[1]))
    else:
        alone(Path(args[0]))
