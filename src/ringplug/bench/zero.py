"""`ringplug-bench zero`: sharded optimizer state (ZeRO 1 and 2) against the unsharded optimizer.

Run under the launcher: ``ringrun -np 2 ringplug-bench zero``. Every rank builds the same
transformer-shaped model (token embedding, pre-norm encoder layers of width 512 with 8 heads
and a 2048-wide feed-forward, a vocabulary head) once per stage, with
``DistributedOptimizer(Adam, zero=0, 1 and 2)`` (1 and 2 with each ``zero_layout``), and
times training steps (zero_grad, forward, backward, step) of them side by side, interleaved
in rounds. It reports, per
rank, the bytes the optimizer state holds and the gradient bytes held after a step (the
largest over the ranks), and the median step time of the slowest rank, with ratios to
``zero=0``. ``--params`` picks the number of layers nearest the wanted size; ``--layout``
builds zero=1 and 2 with whole tensors, flat slices or both.
"""

from __future__ import annotations

import argparse
import resource

import numpy as np

import ringplug

from .common import Record, environment, measure_side_by_side, median, write_json

WIDTH, HEADS, FEEDFORWARD, VOCABULARY = 512, 8, 2048, 8192


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params",
        default="25M",
        help="model size, like 25M or 100M (the layer count nearest to it); default 25M, "
        "which fits three copies per rank on a small machine",
    )
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--sequence", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--budget", type=float, default=6.0, help="seconds of steps per stage")
    parser.add_argument(
        "--only",
        type=int,
        choices=(0, 1, 2),
        help="build and time this stage alone, so that the peak resident memory printed "
        "(ru_maxrss, largest over the ranks) is that stage's own",
    )
    parser.add_argument(
        "--layout",
        choices=("whole", "flat", "both"),
        default="both",
        help="how zero=1 and 2 share out the parameters (zero_layout): whole tensors, flat "
        "slices of each bucket, or both side by side (default)",
    )
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")


def parameter_count(text: str) -> int:
    """``"25M"`` -> 25,000,000 (decimal K, M, G)."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        message = f"ringplug-bench zero: --params takes a count like 25M, not {text!r}"
    raise SystemExit(message)


def layers_for(params: int) -> int:
    per_layer = 4 * WIDTH * WIDTH + 2 * WIDTH * FEEDFORWARD + 9 * WIDTH + FEEDFORWARD
    ends = 2 * VOCABULARY * WIDTH + VOCABULARY
    return max(1, round((params - ends) / per_layer))


def build(layers: int):  # -> torch.nn.Module
    import torch

    torch.manual_seed(0)

    class Transformer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCABULARY, WIDTH)
            layer = torch.nn.TransformerEncoderLayer(
                WIDTH, HEADS, FEEDFORWARD, dropout=0.0, batch_first=True, norm_first=True
            )
            self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(WIDTH, VOCABULARY)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens)))

    return Transformer()


def compare_layouts(optimizer, budget: float, rank: int, size: int) -> list[Record]:
    """The reduce-scatter of one step's gradients (zero=2's buckets), each bucket cut by
    owner (whole tensors, as built) and cut into equal slices (flat slices), side by side.

    Everything else a step does costs the same in both layouts (each rank steps 1/p of the
    elements, to within the deal's 1%, and the weight allgather moves the same bytes), so
    this is where they differ."""
    import torch

    from ringplug.core.collectives import reducescatter_in_place_async
    from ringplug.core.transport.ring import even_bounds

    buckets = [
        ([torch.zeros(p.numel()).numpy() for p in bucket.by_owner], bucket.counts)
        for bucket in optimizer._ringplug_buckets
    ]
    cuts = {"whole": [owners for _, owners in buckets], "flat": []}
    for _, owners in buckets:
        bounds = even_bounds(sum(owners), size)
        cuts["flat"].append([bounds[r + 1] - bounds[r] for r in range(size)])

    def reduce_scatter(layout: str) -> None:
        handles = [
            reducescatter_in_place_async(arrays, counts, name=f"bench.{layout}.{index}")
            for index, ((arrays, _), counts) in enumerate(zip(buckets, cuts[layout], strict=True))
        ]
        for handle in handles:
            handle.wait()

    runs = {"whole": lambda: reduce_scatter("whole"), "flat": lambda: reduce_scatter("flat")}
    times = measure_side_by_side(runs, budget_s=budget / 3, min_iters=5, max_iters=400, warmup=2)
    total = sum(sum(owners) for _, owners in buckets)
    # The ring's time bound where the network, not memory, is the limit: each of its p-1
    # steps takes as long as the longest block.
    longest = sum(max(owners) for _, owners in buckets)
    even = sum(-(-sum(owners) // size) for _, owners in buckets)
    if rank == 0:
        whole, flat = median(times["whole"]), median(times["flat"])
        print(
            f"# reduce-scatter of a step's gradients ({total * 4 / 1e6:.1f} MB, "
            f"{len(buckets)} buckets): whole tensors {whole * 1e3:.1f} ms, flat slices "
            f"{flat * 1e3:.1f} ms ({whole / flat:.3f}x); longest block whole/flat "
            f"{longest / even:.3f}x (the time ratio where the network is the limit)"
        )
    return [
        Record(
            impl=f"reducescatter-{layout}",
            op="reducescatter",
            dtype="float32",
            bytes=total * 4,
            ranks=size,
            time_s=median(times[layout]),
            algbw_gbs=0.0,
            busbw_gbs=0.0,
            iterations=len(times[layout]),
            extra={"longest_block_ratio": longest / even},
        )
        for layout in runs
    ]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run(args: argparse.Namespace) -> int:
    import torch

    import ringplug.torch as rpt

    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    layers = layers_for(parameter_count(args.params))
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, VOCABULARY, (args.batch, args.sequence), generator=generator)
    targets = torch.randint(0, VOCABULARY, (args.batch, args.sequence), generator=generator)
    setups = {}
    layouts = ("whole", "flat") if args.layout == "both" else (args.layout,)
    stages = [(0, "whole")] + [(zero, layout) for layout in layouts for zero in (1, 2)]
    if args.only is not None:
        stages = [(zero, layout) for zero, layout in stages if zero == args.only]
    for zero, layout in stages:
        model = build(layers)
        optimizer = rpt.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-4),
            named_parameters=model.named_parameters(),
            zero=zero,
            zero_layout=layout,
        )
        setups[f"zero={zero}" + (" flat" if layout == "flat" else "")] = (model, optimizer)

    def step(model, optimizer) -> None:
        optimizer.zero_grad()
        logits = model(tokens)
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCABULARY), targets.reshape(-1)
        ).backward()
        optimizer.step()

    runs = {name: (lambda m=m, o=o: step(m, o)) for name, (m, o) in setups.items()}
    times = measure_side_by_side(runs, budget_s=args.budget, min_iters=5, max_iters=200, warmup=2)
    params = sum(p.numel() for p in next(iter(setups.values()))[0].parameters())
    peak = ringplug.allreduce(
        np.array([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0]), op=ringplug.Max
    )[0]
    held = {}
    for name, (model, optimizer) in setups.items():
        state = _bytes(
            v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        )
        grads = _bytes(p.grad for p in model.parameters() if p.grad is not None)
        # Flat layout, stage 2: the slices of gradients that other ranks own the rest of.
        grads += _bytes(
            x.tensor.grad
            for x in getattr(optimizer, "_ringplug_pieces", [])
            if x.param.grad is None and x.tensor.grad is not None
        )
        weights = _bytes(model.parameters())
        held[name] = ringplug.allreduce(
            torch.tensor([state, grads, weights], dtype=torch.float64).numpy(), op=ringplug.Max
        )
    base = "zero=0" if "zero=0" in setups else next(iter(setups))
    if rank == 0:
        base_time = median(times[base])
        base_state = held[base][0]
        print(
            f"# {params / 1e6:.1f} M parameters ({layers} layers), Adam fp32, {size} ranks, "
            f"batch {args.batch}x{args.sequence} tokens per rank; bytes: largest over ranks"
        )
        print(
            f"{'impl':>11} {'step ms':>9} {'x ' + base:>9} {'state MB':>9} {'x ' + base:>9} "
            f"{'grads MB':>9} {'weights MB':>10} {'held MB':>8} {'iters':>6}"
        )
    records = []
    for name in setups:
        state, grads, weights = (float(x) for x in held[name])
        seconds = median(times[name])
        if rank == 0:
            print(
                f"{name:>11} {seconds * 1e3:9.1f} {seconds / base_time:9.3f} "
                f"{state / 1e6:9.1f} {state / base_state:9.3f} {grads / 1e6:9.1f} "
                f"{weights / 1e6:10.1f} {(state + grads + weights) / 1e6:8.1f} "
                f"{len(times[name]):6d}"
            )
        records.append(
            Record(
                impl=name,
                op="train-step",
                dtype="float32",
                bytes=int(weights),
                ranks=size,
                time_s=seconds,
                algbw_gbs=0.0,
                busbw_gbs=0.0,
                iterations=len(times[name]),
                extra={
                    "optimizer_state_bytes": state,
                    "gradient_bytes": grads,
                    "weight_bytes": weights,
                    "parameters": params,
                    "layers": layers,
                    "peak_rss_bytes": peak,
                },
            )
        )
    if rank == 0:
        built = "all stages built" if len(setups) > 1 else f"{base} alone"
        print(f"# peak resident memory of a rank (ru_maxrss, {built}): {peak / 1e6:.0f} MB")
    if rank == 0 and any(name != "zero=0" for name in setups):
        # Adam's unsharded state: two moments per element and a step count per tensor.
        tensors = len(list(next(iter(setups.values()))[0].parameters()))
        ideal = (8 * params + 4 * tensors) / size
        shares = ", ".join(
            f"{name} {held[name][0] / ideal:.3f}" for name in setups if name != "zero=0"
        )
        print(f"# state per rank / (unsharded / {size}): {shares} (target <= 1.05)")
    if "zero=2" in setups and size > 1:
        records += compare_layouts(setups["zero=2"][1], args.budget, rank, size)
    if args.json and rank == 0:
        write_json(args.json, "zero", environment({"layers": layers}), records)
    for _, optimizer in setups.values():
        optimizer.detach_hooks()
    return 0
