"""The GPU data plane on 2 and 3 ranks, against the fake NCCL and CUDA runtime.

The fakes (tests/fakes/*.c) compute every collective across real rank processes and run
stream work later, on threads of their own, so that what would go wrong on GPUs goes wrong
here: a wrong NCCL op or type code gives wrong numbers, a missing stream wait reads stale
data, two ranks on one GPU are refused. Each battery job runs every case of
tests/workers/fakegpu_battery.py once; the expected results are computed here with numpy
from the inputs every rank reports. Planted bugs prove the battery can fail.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from fakegpu import fake_env
from launch import run_ringrun

pytestmark = [pytest.mark.fakegpu, pytest.mark.multirank]

WORKER = Path(__file__).parent / "workers" / "fakegpu_battery.py"
_spec = importlib.util.spec_from_file_location("fakegpu_battery", WORKER)
battery = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(battery)
CASES = {case["name"]: case for case in battery.cases()}
# RINGPLUG_TIMEOUT + 10 s is the bound the issue sets; starting 3 ranks on a loaded 2-core
# machine takes a few seconds more. The bound only turns a hang into a failure.
JOB_BOUND_S = 40
FAST = {"RINGPLUG_TIMEOUT": "3", "RINGPLUG_STALL_CHECK_SECONDS": "1"}
# (ranks, environment): two GPUs for two ranks; three ranks on one GPU of three "hosts"
# (each its own NCCL_HOSTID, which is what lets NCCL put them on one device).
SETUPS = {2: {"FAKE_CUDA_DEVICES": "2"}, 3: {"FAKE_CUDA_DEVICES": "1", "FAKEGPU_HOSTS": "1"}}
TOLERANCE = {
    "float16": (4e-3, 1e-2),
    "bfloat16": (2e-2, 5e-2),
    "float32": (1e-6, 1e-6),
    "float64": (1e-12, 1e-12),
}


def run_battery(fakes, ranks: int, **extra: str):
    env = fake_env(fakes, **SETUPS[ranks], **extra)
    return run_ringrun(
        "-np", str(ranks), sys.executable, str(WORKER), "battery", extra_env=env, timeout=120
    )


def reports_of(output: str) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for line in output.splitlines():
        if "case:" in line:
            report = json.loads(line.split("case:", 1)[1])
            found.setdefault(report["case"], []).append(report)
    return found


def reduce_over_ranks(stack: np.ndarray, op: str) -> np.ndarray:
    return {
        "sum": stack.sum(0),
        "average": stack.mean(0),
        "max": stack.max(0),
        "min": stack.min(0),
        "product": stack.prod(0),
    }[op]


def expected_outputs(case: dict, reports: list[dict], size: int) -> dict[int, list[np.ndarray]]:
    """What each rank must hold, computed from the inputs every rank reported."""
    by_rank = {report["rank"]: report for report in reports}
    inputs = [[np.asarray(x) for x in by_rank[r]["inputs"]] for r in range(size)]
    kind = case["kind"]
    if kind == "allreduce":
        scale = case.get("pre", 1.0) * case.get("post", 1.0)
        outs = [
            reduce_over_ranks(np.stack([inputs[r][i] for r in range(size)]), case["op"]) * scale
            for i in range(len(inputs[0]))
        ]
        return {r: outs for r in range(size)}
    if kind == "broadcast":
        root = by_rank[0]["root"]
        return {r: [inputs[root][0]] for r in range(size)}
    if kind == "allgather":
        return {r: [np.concatenate([inputs[q][0] for q in range(size)])] for r in range(size)}
    raise AssertionError(kind)


def mismatches(reports_by_case: dict[str, list[dict]], size: int) -> list[str]:
    """Every case whose result differs from numpy's, with what it got."""
    wrong = []
    for name, reports in sorted(reports_by_case.items()):
        case = CASES[name]
        if len(reports) != size:
            wrong.append(f"{name}: {len(reports)} of {size} ranks reported")
            continue
        rtol, atol = TOLERANCE.get(case["dtype"], (0, 0))
        if name == "average-threes-bfloat16":
            rtol = atol = 0.0  # exactly 3 when 1/3 is rounded to nearest even
        if case["kind"] == "reducescatter":
            # The blocks of every rank, in rank order, are the reduction of the whole.
            order = sorted(reports, key=lambda report: report["rank"])
            got = np.concatenate([np.asarray(report["out"][0]) for report in order])
            stack = np.stack([np.asarray(report["inputs"][0]) for report in order])
            want = reduce_over_ranks(stack, case["op"])
            if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=atol):
                wrong.append(f"{name}: got {got.tolist()}, numpy gives {want.tolist()}")
            continue
        expected = expected_outputs(case, reports, size)
        for report in reports:
            for got, want in zip(report["out"], expected[report["rank"]], strict=True):
                got = np.asarray(got)
                if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=atol):
                    wrong.append(
                        f"{name} rank {report['rank']}: got {got.tolist()}, numpy gives "
                        f"{want.tolist()}"
                    )
            if "sent_after" in report and report["sent_after"] != report["inputs"]:
                wrong.append(f"{name} rank {report['rank']}: the input was overwritten")
    return wrong


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def battery_run(request, fakes):
    ranks = request.param
    result = run_battery(fakes, ranks)
    assert result.returncode == 0, result.stdout + result.stderr
    return ranks, reports_of(result.stdout)


@pytest.mark.parametrize(
    "kind",
    [
        "allreduce",
        "premul",
        "fused",
        "broadcast",
        "allgather",
        "reducescatter",
        "ordered",
        "out-of-place",
        "average-threes",
    ],
)
def test_every_collective_computes_what_numpy_computes(battery_run, kind):
    ranks, reports = battery_run
    chosen = {name: found for name, found in reports.items() if name.startswith(kind)}
    assert chosen, f"no {kind} case ran"
    assert len(chosen) == sum(name.startswith(kind) for name in CASES)
    assert mismatches(chosen, ranks) == []


def test_process_sets_run_gpu_collectives_on_nccl_communicators_of_their_own(fakes):
    # Sets [1, 2] and [0, 2] of 3 ranks (rank 2 in both), and [0, 1] made by its members
    # only: each set's engine makes an NCCL communicator of its members at its first GPU
    # collective; results against numpy.
    env = fake_env(fakes, **SETUPS[3], **FAST)
    result = run_ringrun(
        "-np", "3", sys.executable, str(WORKER), "sets", extra_env=env, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    found = reports_of(result.stdout)
    for label in ("A", "B", "C"):
        mine = {name.split("/", 1)[1]: got for name, got in found.items() if name[0] == label}
        assert sorted(mine) == sorted(battery.SET_CASES), sorted(found)
        assert mismatches(mine, 2) == [], label


def test_every_dtype_and_op_ringplug_sends_is_covered():
    dtypes = {case["dtype"] for case in CASES.values()}
    assert dtypes == {
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "int8",
        "uint8",
        "int32",
        "int64",
    }
    ops = {case.get("op") for case in CASES.values() if case["kind"] == "allreduce"}
    assert ops == {"sum", "average", "max", "min", "product"}


# ---------------------------------------------------------------------- planted bugs
@pytest.mark.parametrize(
    ("bug", "cases", "ranks"),
    [
        ("op", "allreduce-max-", 2),
        ("dtype-float32", "allreduce-sum-float32", 2),
        ("dtype-bfloat16", "allreduce-sum-bfloat16,premul-sum-3-0.5-bfloat16", 2),
        ("wait", "ordered-", 2),
        ("scalar", "average-threes-bfloat16", 3),
    ],
)
def test_a_planted_bug_in_the_gpu_path_fails_the_battery(fakes, bug, cases, ranks):
    result = run_battery(fakes, ranks, FAKEGPU_PLANT=bug, FAKEGPU_CASES=cases)
    output = result.stdout + result.stderr
    reports = reports_of(result.stdout)
    # Without the bug the same cases pass (test_every_collective_computes_what_numpy_computes).
    caught = result.returncode != 0 or mismatches(reports, ranks)
    assert caught, output
    if bug in ("op", "wait", "scalar", "dtype-bfloat16"):
        assert result.returncode == 0 and reports, output  # wrong numbers, not a crash
        assert all(name.startswith(tuple(cases.split(","))) for name in reports)


def test_a_bfloat16_scale_factor_is_rounded_as_torch_rounds_it():
    torch = pytest.importorskip("torch")
    from ringplug.core.dtypes import DType
    from ringplug.core.gpu.plane import scalar_bytes

    for value in [1 / 3, 1 / 6, 0.1, 2 / 3, 1 / 7, 3.0, -1 / 3, 1e-3, 65504.0, 1 / 1024]:
        want = torch.tensor(value, dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF
        assert scalar_bytes(value, DType.BFLOAT16) == struct.pack("<H", want), value
    assert scalar_bytes(1 / 3, DType.BFLOAT16) == struct.pack("<H", 0x3EAB)


# ---------------------------------------------------------------------- failures
def run_scenario(fakes, scenario: str, ranks: int, **extra: str):
    env = fake_env(fakes, **{**SETUPS[ranks], **FAST, **extra})
    result = run_ringrun(
        "-np", str(ranks), sys.executable, str(WORKER), scenario, extra_env=env, timeout=JOB_BOUND_S
    )
    return result, result.stdout + result.stderr


def assert_named(output: str, ranks: int, where: str) -> None:
    """Every healthy rank that got to its deadline aborted its communicator, naming rank 1
    and where it waited; ringrun names rank 1 as the cause."""
    healthy = [r for r in range(ranks) if r != 1]
    verdicts = [line for line in output.splitlines() if "CommunicatorFailed: rank" in line]
    assert verdicts, output
    for line in verdicts:
        assert any(f"CommunicatorFailed: rank {r} has waited" in line for r in healthy), line
        assert where in line, line
        assert "rank 1 stopped answering" in line and "(RINGPLUG_TIMEOUT=3)" in line, line
    fatal = [line for line in output.splitlines() if "FATAL" in line]
    assert fatal and all("(caused by rank 1)" in line for line in fatal), output


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_peer_that_never_joins_the_nccl_communicator_is_named(fakes, ranks):
    result, output = run_scenario(fakes, "init-frozen", ranks)
    assert result.returncode == 1, output
    assert "rank 1 stops in __init__" in output and "reduced step" not in output
    assert_named(output, ranks, "in NCCL communicator init on GPU 0 (joining)")


def test_a_peer_stuck_before_its_part_of_a_gpu_collective_is_named(fakes):
    result, output = run_scenario(fakes, "collective-frozen", 3)
    assert result.returncode == 1, output
    assert output.count("reduced step 0") == 3 and "reduced step 1" not in output
    assert_named(output, 3, "in allreduce of 1 GPU tensor(s) (NCCL)")


def test_a_rank_that_exits_inside_a_gpu_collective_ends_the_job_naming_it(fakes):
    # Its peer waits inside NCCL; the launcher tears the job down as soon as a rank leaves
    # without MPI_Finalize, long before the timeout, and ringrun names the rank that left.
    result, output = run_scenario(fakes, "exits-in-collective", 2, RINGPLUG_TIMEOUT="60")
    assert result.returncode == 3, output
    assert "rank 1 stops in allreduce" in output and "rank 0 finished" not in output
    assert "ringrun: rank 1 on host" in output and "exited with code 3" in output, output


def test_two_ranks_on_one_gpu_of_one_host_are_refused_as_nccl_refuses_them(fakes):
    env = fake_env(fakes, FAKE_CUDA_DEVICES="1", **FAST)
    result = run_ringrun(
        "-np", "2", sys.executable, str(WORKER), "plain", extra_env=env, timeout=JOB_BOUND_S
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 0" in output
    assert "ncclInvalidUsage" in output and "two ranks on one GPU" in output
    assert "reduced step" not in output
