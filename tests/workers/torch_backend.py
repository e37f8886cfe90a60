"""Multi-rank worker: torch.distributed on the ``ringplug`` backend, against references.

``python torch_backend.py SCENARIO[,SCENARIO...] OUTDIR``: the scenarios one after the other
in the same ranks, each in a torch.distributed of its own; each rank writes
OUTDIR/<scenario>-<rank>.json with a boolean per check (and the details of failures under
"details").

Scenarios:
- ``calls``: every torch.distributed call torch programs make, each compared with what it
  must give (computed here from the ranks' inputs), started with
  ``init_process_group("ringplug")`` and nothing else (no MASTER_ADDR, store or port).
- ``ddp``: torch's DistributedDataParallel on the backend against one process with the
  whole batch.
- ``torchmetrics``: a torchmetrics metric synced over the backend.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

import ringplug
import ringplug.torch  # noqa: F401 - registers the backend

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
]


def seeded(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(1, 6, shape, generator=generator).to(dtype)


def calls(rank: int, size: int, checks: dict[str, bool], details: dict[str, str]) -> None:
    checks["no-master-addr"] = "MASTER_ADDR" not in os.environ
    checks["backend-name"] = dist.get_backend() == "ringplug"
    checks["rank-and-size"] = (dist.get_rank(), dist.get_world_size()) == (
        ringplug.rank(),
        ringplug.size(),
    )

    ops = {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.AVG,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT,
    }
    for salt, dtype in enumerate(DTYPES):
        inputs = torch.stack([seeded(r, (3, 4), dtype, salt).double() for r in range(size)])
        references = {
            "sum": inputs.sum(0),
            "avg": inputs.mean(0),
            "max": inputs.amax(0),
            "min": inputs.amin(0),
            "product": inputs.prod(0),
        }
        for op_name, op in ops.items():
            if op_name == "avg" and not dtype.is_floating_point:
                continue
            tensor = seeded(rank, (3, 4), dtype, salt)
            dist.all_reduce(tensor, op=op)
            tolerance = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-6}.get(
                dtype, 1e-12
            )
            ok = tensor.dtype == dtype and torch.allclose(
                tensor.double(), references[op_name].to(dtype).double(), rtol=tolerance
            )
            checks[f"all_reduce/{op_name}/{dtype}"] = ok

    coalesced = [torch.full((3,), float(rank)), torch.full((2, 2), rank + 1.0)]
    dist.all_reduce_coalesced(coalesced)
    checks["all_reduce_coalesced"] = torch.equal(
        coalesced[0], torch.full((3,), float(sum(range(size))))
    ) and torch.equal(coalesced[1], torch.full((2, 2), float(sum(range(1, size + 1)))))

    # Synchronous calls of a form agreed before run their cycle on the caller's thread,
    # negotiated by the fast path (an idle engine thread that sees a peer's message first may
    # take one), with the same results.
    engine = ringplug.core.runtime.engine()
    before, repeated = engine.counters.fast_by_callers, []
    for step in range(4):
        tensor = torch.full((3, 4), float(rank + step))
        dist.all_reduce(tensor)
        expected = float(sum(r + step for r in range(size)))
        repeated.append(torch.equal(tensor, torch.full((3, 4), expected)))
    checks["all_reduce/repeated-without-request"] = all(repeated) and (
        engine.counters.fast_by_callers - before >= 2
    )

    for root in range(size):
        tensor = torch.full((5,), float(rank * 10 + root))
        dist.broadcast(tensor, src=root)
        checks[f"broadcast/root{root}"] = torch.equal(tensor, torch.full((5,), root * 11.0))

    slots = [torch.zeros(2, 3) for _ in range(size)]
    dist.all_gather(slots, torch.full((2, 3), float(rank)))
    checks["all_gather"] = all(
        torch.equal(s, torch.full((2, 3), float(r))) for r, s in enumerate(slots)
    )
    uneven = [torch.zeros(r + 1) for r in range(size)]
    dist.all_gather(uneven, torch.full((rank + 1,), float(rank)))
    checks["all_gather/uneven"] = all(
        torch.equal(s, torch.full((r + 1,), float(r))) for r, s in enumerate(uneven)
    )
    gathered = torch.zeros(size * 4, dtype=torch.int32)
    dist.all_gather_into_tensor(gathered, torch.arange(4, dtype=torch.int32) + 100 * rank)
    checks["all_gather_into_tensor"] = torch.equal(
        gathered, torch.cat([torch.arange(4, dtype=torch.int32) + 100 * r for r in range(size)])
    )

    rows = torch.stack([torch.arange(3.0) + 10 * r + rank for r in range(size)])
    reference = torch.stack([torch.arange(3.0) + 10 * r for r in range(size)]) * size + sum(
        range(size)
    )
    block = torch.zeros(3)
    dist.reduce_scatter_tensor(block, rows.reshape(-1))
    checks["reduce_scatter_tensor"] = torch.equal(block, reference[rank])
    block = torch.zeros(3)
    dist.reduce_scatter(block, list(rows.unbind(0)), op=dist.ReduceOp.MAX)
    checks["reduce_scatter/max"] = torch.equal(block, torch.arange(3.0) + 10 * rank + size - 1)

    sent = torch.arange(size * 2, dtype=torch.float64) + 100 * rank
    received = torch.zeros(size * 2, dtype=torch.float64)
    dist.all_to_all_single(received, sent)
    checks["all_to_all_single"] = torch.equal(
        received, torch.cat([torch.arange(2.0) + 2 * rank + 100 * r for r in range(size)]).double()
    )
    # Uneven splits: rank r sends r + 1 rows to each rank.
    sent = torch.full(((rank + 1) * size, 2), float(rank))
    received = torch.zeros(sum(r + 1 for r in range(size)), 2)
    dist.all_to_all_single(received, sent, [r + 1 for r in range(size)], [rank + 1] * size)
    checks["all_to_all_single/splits"] = torch.equal(
        received, torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)])
    )
    outputs = [torch.zeros(r + 2) for r in range(size)]
    dist.all_to_all(outputs, [torch.full((rank + 2,), float(rank * size + r)) for r in range(size)])
    checks["all_to_all"] = all(
        torch.equal(o, torch.full((r + 2,), float(r * size + rank))) for r, o in enumerate(outputs)
    )

    for root in range(size):
        tensor = torch.full((2,), float(rank + 1))
        dist.reduce(tensor, dst=root, op=dist.ReduceOp.SUM)
        expected = sum(range(1, size + 1)) if rank == root else rank + 1
        checks[f"reduce/root{root}"] = torch.equal(tensor, torch.full((2,), float(expected)))
    root = size - 1
    bucket = [torch.zeros(3) for _ in range(size)] if rank == root else None
    dist.gather(torch.full((3,), float(rank)), bucket, dst=root)
    checks["gather"] = bucket is None or all(
        torch.equal(b, torch.full((3,), float(r))) for r, b in enumerate(bucket)
    )
    piece = torch.zeros(2, 2)
    pieces = [torch.full((2, 2), 7.0 * r) for r in range(size)] if rank == 0 else None
    dist.scatter(piece, pieces, src=0)
    checks["scatter"] = torch.equal(piece, torch.full((2, 2), 7.0 * rank))

    objects: list[object] = [None] * size
    dist.all_gather_object(objects, {"rank": rank, "name": f"r{rank}"})
    checks["all_gather_object"] = objects == [{"rank": r, "name": f"r{r}"} for r in range(size)]
    sent_objects = [f"from-{rank}", rank * 3] if rank == 1 else [None, None]
    dist.broadcast_object_list(sent_objects, src=1)
    checks["broadcast_object_list"] = sent_objects == ["from-1", 3]
    box: list[object] = [None]
    dist.scatter_object_list(box, [f"to-{r}" for r in range(size)] if rank == 0 else None, src=0)
    checks["scatter_object_list"] = box == [f"to-{rank}"]

    # async_op: wait, is_completed and get_future as torch's.
    tensors = [torch.full((4,), float(rank + i)) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    futures = [w.get_future() for w in works[:2]]
    chained = futures[0].then(lambda f: f.value()[0] * 2)
    waited = [w.wait() for w in works]
    total = [float(sum(r + i for r in range(size))) for i in range(4)]
    checks["async/wait"] = waited == [True] * 4 and all(
        torch.equal(t, torch.full((4,), v)) for t, v in zip(tensors, total, strict=True)
    )
    checks["async/is_completed"] = all(w.is_completed() for w in works)
    checks["async/future"] = torch.equal(futures[1].wait()[0], torch.full((4,), total[1]))
    checks["async/future-then"] = torch.equal(chained.wait(), torch.full((4,), 2 * total[0]))
    work = dist.barrier(async_op=True)
    work.wait()
    checks["async/barrier"] = work.is_completed()

    # What the core cannot do raises on every rank, naming the call, and the ranks stay in step.
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND)
        checks["refused/band"] = False
    except NotImplementedError as exc:
        checks["refused/band"] = "all_reduce" in str(exc) and "BAND" in str(exc)
        details["refused/band"] = str(exc)
    try:
        dist.send(torch.ones(1), dst=(rank + 1) % size)
        checks["refused/send"] = False
    except NotImplementedError as exc:
        checks["refused/send"] = "torch.distributed.send" in str(exc)
    tensor = torch.ones(3)
    dist.all_reduce(tensor)
    checks["refused/still-in-step"] = torch.equal(tensor, torch.full((3,), float(size)))

    # Different calls on different ranks fail on every rank, naming what each one ran.
    try:
        if rank == 0:
            dist.broadcast(torch.ones(2), src=0)
        else:
            dist.all_reduce(torch.ones(2))
        checks["mismatch"] = False
    except ringplug.MismatchError as exc:
        text = str(exc)
        checks["mismatch"] = "broadcast" in text and "allreduce" in text and "torch." in text
        details["mismatch"] = text
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    checks["mismatch/still-in-step"] = torch.equal(tensor, torch.full((1,), float(size)))

    solo = dist.new_group(ranks=[0])  # a group over some of the ranks: a process set of one
    if rank == 0:
        tensor = torch.full((2,), 5.0)
        dist.all_reduce(tensor, group=solo)
        checks["subgroup/of-rank-0"] = torch.equal(tensor, torch.full((2,), 5.0))
    else:
        checks["subgroup/of-rank-0"] = solo is dist.GroupMember.NON_GROUP_MEMBER
    whole = dist.new_group(ranks=list(range(size)))
    tensor = torch.full((2,), float(rank))
    dist.all_reduce(tensor, group=whole)
    checks["group-of-every-rank"] = torch.equal(tensor, torch.full((2,), float(sum(range(size)))))


def ddp(rank: int, size: int, checks: dict[str, bool], details: dict[str, str]) -> None:
    torch.manual_seed(1234)  # the same data and initial model on every rank
    data = torch.randn(8, 2 * 6, 5)  # 8 steps of a global batch of 12
    targets = torch.randn(8, 2 * 6, 3)

    def build() -> torch.nn.Module:
        torch.manual_seed(rank + 7)  # different on each rank: DDP must broadcast rank 0's
        return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    model = torch.nn.parallel.DistributedDataParallel(build(), bucket_cap_mb=0.0005)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_rank = data.shape[1] // size
    for step in range(data.shape[0]):
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(data[step, mine]), targets[step, mine]).backward()
        optimizer.step()

    torch.manual_seed(0 + 7)  # rank 0's initial model, trained alone on the whole batch
    reference = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(data.shape[0]):
        ref_optimizer.zero_grad()
        used = slice(0, per_rank * size)
        torch.nn.functional.mse_loss(reference(data[step, used]), targets[step, used]).backward()
        ref_optimizer.step()

    trained = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    difference = (trained - expected).abs().max().item()
    details["ddp/max-difference"] = f"{difference:.3g}"
    checks["ddp/equals-one-process"] = difference < 1e-5
    everyone = [torch.zeros_like(trained) for _ in range(size)]
    dist.all_gather(everyone, trained)
    checks["ddp/ranks-bitwise-identical"] = all(torch.equal(w, trained) for w in everyone)


def torchmetrics_sync(
    rank: int, size: int, checks: dict[str, bool], details: dict[str, str]
) -> None:
    import torchmetrics

    metric = torchmetrics.MeanMetric()
    values = torch.arange(rank + 2, dtype=torch.float32) + rank  # uneven counts per rank
    metric.update(values)
    everything = torch.cat([torch.arange(r + 2, dtype=torch.float32) + r for r in range(size)])
    checks["torchmetrics/mean"] = torch.allclose(metric.compute(), everything.mean())
    accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    accuracy.update(torch.tensor([rank % 3, 1]), torch.tensor([rank % 3, 2]))
    checks["torchmetrics/accuracy"] = torch.isclose(accuracy.compute(), torch.tensor(0.5)).item()


def lightning_ddp(rank: int, size: int, checks: dict[str, bool], details: dict[str, str]) -> None:
    """Lightning's own DDPStrategy with process_group_backend="ringplug" (it starts the group)."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    per_rank, steps = 3, 5
    generator = torch.Generator().manual_seed(11)
    dataset = TensorDataset(
        torch.randn(per_rank * size * steps, 4, generator=generator),
        torch.randn(per_rank * size * steps, 1, generator=generator),
    )

    def build() -> torch.nn.Module:
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build()

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    trainer = L.Trainer(
        strategy=DDPStrategy(process_group_backend="ringplug"),
        accelerator="cpu",
        devices=size,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(dataset, batch_size=per_rank))
    checks["lightning-ddp/backend"] = dist.get_backend() == "ringplug"

    reference = build()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    orders = [
        list(DistributedSampler(dataset, num_replicas=size, rank=r, shuffle=True, seed=0))
        for r in range(size)
    ]
    for step in range(steps):
        rows = [i for order in orders for i in order[step * per_rank : (step + 1) * per_rank]]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(dataset[rows][0]), dataset[rows][1]).backward()
        optimizer.step()
    trained = torch.cat([p.detach().reshape(-1) for p in module.net.parameters()])
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    difference = (trained - expected).abs().max().item()
    details["lightning-ddp/max-difference"] = f"{difference:.3g}"
    checks["lightning-ddp/equals-one-process"] = difference < 1e-5
    everyone = [torch.zeros_like(trained) for _ in range(size)]
    dist.all_gather(everyone, trained)
    checks["lightning-ddp/ranks-bitwise-identical"] = all(torch.equal(w, trained) for w in everyone)


def stall(rank: int, size: int, checks: dict[str, bool], details: dict[str, str]) -> None:
    """Rank 0 reduces while rank 1 is stuck in its own code (as a rank out of data that
    waits elsewhere): ringplug's stall inspector and timeout see it; the job must end."""
    if rank == 0:
        dist.all_reduce(torch.ones(3))
    else:
        threading.Event().wait(120)  # the injected fault: never reaches the collective


SCENARIOS = {
    "calls": calls,
    "stall": stall,
    "ddp": ddp,
    "torchmetrics": torchmetrics_sync,
    "lightning-ddp": lightning_ddp,
}


def main(scenario: str, outdir: Path) -> None:
    if scenario != "lightning-ddp":  # Lightning starts its own group
        dist.init_process_group("ringplug")
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    checks: dict[str, bool] = {}
    details: dict[str, str] = {}
    SCENARIOS[scenario](rank, size, checks, details)
    if dist.is_initialized():
        dist.destroy_process_group()
    checks = {name: bool(ok) for name, ok in checks.items()}
    (outdir / f"{scenario}-{rank}.json").write_text(
        json.dumps({"checks": checks, "details": details})
    )


if __name__ == "__main__":
    for name in sys.argv[1].split(","):
        main(name, Path(sys.argv[2]))
