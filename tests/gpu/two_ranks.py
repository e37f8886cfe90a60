"""Two ranks on one GPU, through NCCL: data that differs per rank, every op and dtype.

``ringrun -np 2 python tests/gpu/two_ranks.py [--device cpu] [--exit-early]``

Each rank gives itself an ``NCCL_HOSTID`` of its own before NCCL starts (NCCL refuses two
ranks of one host on one GPU: "Duplicate GPU detected"); with ``NCCL_SOCKET_IFNAME=lo`` the
two then talk over the loopback. Every rank builds every rank's input (they are made from
the rank number), so the expected result is computed here with torch, exactly. Prints
PASS/FAIL/SKIP per check; exits 1 on a failure. ``--device cpu`` runs the same checks on CPU
tensors (the MPI path): the dry run of the script itself. ``--exit-early``: rank 1 leaves
inside the run; rank 0 must fail its next GPU collective, not hang (check_gpu.sh runs it
under a timeout and expects a non-zero exit).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
]


def data(rank: int, dtype: torch.dtype, device: str, rows: int = 5) -> torch.Tensor:
    """Rank `rank`'s input: small integers, held exactly by every dtype and every sum."""
    values = (torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) % 7) - 3 + rank * 2
    if dtype is torch.uint8:
        values = values.abs()
    return values.to(dtype).to(device)


def reference(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    stack = torch.stack([t.double() for t in tensors])
    result = {
        "sum": stack.sum(0),
        "average": stack.mean(0),
        "min": stack.min(0).values,
        "max": stack.max(0).values,
        "product": stack.prod(0),
    }[op]
    return result.to(tensors[0].dtype)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--exit-early", action="store_true")
    args = parser.parse_args()
    rank_variable = next(
        (os.environ[v] for v in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK") if v in os.environ),
        "0",
    )
    os.environ["NCCL_HOSTID"] = f"ringplug-check-{rank_variable}"  # before NCCL starts
    import ringplug.torch as rpt

    rpt.init()
    rank, size = rpt.rank(), rpt.size()
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(0)
    failures = 0

    def check(name, body):
        nonlocal failures
        start = time.perf_counter()
        try:
            body()
            status, detail = "PASS", ""
        except Exception as error:  # noqa: BLE001 - every check reports
            status, detail = "FAIL", f"{type(error).__name__}: {error}"
            traceback.print_exc()
            failures += 1
        if rank == 0:
            print(f"{status} {name} ({time.perf_counter() - start:.1f} s) {detail}", flush=True)

    def same(got, want, what):
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
        assert torch.equal(got.cpu(), want.cpu()), f"{what}: {got.tolist()} != {want.tolist()}"

    def every_op_and_dtype():
        for dtype in DTYPES:
            ops = ["sum", "min", "max", "product"] + (
                ["average"] if dtype.is_floating_point else []
            )
            mine, everyone = data(rank, dtype, device), [data(r, dtype, "cpu") for r in range(size)]
            for op in ops:
                same(
                    rpt.allreduce(mine, op, name=f"two.{dtype}.{op}"),
                    reference(op, everyone).to(device),
                    f"{dtype} {op}",
                )

    def scale_factors():
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            mine, everyone = data(rank, dtype, device), [data(r, dtype, "cpu") for r in range(size)]
            got = rpt.allreduce(
                mine, "sum", prescale_factor=0.5, postscale_factor=2.0, name=f"two.{dtype}.premul"
            )
            same(got, reference("sum", everyone).to(device), f"{dtype} sum x0.5 x2")

    def grouped_and_uneven():
        tensors = [data(rank, torch.float32, device, rows) for rows in (1, 4, 9)]
        rpt.grouped_allreduce_(tensors, "sum", name="two.grouped")
        for rows, got in zip((1, 4, 9), tensors, strict=True):
            want = reference("sum", [data(r, torch.float32, "cpu", rows) for r in range(size)])
            same(got, want.to(device), f"grouped {rows} rows")
        mine = data(rank, torch.float32, device, rows=rank + 1)  # rank r has r + 1 rows
        gathered = rpt.allgather(mine, name="two.uneven")
        want = torch.cat([data(r, torch.float32, "cpu", rows=r + 1) for r in range(size)])
        same(gathered, want.to(device), "allgather of uneven rows")
        root = size - 1
        got = rpt.broadcast(data(rank, torch.int64, device), root, name="two.broadcast")
        same(got, data(root, torch.int64, device), "broadcast from the last rank")
        block = rpt.reducescatter(
            data(rank, torch.float32, device, rows=2 * size), "sum", name="two.reducescatter"
        )
        full = reference("sum", [data(r, torch.float32, "cpu", rows=2 * size) for r in range(size)])
        same(block, full[2 * rank : 2 * rank + 2].to(device), "reducescatter block")

    check("two ranks: every op and dtype, data differing per rank", every_op_and_dtype)
    check("two ranks: PreMulSum scale factors in every float type", scale_factors)
    check(
        "two ranks: grouped, uneven allgather, broadcast from the last rank, reducescatter",
        grouped_and_uneven,
    )
    if args.exit_early:
        if rank == 1:
            print("rank 1 leaves the job now", flush=True)
            os._exit(3)
        rpt.allreduce(data(rank, torch.float32, device), "sum", name="two.after-exit")
        print("FAIL rank 0's collective finished without rank 1", flush=True)
        return 1
    if rank == 0:
        print(f"two_ranks.py: {failures} failed", flush=True)
    rpt.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
