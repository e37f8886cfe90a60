"""A Hydra app in the form of lightning-hydra-template (the most used Lightning template):
``@hydra.main``, everything built by ``hydra.utils.instantiate`` from the config (the strategy
too: nothing imports ringplug by name), rank-zero logging as the template's ``RankedLogger``,
a data module with ``prepare_data``, checkpoints and CSV logs in Hydra's output folder, and
fit then test from the best checkpoint.

Each rank writes ``rank-<rank>.json`` into its output folder: the rank variables as the
script's first line saw them, Lightning's ``rank_zero_only.rank`` after its import, the
folder itself, the working directory and the checkpoints it sees.
"""

import os

FIRST_LINE = {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}

import json  # noqa: E402
import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from lightning.pytorch.plugins.environments import TorchElasticEnvironment  # noqa: E402
from lightning.pytorch.utilities.rank_zero import rank_zero_only  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

AT_IMPORT = rank_zero_only.rank
log = logging.getLogger(__name__)


def rank_zero_log(message: str) -> None:
    """As the template's RankedLogger(rank_zero_only=True)."""
    if rank_zero_only.rank == 0:
        log.info(f"[rank: {rank_zero_only.rank}] {message}")


class Data(L.LightningDataModule):
    def __init__(self, data_dir: str) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)

    def prepare_data(self) -> None:  # the template's MNIST download
        self.data_dir.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=generator)
        torch.save((x, x.sum(1, keepdim=True)), self.data_dir / "data.pt")

    def setup(self, stage: str) -> None:
        self.tensors = torch.load(self.data_dir / "data.pt")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*self.tensors), batch_size=8)

    val_dataloader = test_dataloader = train_dataloader


class Model(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, _):
        self.log(
            "val/loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]), sync_dist=True
        )

    def test_step(self, batch, _):
        self.log(
            "test/loss",
            torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]),
            sync_dist=True,
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    rank_zero_log("Instantiating datamodule")
    data = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    rank_zero_log("Instantiating trainer")
    trainer = hydra.utils.instantiate(cfg.trainer)
    rank_zero_log("Starting training!")
    trainer.fit(model, datamodule=data)
    rank_zero_log("Starting testing!")
    trainer.test(model, datamodule=data, ckpt_path="best")
    output = Path(HydraConfig.get().runtime.output_dir)
    report = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "first_line": FIRST_LINE,
        "rank_zero_only_at_import": AT_IMPORT,
        "torchelastic_detected": TorchElasticEnvironment.detect(),
        "output_dir": str(output),
        "cwd": os.getcwd(),
        "checkpoints": sorted(p.name for p in (output / "checkpoints").glob("*.ckpt")),
    }
    (output / f"rank-{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
