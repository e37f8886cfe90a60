"""`ringplug-bench sampler`: padding and epoch time of DistributedBucketSampler against
torch's DistributedSampler with random batching, on the OCR example's text lines.

Padding is counted over a whole epoch of every rank's batches (padded pixels of width per
real one); the epoch time is one process (one torch thread) training the example's CRNN on
one rank's share of a smaller set, both ways, in alternating order.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterable, Sequence

from .common import Record, write_job_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=20_000, help="text lines in the epoch")
    parser.add_argument("--ranks", type=int, default=2, help="ranks the epoch is split over")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--timed-samples", type=int, default=1024, help="lines in the training epoch that is timed"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per sampler")
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")


def random_batches(
    count: int, batch_size: int, ranks: int, rank: int, seed: int = 0, epoch: int = 0
) -> list[list[int]]:
    """What a DataLoader over torch's DistributedSampler(shuffle=True) batches."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(
        range(count), num_replicas=ranks, rank=rank, shuffle=True, seed=seed
    )
    sampler.set_epoch(epoch)
    order = list(sampler)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def bucket_batches(
    lengths: Sequence[int], batch_size: int, ranks: int, rank: int, epoch: int = 0
) -> list[list[int]]:
    from ..data import DistributedBucketSampler

    sampler = DistributedBucketSampler(
        lengths, batch_size=batch_size, num_replicas=ranks, rank=rank, seed=0
    )
    sampler.set_epoch(epoch)
    return list(sampler)


def padding_per_real(lengths: Sequence[int], batches: Iterable[list[int]]) -> float:
    padded = real = 0
    for batch in batches:
        widths = [lengths[i] for i in batch]
        padded += max(widths) * len(widths)
        real += sum(widths)
    return (padded - real) / real


def _train_epoch(dataset, batches: list[list[int]], model, optimizer) -> float:
    import torch

    from ..data import pad_collate

    loss_fn = torch.nn.CTCLoss(zero_infinity=True)
    start = time.perf_counter()
    for batch in batches:
        images, widths, targets, target_lengths, _ = pad_collate([dataset[i] for i in batch])
        log_probs, lengths = model(images, widths)
        loss = loss_fn(log_probs, targets, lengths, target_lengths)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    import torch

    from ..demos.ocr import CRNN, TextLines

    torch.set_num_threads(1)
    lengths = TextLines(args.samples, seed=0).lengths
    per_rank = {
        "bucket": [
            bucket_batches(lengths, args.batch_size, args.ranks, r) for r in range(args.ranks)
        ],
        "random": [
            random_batches(len(lengths), args.batch_size, args.ranks, r) for r in range(args.ranks)
        ],
    }
    padding = {
        impl: padding_per_real(lengths, [b for rank in ranks for b in rank])
        for impl, ranks in per_rank.items()
    }
    counts = {impl: [len(rank) for rank in ranks] for impl, ranks in per_rank.items()}

    timed = TextLines(args.timed_samples, seed=1)
    plans = {
        "bucket": bucket_batches(timed.lengths, args.batch_size, args.ranks, 0),
        "random": random_batches(len(timed), args.batch_size, args.ranks, 0),
    }
    seconds: dict[str, list[float]] = {"bucket": [], "random": []}
    for repeat in range(args.repeats):
        for impl in ("bucket", "random") if repeat % 2 == 0 else ("random", "bucket"):
            torch.manual_seed(0)
            model = CRNN()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            seconds[impl].append(_train_epoch(timed, plans[impl], model, optimizer))
    medians = {impl: statistics.median(values) for impl, values in seconds.items()}

    print(
        f"# ringplug-bench sampler: {args.samples} OCR text lines over {args.ranks} ranks, "
        f"batch size {args.batch_size}"
    )
    print(
        "# impl     padded px per real px   batches per rank   epoch s (1 rank's share of "
        f"{args.timed_samples} lines, median of {args.repeats})"
    )
    for impl in ("bucket", "random"):
        print(f"  {impl:8s} {padding[impl]:21.3f}   {str(counts[impl]):>16s}   {medians[impl]:.2f}")
    padding_ratio = padding["random"] / padding["bucket"]
    time_ratio = medians["random"] / medians["bucket"]
    print(f"# padding: random / bucket = {padding_ratio:.1f}x less with buckets (target >= 2)")
    print(f"# epoch time: random / bucket = {time_ratio:.2f}x")
    if args.json:
        records = [
            Record(
                impl,
                "epoch",
                "float32",
                0,
                args.ranks,
                medians[impl],
                0.0,
                0.0,
                args.repeats,
                {
                    "padding_per_real": padding[impl],
                    "batches_per_rank": counts[impl],
                    "epoch_seconds": seconds[impl],
                },
            )
            for impl in ("bucket", "random")
        ]
        write_job_json(
            args.json,
            "sampler",
            {
                "samples": args.samples,
                "ranks": args.ranks,
                "batch_size": args.batch_size,
                "padding_ratio": padding_ratio,
                "epoch_time_ratio": time_ratio,
            },
            records,
        )
    return 0
