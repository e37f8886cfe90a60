"""GPU checks of the NCCL data plane on one GPU, one rank (run by check_gpu.sh).

Each check prints PASS, FAIL (with the reason) or SKIP (with the reason); the exit code is
the number of failures. References are computed with torch on the same GPU. With one rank
a reduction returns its input times the scale factors, so the checks also prove that the
values went through NCCL and back unchanged, for every dtype, op and collective.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

import ringplug
import ringplug.torch as rpt
from ringplug.core import runtime
from ringplug.core.errors import CommunicatorFailed
from ringplug.core.gpu import nccl

RESULTS: list[tuple[str, str, str]] = []
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]
EXTRA_DTYPES = [torch.uint8, torch.int8, torch.bool]


def check(name: str) -> Callable[[Callable[[], str | None]], Callable[[], None]]:
    def decorate(body: Callable[[], str | None]) -> Callable[[], None]:
        def run() -> None:
            start = time.perf_counter()
            try:
                skipped = body()
                status, detail = ("SKIP", skipped) if skipped else ("PASS", "")
            except Exception as error:  # noqa: BLE001 - every check reports, none stops the rest
                status, detail = "FAIL", f"{type(error).__name__}: {error}"
                traceback.print_exc()
            RESULTS.append((name, status, detail))
            print(f"{status} {name} ({time.perf_counter() - start:.1f} s) {detail}", flush=True)

        CHECKS.append(run)
        return run

    return decorate


CHECKS: list[Callable[[], None]] = []


def sample(dtype: torch.dtype, shape: tuple[int, ...] = (33, 17)) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(3)
    if dtype is torch.bool:
        return torch.rand(shape, device="cuda", generator=generator) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, device="cuda", generator=generator).to(dtype)
    return torch.randint(
        -50 if dtype is not torch.uint8 else 0, 50, shape, device="cuda", generator=generator
    ).to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.device.type == "cuda", f"{what}: result on {actual.device}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if expected.dtype.is_floating_point:
        tolerance = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(expected.dtype, 1e-6)
        ok = torch.allclose(actual.float(), expected.float(), rtol=tolerance, atol=tolerance)
    else:
        ok = torch.equal(actual, expected)
    assert ok, f"{what}: values differ (max {(actual.float() - expected.float()).abs().max()})"


@check("environment: NCCL found, one GPU, ringplug initialised")
def environment() -> None:
    found = nccl.version()
    print(f"  NCCL {found} at {found.path} ({found.source})")
    print(
        f"  torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"GPU {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} visible"
    )
    assert ringplug.size() == 1
    from ringplug.run.checks.check import CheckContext
    from ringplug.run.checks.gpu import gpu_section

    for name, value in gpu_section(CheckContext()).rows:
        print(f"  --check: {name}: {value}")


@check("allreduce of every dtype and op against torch references")
def allreduce_all() -> None:
    for dtype in DTYPES + EXTRA_DTYPES:
        x = sample(dtype)
        ops = ["sum", "min", "max"]
        if dtype is not torch.bool:
            ops.append("product")
        if dtype.is_floating_point:
            ops.append("average")
        for op in ops:
            assert_close(rpt.allreduce(x, op, name=f"ar.{dtype}.{op}"), x, f"{dtype} {op}")
        if dtype.is_floating_point:
            scaled = rpt.allreduce(
                x, "sum", prescale_factor=2.0, postscale_factor=0.25, name=f"ar.{dtype}.scaled"
            )
            assert_close(scaled, (x.float() * 0.5).to(dtype), f"{dtype} sum x2 x0.25")
            averaged = rpt.allreduce(x, "average", prescale_factor=3.0, name=f"ar.{dtype}.avg3")
            assert_close(averaged, (x.float() * 3.0).to(dtype), f"{dtype} average x3")
            maxed = rpt.allreduce(
                x, "max", prescale_factor=2.0, postscale_factor=0.5, name=f"ar.{dtype}.max"
            )
            assert_close(maxed, x, f"{dtype} max with scale factors (torch's passes)")
        y = sample(dtype, (17, 33)).t()  # not contiguous: reduced through a copy, written back
        expected = y.clone()
        rpt.allreduce_(y, "sum", name=f"ar.{dtype}.strided")
        assert_close(y, expected, f"{dtype} in place, non-contiguous")
    engine = runtime.engine()
    assert engine._gpu is not None and engine._gpu.device == torch.cuda.current_device()


@check("PreMulSum: factors 1/3 and 0.5 in fp16, bf16, fp32, fp64, in and out of place")
def premul() -> None:
    # One rank's Sum is a copy, but a pre-multiplied sum multiplies: these values went through
    # NCCL's PreMulSum with ringplug's scalar bytes (bfloat16 rounded as torch rounds).
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = sample(dtype)
        for factor in (1 / 3, 0.5):
            want = (x.double() * torch.tensor(factor, dtype=dtype).double()).to(dtype)
            got = rpt.allreduce(x, "sum", prescale_factor=factor, name=f"pm.{dtype}.{factor:.2f}")
            assert_close(got, want, f"{dtype} x{factor:.3g} out of place")
            y = x.clone()
            rpt.allreduce_(y, "sum", prescale_factor=factor, name=f"pm_.{dtype}.{factor:.2f}")
            assert_close(y, want, f"{dtype} x{factor:.3g} in place")


@check("ordering with torch.cuda._sleep: default stream, side stream, fused group")
def sleep_ordering() -> None:
    # The producer's stream is kept busy ~0.2 s before it writes the input; without the
    # engine's stream waiting for the caller's event, NCCL would read the old values.
    cycles = int(0.2 * torch.cuda.get_device_properties(0).clock_rate * 1000)
    for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
        with torch.cuda.stream(stream):
            inputs = [torch.zeros(1000, device="cuda") for _ in range(3)]
            torch.cuda._sleep(cycles)
            for i, tensor in enumerate(inputs):
                tensor.fill_(i + 1.0)
            single = rpt.allreduce(
                inputs[0], "sum", prescale_factor=0.5, name=f"sl.{stream.stream_id}"
            )
            rpt.grouped_allreduce_(
                inputs, "sum", prescale_factor=0.5, name=f"slg.{stream.stream_id}"
            )
        torch.cuda.synchronize()
        assert_close(single, torch.full((1000,), 0.5, device="cuda"), "after a sleep")
        for i, tensor in enumerate(inputs):
            assert_close(tensor, torch.full((1000,), (i + 1) * 0.5, device="cuda"), "fused")


@check("the communicator: ncclCommCount, ncclCommUserRank, ncclCommCuDevice")
def communicator_facts() -> None:
    import ctypes

    rpt.allreduce(torch.ones(1, device="cuda"), name="facts")
    comm = runtime.engine()._gpu.comm
    values = {}
    for call in ("ncclCommCount", "ncclCommUserRank", "ncclCommCuDevice"):
        out = ctypes.c_int(-1)
        comm.library.check(getattr(comm.library.lib, call)(comm.handle, ctypes.byref(out)), call)
        values[call] = out.value
    assert values == {
        "ncclCommCount": 1,
        "ncclCommUserRank": 0,
        "ncclCommCuDevice": torch.cuda.current_device(),
    }, values


@check("broadcast, allgather and reducescatter of every dtype")
def other_collectives() -> None:
    for dtype in DTYPES + EXTRA_DTYPES:
        x = sample(dtype, (8, 5))
        assert_close(rpt.broadcast(x, 0, name=f"bc.{dtype}"), x, f"{dtype} broadcast")
        y = x.clone()
        rpt.broadcast_(y, 0, name=f"bc_.{dtype}")
        assert_close(y, x, f"{dtype} broadcast_")
        assert_close(rpt.allgather(x, name=f"ag.{dtype}"), x, f"{dtype} allgather")
        if dtype is not torch.bool:
            op = "sum"
            assert_close(rpt.reducescatter(x, op, name=f"rs.{dtype}"), x, f"{dtype} reducescatter")
    z = sample(torch.float32, (6, 4))
    grouped = [z[0].clone(), z[1:3].clone(), z[3:].clone()]
    rpt.grouped_allreduce_(grouped, "average", name="grouped")
    assert_close(torch.cat([g.reshape(-1, 4) for g in grouped]), z, "grouped_allreduce_")


@check("int16 and mixed CPU/GPU requests are refused with what to do")
def refusals() -> str | None:
    try:
        rpt.allreduce(torch.ones(3, dtype=torch.int16, device="cuda"), "sum", name="i16")
        raise AssertionError("int16 was accepted")
    except TypeError as error:
        assert "int32" in str(error), error
    try:
        rpt.grouped_allreduce_([torch.ones(2, device="cuda"), torch.ones(2)], name="mixed")
        raise AssertionError("a CPU/GPU mix was accepted")
    except ValueError as error:
        assert "mixes CPU and CUDA" in str(error), error
    return None


@check("ordering: NCCL waits for the kernels that produce its input (default and side stream)")
def ordering() -> None:
    a = torch.randn(3072, 3072, device="cuda")
    for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
        with torch.cuda.stream(stream):
            torch.cuda.synchronize()
            value = a
            for _ in range(12):  # ~0.1 s of queued work before the input exists
                value = torch.tanh(value @ a) * 0.01
            produced = value.sum(0)
            result = rpt.allreduce(produced, "sum", name=f"order.{stream.stream_id}")
            expected = value.sum(0)
        torch.cuda.synchronize()
        assert_close(result, expected, f"input produced on stream {stream.stream_id}")


@check("fusion: 64 tensors reduced through the device fusion buffer in one NCCL call")
def fusion() -> None:
    engine = runtime.engine()
    tensors = [sample(torch.float32, (n + 1, 7)) for n in range(64)]
    expected = [t.clone() * 2 for t in tensors]
    before = engine.collectives_run
    rpt.grouped_allreduce_(tensors, "sum", postscale_factor=2.0, name="fused.64")
    assert engine.collectives_run - before == 1, engine.collectives_run - before
    for got, want in zip(tensors, expected, strict=True):
        assert_close(got, want, "fused tensor")
    assert engine._gpu._fusion is not None, "the fusion buffer was not used"
    # Many async requests at once: every result right, whatever the engine fused.
    handles = [rpt.allreduce_async_(t, "average", name=f"async.{i}") for i, t in enumerate(tensors)]
    for handle, want in zip(handles, expected, strict=True):
        assert_close(handle.wait(), want, "async")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "timeline.json")
        ringplug.start_timeline(path)
        rpt.grouped_allreduce_(tensors, "sum", name="fused.timeline")
        ringplug.stop_timeline()
        with open(path) as trace:
            assert "NCCL_ALLREDUCE" in trace.read()


@check("DistributedOptimizer on a CUDA model trains like plain local training")
def optimizer() -> None:
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
        ).cuda()

    data = torch.randn(64, 32, device="cuda")
    target = torch.randn(64, 4, device="cuda")
    plain, wrapped = model(), model()
    reference = torch.optim.Adam(plain.parameters(), lr=1e-2)
    distributed = rpt.DistributedOptimizer(
        torch.optim.Adam(wrapped.parameters(), lr=1e-2), named_parameters=wrapped.named_parameters()
    )
    rpt.broadcast_parameters(wrapped.state_dict(), root_rank=0)
    for _ in range(5):
        for net, opt in ((plain, reference), (wrapped, distributed)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(data), target).backward()
            opt.step()
    for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert_close(q.detach(), p.detach(), "parameter after 5 steps")


@check("torch.distributed on the ringplug backend: CUDA tensors, async futures, DDP")
def torch_backend() -> None:
    import torch.distributed as dist

    dist.init_process_group("ringplug", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tensor = sample(torch.float32)
        expected = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
        assert_close(tensor, expected, "all_reduce AVG")
        dist.broadcast(tensor, src=0)
        gathered = torch.empty(tensor.numel(), device="cuda")
        dist.all_gather_into_tensor(gathered, tensor.reshape(-1))
        assert_close(gathered, expected.reshape(-1), "all_gather_into_tensor")
        block = torch.empty_like(gathered)
        dist.reduce_scatter_tensor(block, gathered)
        assert_close(block, expected.reshape(-1), "reduce_scatter_tensor")
        moved = torch.empty_like(gathered)
        dist.all_to_all_single(moved, gathered)
        assert_close(moved, expected.reshape(-1), "all_to_all_single (through the host)")
        work = dist.all_reduce(tensor, async_op=True)
        value = work.get_future().wait()[0]
        assert value.is_cuda and work.is_completed(), "the future's value stays on the GPU"
        torch.manual_seed(0)
        plain = torch.nn.Linear(16, 4).cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Linear(16, 4).cuda().requires_grad_(True), device_ids=[0]
        )
        ddp.module.load_state_dict(plain.state_dict())
        x = torch.randn(8, 16, device="cuda")
        plain(x).square().sum().backward()
        ddp(x).square().sum().backward()
        assert_close(ddp.module.weight.grad, plain.weight.grad, "DDP gradient")
    finally:
        dist.destroy_process_group()


@check("Lightning: Trainer(accelerator='gpu', strategy=RingStrategy()) fits on the GPU")
def lightning_fit() -> str | None:
    try:
        import lightning.pytorch as pl
    except ImportError:
        return "lightning is not installed here (put its wheels in tests/gpu/wheels)"
    from ringplug.lightning import RingStrategy

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x = torch.randn(256, 8)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32
    )
    model = Model()
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=RingStrategy(),
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, data)
    assert next(model.parameters()).device.type == "cuda"
    assert trainer.state.finished
    return None


def nccl_mapped() -> int:
    """The libnccl ringplug loads is the one torch mapped into the process."""
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    with open("/proc/self/maps") as maps:
        mapped = sorted({line.split()[-1] for line in maps if "libnccl.so" in line})
    found = nccl.version()
    same = [os.path.realpath(path) for path in mapped] == [os.path.realpath(found.path)]
    status = "PASS" if same else "FAIL"
    print(
        f"{status} NCCL: torch mapped {mapped}; ringplug loads {found.path} ({found.source}), "
        f"version {found}",
        flush=True,
    )
    return 0 if same else 1


def timeout_ends_it() -> int:
    """RINGPLUG_TIMEOUT=2 against a 5 s kernel: CommunicatorFailed in under 4 s."""
    os.environ["RINGPLUG_TIMEOUT"] = "2"
    ringplug.init()
    rpt.allreduce(torch.ones(1, device="cuda"), name="warm")
    cycles = int(5 * torch.cuda.get_device_properties(0).clock_rate * 1000)
    x = torch.ones(1000, device="cuda")
    torch.cuda._sleep(cycles)
    start = time.perf_counter()
    try:
        rpt.allreduce(x, "sum", name="behind-a-5s-kernel")
        print("FAIL the collective behind a 5 s kernel finished under RINGPLUG_TIMEOUT=2")
        return 1
    except CommunicatorFailed as error:
        waited = time.perf_counter() - start
        status = "PASS" if waited < 4 else "FAIL"
        print(f"{status} CommunicatorFailed after {waited:.1f} s: {error}", flush=True)
        return 0 if waited < 4 else 1


def main() -> int:
    if not torch.cuda.is_available():
        print("check_gpu.py: torch sees no GPU here (a CUDA build of torch and a GPU are needed)")
        return 2
    mode = sys.argv[1] if len(sys.argv) > 1 else "one-rank"
    if mode == "nccl-mapped":
        return nccl_mapped()
    if mode == "timeout":
        return timeout_ends_it()
    ringplug.init()
    for run in CHECKS:
        run()
    failures = [r for r in RESULTS if r[1] == "FAIL"]
    print(
        f"check_gpu.py: {len(RESULTS) - len(failures)} of {len(RESULTS)} passed or skipped, "
        f"{len(failures)} failed",
        flush=True,
    )
    ringplug.shutdown()
    return len(failures)


if __name__ == "__main__":
    sys.exit(main())
