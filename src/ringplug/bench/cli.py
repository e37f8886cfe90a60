"""`ringplug-bench`: benchmarks that run ringplug and its competitors side by side.

Run the collective benchmarks under the launcher, e.g.
``ringrun -np 2 ringplug-bench allreduce --json allreduce.json``.
"""

from __future__ import annotations

import argparse

from . import algorithms, allreduce, fusion, sampler, scale, zero
from .autotune import compare as autotune_compare
from .frameworks import keras_compare, lightning_compare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ringplug-bench",
        description="Benchmarks that compare ringplug with MPI, torch gloo and the memory "
        "roofline in one run. Run under ringrun, e.g. `ringrun -np 2 ringplug-bench allreduce`.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    allreduce.add_arguments(
        commands.add_parser("allreduce", help="allreduce bandwidth and latency, 4 KiB to 256 MiB")
    )
    algorithms.add_arguments(
        commands.add_parser(
            "algorithms",
            help="the algorithm table's calibration (points, models, crossovers) and its "
            "allreduce against MPI's own",
        )
    )
    fusion.add_arguments(
        commands.add_parser(
            "fusion", help="the engine on ResNet-50's gradients, against single/copy/gloo"
        )
    )
    lightning_compare.add_arguments(
        commands.add_parser(
            "lightning", help="RingStrategy against DDP (gloo) on CPU; starts every job itself"
        )
    )
    autotune_compare.add_arguments(
        commands.add_parser(
            "autotune",
            help="autotune from a bad setting against the best of a hand-picked sweep, "
            "side by side in one job (--workload fusion or lightning)",
        )
    )
    keras_compare.add_arguments(
        commands.add_parser(
            "keras",
            help="ringplug against tf.distribute MultiWorkerMirroredStrategy on CPU; "
            "starts every job itself",
        )
    )
    sampler.add_arguments(
        commands.add_parser(
            "sampler",
            help="padding and epoch time: DistributedBucketSampler against "
            "DistributedSampler + random batches, on the OCR data",
        )
    )
    zero.add_arguments(
        commands.add_parser(
            "zero",
            help="sharded optimizer state (zero=1, 2) against zero=0: state bytes per rank "
            "and step time on a transformer-shaped model",
        )
    )
    scale.add_arguments(
        commands.add_parser(
            "scale",
            help="messages, bytes and engine CPU per step by number of ranks, a multi-host "
            "bed, and a fitted cost model's predictions; starts every job itself",
        )
    )
    args = parser.parse_args(argv)
    if args.command == "allreduce":
        return allreduce.run(args)
    if args.command == "algorithms":
        return algorithms.run(args)
    if args.command == "fusion":
        return fusion.run(args)
    if args.command == "lightning":
        return lightning_compare.run(args)
    if args.command == "autotune":
        return autotune_compare.run(args)
    if args.command == "keras":
        return keras_compare.run(args)
    if args.command == "sampler":
        return sampler.run(args)
    if args.command == "zero":
        return zero.run(args)
    if args.command == "scale":
        return scale.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
