"""Train a CRNN to read synthetic text lines with Lightning and RingStrategy.

    ringrun -np 2 python examples/ocr/train_lightning.py          # what `make demo` runs

Every rank renders its own text lines on the fly (no download). DistributedBucketSampler
gives each rank whole samples in batches of similar widths, with a budget of padded pixels
per batch and the same number of batches on every rank; `pad_collate` pads images and
label sequences for the CTC loss. Batches therefore hold different numbers of lines on
each rank, and `global_mean_scale` makes the loss the exact mean over every rank's lines.
Rank 0 shows the progress bar, prints the character error rate (CER) after every epoch and
writes the engine's timeline.
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from torch.utils.data import DataLoader

import ringplug
from ringplug.data import DistributedBucketSampler, global_mean_scale, pad_collate
from ringplug.demos.ocr import CRNN, TextLines, cer, decode_greedy
from ringplug.lightning import RingStrategy


class Reader(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.model = CRNN()
        self.lr = lr
        self.ctc = torch.nn.CTCLoss(reduction="none", zero_infinity=True)
        self.errors = self.chars = 0

    def training_step(self, batch, _):
        images, widths, targets, target_lengths, _ = batch
        log_probs, lengths = self.model(images, widths)
        per_line = self.ctc(log_probs, targets, lengths, target_lengths)
        # Ranks hold different numbers of lines: scale the sum to the mean over all ranks.
        loss = per_line.sum() * global_mean_scale(len(images))
        self.log("loss", per_line.mean(), prog_bar=True)
        return loss

    def validation_step(self, batch, _):
        images, widths, targets, target_lengths, _ = batch
        log_probs, lengths = self.model(images, widths)
        predicted = decode_greedy(log_probs, lengths)
        truth = [t[:n].tolist() for t, n in zip(targets, target_lengths, strict=True)]
        self.errors += cer(predicted, truth) * int(target_lengths.sum())
        self.chars += int(target_lengths.sum())

    def on_validation_epoch_end(self) -> None:
        counts = torch.tensor([self.errors, self.chars], dtype=torch.float64)
        totals = self.trainer.strategy.reduce(counts, reduce_op="sum")
        self.errors = self.chars = 0
        rate = float(totals[0] / totals[1])
        self.log("cer", rate, sync_dist=False)  # already the same on every rank
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            print(f"\nepoch {self.current_epoch + 1}: character error rate {rate:.4f}", flush=True)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        steps = int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=8000, help="training lines (all ranks)")
    parser.add_argument("--val-lines", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument(
        "--max-pixels",
        type=int,
        default=4300,
        help="padded pixels of width per batch and rank (about 32 lines)",
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--timeline", default="ocr-timeline.json")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    args = parser.parse_args()

    train = TextLines(args.lines, seed=0)
    val = TextLines(args.val_lines, seed=1)
    loaders = [
        DataLoader(data, collate_fn=pad_collate, num_workers=args.workers,
                   batch_sampler=DistributedBucketSampler(data.lengths, max_tokens=args.max_pixels,
                                                          shuffle=shuffle))
        for data, shuffle in ((train, True), (val, False))
    ]  # fmt: skip
    torch.manual_seed(0)
    reader = Reader(args.lr)
    trainer = L.Trainer(strategy=RingStrategy(timeline=args.timeline), accelerator="cpu",
                        max_epochs=args.epochs, gradient_clip_val=5.0, logger=False,
                        enable_checkpointing=False, num_sanity_val_steps=0,
                        enable_model_summary=False)  # fmt: skip
    start = time.perf_counter()
    trainer.fit(reader, *loaders)
    if trainer.is_global_zero:
        seconds = time.perf_counter() - start
        print(f"final character error rate {float(trainer.callback_metrics['cer']):.4f} after "
              f"{args.epochs} epochs on {ringplug.size()} ranks in {seconds:.0f} s")  # fmt: skip
        print(f"timeline of rank 0's engine: {args.timeline} (open it in https://ui.perfetto.dev "
              "or chrome://tracing)")  # fmt: skip


if __name__ == "__main__":
    main()
