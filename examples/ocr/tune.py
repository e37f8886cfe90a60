"""Find hyperparameters for the OCR example: plain torch, one process, no ringplug.

Trains `CRNN` with CTC on `TextLines` and prints one row per epoch (train loss, validation
character error rate, seconds), so that runs can be compared by eye. One row of work here
is what two ranks of the distributed example share between them, so the distributed run's
global batch is ``--batch-size`` and each rank's batch is half of it.

Example:
    python tune.py --train-size 8000 --epochs 14 --batch-size 64 --lr 3e-3  # the defaults
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ringplug.data import pad_collate
from ringplug.demos.ocr import CRNN, TextLines, cer, decode_greedy, labels_to_text


def bucketed_batches(
    lengths: Sequence[int], batch_size: int, generator: random.Random
) -> Iterator[list[int]]:
    """Batches of indices of similar length, in random order.

    Indices are sorted by length plus a little noise (so batches change from epoch to
    epoch), cut into batches of ``batch_size``, and the batches shuffled.
    """
    spread = 0.1 * (max(lengths) - min(lengths))
    order = sorted(range(len(lengths)), key=lambda i: lengths[i] + generator.uniform(0, spread))
    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    generator.shuffle(batches)
    yield from batches


def evaluate(model: CRNN, data: TextLines, batch_size: int) -> tuple[float, list[str]]:
    """Character error rate of greedy decoding over ``data``, and a few decoded lines."""
    model.eval()
    predictions: list[list[int]] = []
    targets: list[list[int]] = []
    order = sorted(range(len(data)), key=data.lengths.__getitem__)
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            images, widths, labels, label_lengths, _ = pad_collate(
                [data[i] for i in order[start : start + batch_size]]
            )
            log_probs, frames = model(images, widths)
            predictions += decode_greedy(log_probs, frames)
            targets += [
                row[:n].tolist() for row, n in zip(labels, label_lengths.tolist(), strict=True)
            ]
    # Show misread lines first: they say more about the model than lines read right.
    pairs = sorted(zip(predictions, targets, strict=True), key=lambda pair: pair[0] == pair[1])[:4]
    examples = [f"{labels_to_text(t)!r} -> {labels_to_text(p)!r}" for p, t in pairs]
    return cer(predictions, targets), examples


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-size", type=int, default=8000)
    parser.add_argument("--val-size", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=14)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--schedule", choices=["constant", "cosine", "onecycle"],
                        default="cosine", help="learning rate over the run: fixed, cosine "
                        "decay to 0, or OneCycleLR (warm-up, then decay)")  # fmt: skip
    parser.add_argument("--channels", type=int, nargs=4, default=[16, 32, 64, 96])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--clip", type=float, default=5.0, help="gradient norm limit")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and batches")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    batch_order = random.Random(args.seed)

    start = time.perf_counter()
    train = TextLines(args.train_size, seed=0)
    val = TextLines(args.val_size, seed=1)
    model = CRNN(channels=tuple(args.channels), hidden=args.hidden)
    parameters = sum(p.numel() for p in model.parameters())
    steps_per_epoch = -(-len(train) // args.batch_size)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    if args.schedule == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=args.epochs * steps_per_epoch
        )
    elif args.schedule == "onecycle":
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch
        )
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    print(f"{vars(args)}")
    print(f"parameters {parameters}, setup {time.perf_counter() - start:.1f} s, "
          f"{steps_per_epoch} steps per epoch")  # fmt: skip
    print(f"{'epoch':>5} {'loss':>8} {'val_cer':>8} {'train_s':>8} {'val_s':>6} {'total_s':>8}")

    total = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        start = time.perf_counter()
        loss_sum = 0.0
        for indices in bucketed_batches(train.lengths, args.batch_size, batch_order):
            images, widths, labels, label_lengths, _ = pad_collate([train[i] for i in indices])
            log_probs, frames = model(images, widths)
            loss = ctc(log_probs, labels, frames, label_lengths)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            loss_sum += loss.item()
        train_seconds = time.perf_counter() - start
        start = time.perf_counter()
        error_rate, examples = evaluate(model, val, batch_size=64)
        val_seconds = time.perf_counter() - start
        total += train_seconds + val_seconds
        print(f"{epoch:>5} {loss_sum / steps_per_epoch:>8.4f} {error_rate:>8.4f} "
              f"{train_seconds:>8.1f} {val_seconds:>6.1f} {total:>8.1f}", flush=True)  # fmt: skip
    print("samples:", "; ".join(examples))


if __name__ == "__main__":
    main()
