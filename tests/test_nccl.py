"""The GPU data plane without a GPU: NCCL's loading order, version, unique ids and errors,
and the engine's NCCL path end to end against fake NCCL and CUDA runtime libraries.

The fakes (tests/fakes/*.c) have the real libraries' C ABI, so these tests go through the
same ctypes binding as a GPU job; their "device memory" is host memory. What needs a real
GPU is in tests/gpu/check_gpu.sh.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fakegpu import fake_env
from launch import run_ringrun

pytestmark = pytest.mark.fakegpu

WORKERS = Path(__file__).parent / "workers"


def run_python(code: str, env: dict[str, str], timeout: float = 120) -> dict:
    """Run `code` in a fresh interpreter (its own /proc/self/maps and library loads); it
    prints one JSON object last."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


# Makes `from cuda import pathfinder` fail in a child, as where cuda-pathfinder is not installed.
WITHOUT_PATHFINDER = "import sys; sys.modules['cuda.pathfinder'] = None\n"


def _has_pathfinder() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("cuda.pathfinder") is not None
    except ModuleNotFoundError:
        return False


needs_pathfinder = pytest.mark.skipif(
    not _has_pathfinder(), reason="cuda-pathfinder is not installed (the dev extra brings it)"
)


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without ringplug's and the CUDA install roots' variables."""
    drop = ("RINGPLUG_", "NCCL_HOME", "CUDA_HOME", "CUDA_PATH", "CONDA_PREFIX")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


# ---------------------------------------------------------------------- versions and loading
@pytest.mark.parametrize(
    ("code", "expected"),
    [(2708, (2, 7, 8)), (21003, (2, 10, 3)), (22703, (2, 27, 3)), (23203, (2, 32, 3))],
)
def test_version_codes_of_old_and_new_releases_parse(code, expected):
    from ringplug.core.gpu.nccl import parse_version

    assert parse_version(code) == expected


def test_the_explicit_library_is_used_and_reported_with_its_version(fakes, monkeypatch):
    from ringplug.core.gpu import nccl

    monkeypatch.setenv("FAKE_NCCL_VERSION", "22703")
    found = nccl.version({"RINGPLUG_NCCL_LIB": fakes["nccl"]})
    assert (found.major, found.minor, found.patch) == (2, 27, 3)
    assert str(found) == "2.27.3"
    assert found.path == fakes["nccl"] and "RINGPLUG_NCCL_LIB" in found.source
    # A folder holding libnccl.so.2 works too.
    assert nccl.version({"RINGPLUG_NCCL_LIB": fakes["dir"]}).path == fakes["nccl"]


def test_a_missing_explicit_library_is_an_error_not_a_silent_fallback(tmp_path):
    from ringplug.core.gpu import nccl

    with pytest.raises(nccl.NcclNotFound) as caught:
        nccl.version({"RINGPLUG_NCCL_LIB": str(tmp_path / "nope.so")})
    message = str(caught.value)
    assert str(tmp_path / "nope.so") in message
    assert "ringplug[cuda13]" in message and "ringplug[cuda12]" in message


def test_a_library_already_loaded_in_the_process_comes_before_the_wheels(fakes, tmp_path):
    site = _fake_wheel(tmp_path, "nvidia-nccl-cu13", fakes["nccl"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGPLUG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    preloaded = tmp_path / "preloaded" / "libnccl.so.2"
    preloaded.parent.mkdir()
    shutil.copy(fakes["nccl"], preloaded)
    # ringplug's own order; cuda-pathfinder's is in the test after this one.
    report = run_python(
        WITHOUT_PATHFINDER
        + f"""
import ctypes, json
from ringplug.core.gpu import nccl
before = nccl.version()
nccl._loaded = None
ctypes.CDLL({str(preloaded)!r})  # as `import torch` (CUDA build) does
after = nccl.version()
print(json.dumps({{"before": [before.source, before.path],
                  "after": [after.source, after.path]}}))
""",
        env,
    )
    assert report["before"][0] == "the nvidia-nccl-cu13 wheel"
    assert report["after"] == ["a libnccl already loaded in this process", str(preloaded)]


@needs_pathfinder
def test_cuda_pathfinder_takes_the_nccl_already_loaded_and_names_it_again_when_asked(
    fakes, tmp_path
):
    site = _fake_wheel(tmp_path, "nvidia-nccl-cu13", fakes["nccl"])
    preloaded = tmp_path / "preloaded" / "libnccl.so.2"
    preloaded.parent.mkdir()
    shutil.copy(fakes["nccl"], preloaded)
    env = _clean_env(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    report = run_python(
        f"""
        import ctypes, json
        ctypes.CDLL({str(preloaded)!r})  # as `import torch` (CUDA build) does
        from ringplug.core.gpu import nccl
        first = nccl.candidates()[0]
        found = nccl.version()
        print(json.dumps({{"first": first, "found": [found.source, found.path]}}))
    """,
        env,
    )
    expected = ["cuda-pathfinder (already loaded)", str(preloaded)]
    assert report["first"] == expected and report["found"] == expected


def test_the_cuda13_wheel_is_preferred_to_the_cuda12_wheel(fakes, tmp_path):
    from ringplug.core.gpu import nccl

    cu12 = _fake_wheel(tmp_path / "a", "nvidia-nccl-cu12", fakes["nccl"])
    cu13 = _fake_wheel(tmp_path / "b", "nvidia-nccl-cu13", fakes["nccl"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGPLUG_")}
    code = """
        import json
        from ringplug.core.gpu import nccl
        print(json.dumps({"source": nccl.version().source}))
    """
    env["PYTHONPATH"] = os.pathsep.join([str(cu12), str(cu13)])
    assert run_python(code, env)["source"] == "the nvidia-nccl-cu13 wheel"
    env["PYTHONPATH"] = str(cu12)
    assert run_python(code, env)["source"] == "the nvidia-nccl-cu12 wheel"
    assert nccl  # imported here only to fail early if the module is broken


@pytest.mark.parametrize("pathfinder", [False, pytest.param(True, marks=needs_pathfinder)])
def test_the_system_library_path_is_searched_last(fakes, tmp_path, pathfinder):
    if shutil.which("objdump") is None and shutil.which("ld") is None:
        pytest.skip("ctypes.util.find_library needs binutils to search LD_LIBRARY_PATH")
    lib = tmp_path / "lib"
    lib.mkdir()
    shutil.copy(fakes["nccl"], lib / "libnccl.so.2")
    (lib / "libnccl.so").symlink_to("libnccl.so.2")
    report = run_python(
        ("" if pathfinder else WITHOUT_PATHFINDER)
        + """
import json
from ringplug.core.gpu import nccl
places = nccl.candidates()
found = nccl.version()
print(json.dumps({"source": found.source, "path": found.path,
                  "wheels": [path for place, path in places if path and "wheel" in place]}))
""",
        _clean_env(LD_LIBRARY_PATH=str(lib)),
    )
    if report["wheels"]:
        pytest.skip(f"this machine has another NCCL: {report['wheels']}")
    # cuda-pathfinder, where installed, asks the system loader itself (dlopen honours
    # LD_LIBRARY_PATH); ringplug's own last place is ctypes.util.find_library.
    expected = "cuda-pathfinder (the system library path)" if pathfinder else "the system library"
    assert report["source"].startswith(expected)
    if pathfinder:  # ctypes.util.find_library gives a name for the loader, not a path
        assert report["path"] == str(lib / "libnccl.so.2")


@needs_pathfinder
def test_cuda_pathfinder_finds_nccl_in_its_install_root_and_cudart_in_an_nvidia_wheel(
    fakes, tmp_path
):
    # NCCL_HOME is a place only cuda-pathfinder searches. The CUDA runtime is laid out as
    # the nvidia-cuda-runtime wheel lays it out in site-packages (cuda-pathfinder's own
    # wheel search, which comes before the system's libcudart this machine may have).
    nccl_home, site_dir = tmp_path / "nccl", tmp_path / "site-packages"
    (nccl_home / "lib").mkdir(parents=True)
    (site_dir / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    shutil.copy(fakes["nccl"], nccl_home / "lib" / "libnccl.so.2")
    cudart = site_dir / "nvidia" / "cu13" / "lib" / "libcudart.so.13"
    shutil.copy(fakes["cudart"], cudart)
    env = _clean_env(NCCL_HOME=str(nccl_home), FAKE_NCCL_VERSION="22905")
    report = run_python(
        f"""
        import json, site
        site.getsitepackages = lambda: [{str(site_dir)!r}]  # a venv with the wheel
        from ringplug.core.gpu import cuda, nccl
        found = nccl.version()
        runtime = cuda.CudaRuntime()
        print(json.dumps({{"nccl": [found.source, found.path, str(found)],
                          "cudart": cuda.cudart_candidates()[0], "runtime": runtime.path}}))
    """,
        env,
    )
    assert report["nccl"] == [
        "cuda-pathfinder (NCCL_HOME)",
        str(nccl_home / "lib" / "libnccl.so.2"),
        "2.29.5",
    ]
    assert report["cudart"] == ["cuda-pathfinder (an NVIDIA wheel)", str(cudart)]
    assert report["runtime"] == str(cudart)
    # Without cuda-pathfinder NCCL_HOME means nothing to ringplug: no NCCL is found there.
    blocked = run_python(
        WITHOUT_PATHFINDER
        + """
import json
from ringplug.core.gpu import nccl
try:
    print(json.dumps({"found": nccl.version().path}))
except nccl.NcclNotFound as error:
    print(json.dumps({"found": None, "message": str(error)}))
""",
        env,
    )
    if blocked["found"] is not None:
        pytest.skip(f"this machine has another NCCL: {blocked['found']}")
    assert "cuda-pathfinder" not in blocked["message"]


@needs_pathfinder
def test_the_library_variables_come_before_cuda_pathfinder(fakes, tmp_path):
    nccl_home, cuda_home = tmp_path / "nccl", tmp_path / "cuda"
    (nccl_home / "lib").mkdir(parents=True)
    (cuda_home / "lib64").mkdir(parents=True)
    shutil.copy(fakes["nccl"], nccl_home / "lib" / "libnccl.so.2")
    shutil.copy(fakes["cudart"], cuda_home / "lib64" / "libcudart.so.13")
    env = _clean_env(
        NCCL_HOME=str(nccl_home),
        CUDA_HOME=str(cuda_home),
        RINGPLUG_NCCL_LIB=fakes["nccl"],
        RINGPLUG_CUDART_LIB=fakes["cudart"],
    )
    report = run_python(
        """
        import json
        from ringplug.core.gpu import cuda, nccl
        print(json.dumps({"nccl": [p for _, p in nccl.candidates()],
                          "cudart": [p for _, p in cuda.cudart_candidates()],
                          "loaded": nccl.version().path}))
    """,
        env,
    )
    assert report == {
        "nccl": [fakes["nccl"]],
        "cudart": [fakes["cudart"]],
        "loaded": fakes["nccl"],
    }


def test_no_library_anywhere_names_every_place_searched_and_how_to_install(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGPLUG_")}
    env["LD_LIBRARY_PATH"] = str(tmp_path)
    report = run_python(
        """
        import json
        from ringplug.core.gpu import nccl
        try:
            nccl.version()
            print(json.dumps({"found": True}))
        except nccl.NcclNotFound as error:
            print(json.dumps({"found": False, "message": str(error)}))
    """,
        env,
    )
    if report["found"]:
        pytest.skip("this machine has an NCCL library installed")
    message = report["message"]
    for place in ("already loaded", "nvidia-nccl-cu13", "nvidia-nccl-cu12", "system library path"):
        assert place in message
    assert "pip install 'ringplug[cuda13]'" in message and "RINGPLUG_NCCL_LIB" in message


def _fake_wheel(site: Path, distribution: str, library: str) -> Path:
    """A site folder where `distribution` is installed with libnccl.so.2 (as NVIDIA's wheels
    lay it out)."""
    target = site / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    target.parent.mkdir(parents=True)
    shutil.copy(library, target)
    info = site / f"{distribution.replace('-', '_')}-2.32.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 2.32.3\n"
    )
    (info / "RECORD").write_text("nvidia/nccl/lib/libnccl.so.2,,\n")
    return site


# ---------------------------------------------------------------------- ids and errors
def test_unique_ids_are_128_bytes_and_new_each_time(fakes):
    from ringplug.core.gpu import nccl

    library = nccl.load({"RINGPLUG_NCCL_LIB": fakes["nccl"]})
    first, second = nccl.unique_id(library), nccl.unique_id(library)
    assert len(first) == len(second) == nccl.UNIQUE_ID_BYTES
    assert first != second


def test_nccl_results_become_errors_with_nccls_own_strings_and_what_to_do(fakes, monkeypatch):
    from ringplug.core.gpu import nccl

    library = nccl.load({"RINGPLUG_NCCL_LIB": fakes["nccl"]})
    monkeypatch.setenv("FAKE_NCCL_INIT_ERROR", "1")
    with pytest.raises(nccl.NcclError) as caught:
        nccl.Communicator(library, nccl.unique_id(library), 2, 0, 0)
    error = caught.value
    assert error.code == 1
    text = str(error)
    assert "ncclCommInitRank(rank 0 of 2, GPU 0)" in text
    assert "ncclUnhandledCudaError" in text and "unhandled cuda error (fake)" in text
    assert "CUDA driver version is insufficient" in text  # ncclGetLastError
    assert "nvidia-smi" in text  # the hint
    with pytest.raises(nccl.NcclError, match="ncclRemoteError.*peer rank failed"):
        library.check(6, "ncclAllReduce")
    library.check(nccl.SUCCESS, "ncclAllReduce")  # success raises nothing


def test_a_wrong_size_unique_id_is_refused(fakes):
    from ringplug.core.gpu import nccl

    library = nccl.load({"RINGPLUG_NCCL_LIB": fakes["nccl"]})
    with pytest.raises(ValueError, match="128 bytes"):
        nccl.Communicator(library, b"short", 1, 0, 0)


@pytest.mark.parametrize(
    ("local_rank", "visible", "expected"),
    [(0, 1, 0), (3, 1, 0), (0, 4, 0), (2, 4, 2)],
)
def test_each_local_rank_gets_its_own_gpu(local_rank, visible, expected):
    from ringplug.core.gpu.plane import device_for_local_rank

    assert device_for_local_rank(local_rank, visible) == expected


def test_no_gpu_or_too_few_gpus_are_errors_that_say_what_to_do(monkeypatch):
    from ringplug.core.gpu.cuda import CudaError
    from ringplug.core.gpu.plane import device_for_local_rank

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(CudaError, match=r"No GPU is visible .*CUDA_VISIBLE_DEVICES=\)"):
        device_for_local_rank(0, 0)
    with pytest.raises(CudaError, match="Local rank 4 has no GPU of its own: 4 are visible"):
        device_for_local_rank(4, 4)


def test_nccl_has_no_int16_and_says_what_to_convert_to():
    from ringplug.core.dtypes import DType
    from ringplug.core.gpu.device import nccl_type

    with pytest.raises(TypeError, match="int32"):
        nccl_type(DType.INT16)
    assert nccl_type(DType.BFLOAT16) == 9 and nccl_type(DType.FLOAT32) == 7


def test_premultiplied_sum_scalars_have_the_data_type_bytes():
    from ringplug.core.dtypes import DType
    from ringplug.core.gpu.plane import scalar_bytes

    assert scalar_bytes(0.5, DType.FLOAT32) == np.float32(0.5).tobytes()
    assert scalar_bytes(0.25, DType.FLOAT64) == np.float64(0.25).tobytes()
    assert scalar_bytes(0.5, DType.FLOAT16) == np.float16(0.5).tobytes()
    assert scalar_bytes(0.5, DType.BFLOAT16) == bytes([0x00, 0x3F])  # 0x3F00 little-endian


# ---------------------------------------------------------------------- DLPack
def test_dlpack_capsules_give_address_type_shape_and_device_without_being_consumed():
    torch = pytest.importorskip("torch")
    from torch.utils.dlpack import to_dlpack

    from ringplug.core.dtypes import DType
    from ringplug.core.gpu.device import DL_CPU, read_dlpack

    tensor = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    capsule = to_dlpack(tensor)
    view = read_dlpack(capsule)
    assert view.address == tensor.data_ptr()
    assert (view.code, view.shape, view.device_type) == (DType.BFLOAT16, (3, 4), DL_CPU)
    assert view.contiguous
    assert not read_dlpack(to_dlpack(tensor.t())).contiguous
    assert torch.from_dlpack(capsule).equal(tensor)  # still consumable by its owner


def test_host_tensors_are_refused_by_the_nccl_path():
    torch = pytest.importorskip("torch")
    from torch.utils.dlpack import to_dlpack

    from ringplug.core.gpu.device import from_dlpack

    with pytest.raises(TypeError, match="not in GPU memory"):
        from_dlpack(to_dlpack(torch.ones(3)))


# ---------------------------------------------------------------------- the engine on fakes
def test_the_engine_reduces_gpu_buffers_through_nccl(fakes):
    report = run_python(
        f"""
        import ctypes, json
        import numpy as np
        import ringplug
        from ringplug.core import device_collectives as dc, runtime
        from ringplug.core.gpu.device import DeviceBuffer
        from ringplug.core.dtypes import DType
        from ringplug.core.engine.handles import Request

        ringplug.init()
        lib = ctypes.CDLL({fakes["nccl"]!r})

        def buf(array, code):
            return DeviceBuffer(array.ctypes.data, array.size, code, 0, array)

        a = np.arange(6, dtype=np.float32)
        b = np.full(3, 2.0, np.float32)
        # A fused group (two tensors, one NCCL call) with scale factors inside NCCL.
        group = [buf(a, DType.FLOAT32), buf(b, DType.FLOAT32)]
        dc.allreduce_async(group, group, [(2, 3), (3,)], "sum", prescale_factor=3.0,
                           postscale_factor=0.5, name="g").wait()
        # bfloat16 Average with a prescale: NCCL's premultiplied sum in bfloat16.
        words = (np.array([1.0, 2.0, -4.0], np.float32).view(np.uint32) >> 16).astype(np.uint16)
        dc.allreduce_async([buf(words, DType.BFLOAT16)], [buf(words, DType.BFLOAT16)], [(3,)],
                           "average", prescale_factor=0.5, name="bf").wait()
        widened = (words.astype(np.uint32) << 16).view(np.float32)
        # Out of place: the input is left alone.
        src, dst = np.arange(4, dtype=np.float64), np.zeros(4)
        dc.allreduce_async([buf(src, DType.FLOAT64)], [buf(dst, DType.FLOAT64)], [(4,)], "max",
                           name="oop").wait()
        gathered = dc.allgather_async(buf(b, DType.FLOAT32), (3,), name="ag").wait()
        gathered_values = np.ctypeslib.as_array(
            (ctypes.c_float * gathered.count).from_address(gathered.address)).tolist()
        block = dc.reducescatter_async(buf(a, DType.FLOAT32), (6,), "sum", postscale_factor=2.0,
                                       name="rs").wait()
        block_values = np.ctypeslib.as_array(
            (ctypes.c_float * block.count).from_address(block.address)).tolist()
        engine = runtime.engine()
        print(json.dumps({{
            "a": a.tolist(), "b": b.tolist(), "bf16": widened.tolist(),
            "src": src.tolist(), "dst": dst.tolist(), "gathered": gathered_values,
            "block": block_values, "live_ops": lib.fakeNcclLivePremulOps(),
            "groups": lib.fakeNcclMaxGroupDepth(), "device": engine._gpu.device,
        }}))
    """,
        fake_env(fakes),
    )
    assert report["a"] == [0.0, 1.5, 3.0, 4.5, 6.0, 7.5]  # x * 3 * 0.5 over one rank
    assert report["b"] == [3.0, 3.0, 3.0]
    assert report["bf16"] == [0.5, 1.0, -2.0]
    assert report["src"] == [0.0, 1.0, 2.0, 3.0] and report["dst"] == [0.0, 1.0, 2.0, 3.0]
    assert report["gathered"] == [3.0, 3.0, 3.0]
    assert report["block"] == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]
    assert report["live_ops"] == 0  # every premultiplied-sum op was destroyed
    assert report["device"] == 0


def test_a_gpu_request_without_a_gpu_fails_on_every_rank_before_nccl(fakes):
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        str(WORKERS / "fake_gpu.py"),
        "no-gpu",
        extra_env=fake_env(fakes, FAKE_CUDA_DEVICES="0"),
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if "no-gpu:" in line]
    assert len(lines) == 2, result.stdout
    assert all("No GPU is visible" in line for line in lines)


def test_ranks_join_one_communicator_with_rank_zeros_unique_id(fakes):
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        str(WORKERS / "fake_gpu.py"),
        "uid",
        extra_env=fake_env(fakes, FAKE_CUDA_DEVICES="2"),
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    reports = [
        json.loads(line.split("uid:", 1)[1])
        for line in result.stdout.splitlines()
        if "uid:" in line
    ]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert len({r["uid"] for r in reports}) == 1  # the same id on both ranks
    rank0 = next(r for r in reports if r["rank"] == 0)
    assert f"pid={rank0['pid']}" in rank0["uid"]  # ...made by rank 0
    assert all(r["ranks"] == 2 for r in reports)
    assert all(r["values"] == [1.0] * 4 for r in reports)  # rank 0's, on both


def test_a_peer_failure_aborts_the_communicator_and_fails_every_gpu_collective(fakes):
    env = fake_env(fakes, FAKE_CUDA_EVENT_NEVER="1", FAKE_NCCL_ASYNC_ERROR="6")
    report = run_python(
        f"""
        import ctypes, json
        import numpy as np
        import ringplug
        from ringplug.core import device_collectives as dc
        from ringplug.core.gpu.device import DeviceBuffer
        from ringplug.core.dtypes import DType

        ringplug.init()
        lib = ctypes.CDLL({fakes["nccl"]!r})
        a = np.ones(4, np.float32)
        buffers = [DeviceBuffer(a.ctypes.data, 4, DType.FLOAT32, 0, a)]
        errors = []
        for name in ("first", "second"):
            try:
                dc.allreduce_async(buffers, buffers, [(4,)], "sum", name=name).wait(timeout=60)
                errors.append(None)
            except Exception as error:
                errors.append([type(error).__name__, str(error)])
        print(json.dumps({{"errors": errors, "aborts": lib.fakeNcclAborts()}}))
    """,
        env,
    )
    first, second = report["errors"]
    assert first[0] == "CommunicatorFailed"
    assert "ncclRemoteError" in first[1] and "peer rank 1 closed its connection" in first[1]
    assert "aborted" in first[1]
    assert second == first  # the communicator is gone: later GPU collectives fail alike
    assert report["aborts"] == 1


def test_a_collective_that_never_finishes_is_aborted_at_the_timeout(fakes):
    env = fake_env(fakes, FAKE_CUDA_EVENT_NEVER="1", RINGPLUG_TIMEOUT="1")
    report = run_python(
        """
        import ctypes, json
        import numpy as np
        import ringplug
        from ringplug.core import device_collectives as dc
        from ringplug.core.gpu.device import DeviceBuffer
        from ringplug.core.dtypes import DType

        ringplug.init()
        lib = ctypes.CDLL(__import__("os").environ["RINGPLUG_NCCL_LIB"])
        a = np.ones(4, np.float32)
        buffers = [DeviceBuffer(a.ctypes.data, 4, DType.FLOAT32, 0, a)]
        errors = []
        for name in ("stuck", "after"):
            try:
                dc.allreduce_async(buffers, buffers, [(4,)], "sum", name=name).wait(timeout=60)
                errors.append(None)
            except Exception as error:
                errors.append([type(error).__name__, str(error), error.code])
        print(json.dumps({"errors": errors, "aborts": lib.fakeNcclAborts()}))
    """,
        env,
    )
    (kind, message, code), second = report["errors"]
    assert kind == "CommunicatorFailed" and code == 8  # ncclTimeout
    assert "rank 0 has waited 1 s in allreduce of 1 GPU tensor(s) (NCCL)" in message
    assert "this rank is the whole job, and its own work did not finish" in message
    assert "(RINGPLUG_TIMEOUT=1)" in message and "communicator was aborted" in message
    assert second[0] == "CommunicatorFailed"  # every later GPU collective fails too
    assert report["aborts"] == 1


def test_tensorflow_gpu_tensors_go_by_dlpack_into_fresh_result_tensors(fakes):
    pytest.importorskip("tensorflow")
    env = fake_env(fakes, TF_CPP_MIN_LOG_LEVEL="3")
    report = run_python(
        """
        import json
        import tensorflow as tf
        import ringplug
        from ringplug.core.gpu import device
        from ringplug.keras import _tf_gpu

        ringplug.init()
        # The fake CUDA runtime's "device memory" is host memory: let host tensors stand in.
        device.NCCL_DEVICE_TYPES.add(device.DL_CPU)
        a = tf.constant([[1.0, 2.0], [3.0, 4.0]])
        b = tf.constant([10.0, 20.0, 30.0])
        out = _tf_gpu.allreduce([a, b], "sum", "tf.grads", prescale_factor=2.0)
        grads = _tf_gpu.reduce_gradients([a, tf.constant([1, 2], tf.int32)], ringplug.Sum,
                                         "tf.step", fp16=True)
        addr = lambda t: device.read_dlpack(tf.experimental.dlpack.to_dlpack(t)).address
        print(json.dumps({
            "a": a.numpy().tolist(), "out": [o.numpy().tolist() for o in out],
            "fresh": addr(out[0]) != addr(a) and addr(out[1]) != addr(b),
            "grads": [g.numpy().tolist() for g in grads],
            "dtypes": [g.dtype.name for g in grads],
        }))
    """,
        env,
        timeout=240,
    )
    assert report["a"] == [[1.0, 2.0], [3.0, 4.0]]  # TensorFlow's input is never written
    assert report["out"] == [[[2.0, 4.0], [6.0, 8.0]], [20.0, 40.0, 60.0]]
    assert report["fresh"]
    assert report["grads"] == [[[1.0, 2.0], [3.0, 4.0]], [1, 2]]
    assert report["dtypes"] == ["float32", "int32"]  # fp16 on the wire, back to float32


# ---------------------------------------------------------------------- ringrun and NCCL_*
def test_nccl_variables_reach_every_rank_through_ringrun():
    code = (
        "import os; print('rank-env', os.environ.get('NCCL_DEBUG'), os.environ.get('NCCL_IB_HCA'))"
    )
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        "-c",
        code,
        extra_env={"NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5_0"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("rank-env INFO mlx5_0") == 2, result.stdout


def test_open_mpi_is_told_to_forward_nccl_variables(tmp_path):
    from launch import fake_open_mpi

    mpiexec = fake_open_mpi(tmp_path)
    result = run_ringrun(
        "-np",
        "2",
        "--dry-run",
        "python",
        "x.py",
        extra_env={"RINGPLUG_MPIEXEC": str(mpiexec), "NCCL_DEBUG": "INFO"},
    )
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert "NCCL_DEBUG" in [words[i + 1] for i, w in enumerate(words[:-1]) if w == "-x"]


def test_ringrun_check_reports_the_nccl_library_and_its_version(fakes):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGPLUG_")}
    env.update(
        RINGPLUG_NCCL_LIB=fakes["nccl"],
        RINGPLUG_CUDART_LIB=fakes["cudart"],
        FAKE_NCCL_VERSION="22703",
        FAKE_CUDA_DEVICES="2",
    )
    result = run_ringrun("--check", env=env)
    assert result.returncode == 0, result.stderr
    report = result.stdout
    assert "NCCL and GPUs" in report
    assert f"2.27.3 at {fakes['nccl']}" in report
    assert "GPUs visible" in report and "  2" in report.split("GPUs visible", 1)[1].splitlines()[0]
    env["RINGPLUG_NCCL_LIB"] = "/nonexistent/libnccl.so.2"
    missing = run_ringrun("--check", env=env).stdout
    assert "not found" in missing.split("NCCL and GPUs", 1)[1]
    assert "WARNING: this host has 2 GPU(s) but no NCCL" in missing
    assert "ringplug[cuda13]" in missing


def test_horovods_nccl_built_reports_the_version_code_of_the_library_found(fakes):
    code = """
        import json
        import ringplug.horovod.torch as hvd
        print(json.dumps({"nccl": hvd.nccl_built(), "cuda": hvd.cuda_built()}))
    """
    found = run_python(code, fake_env(fakes, FAKE_NCCL_VERSION="22703"))
    assert found == {"nccl": 22703, "cuda": True}
    missing = run_python(code, fake_env(fakes, RINGPLUG_NCCL_LIB="/nonexistent/libnccl.so.2"))
    assert missing == {"nccl": 0, "cuda": False}


# ---------------------------------------------------------------------- the binding's edges
def _fake_pathfinder(monkeypatch, not_found: type, raises: type, *extra: type) -> None:
    """A cuda-pathfinder whose load raises `raises`, with `extra` error classes as well."""
    import types

    module = types.ModuleType("cuda.pathfinder")
    module.DynamicLibNotFoundError = not_found
    for error in extra:
        setattr(module, error.__name__, error)

    def load(name):
        raise raises(f"{name} is not a library this release knows")

    module.load_nvidia_dynamic_lib = load
    package = types.ModuleType("cuda")
    package.pathfinder = module
    monkeypatch.setitem(sys.modules, "cuda", package)
    monkeypatch.setitem(sys.modules, "cuda.pathfinder", module)


def test_cuda_pathfinder_not_knowing_a_library_is_told_apart_from_not_finding_it(monkeypatch):
    from ringplug.core.gpu.libraries import pathfinder_library

    # Current releases: the "unknown" errors subclass DynamicLibNotFoundError.
    class DynamicLibNotFoundError(Exception):
        pass

    class DynamicLibUnknownError(DynamicLibNotFoundError):
        pass

    class DynamicLibNotAvailableError(DynamicLibNotFoundError):
        pass

    _fake_pathfinder(
        monkeypatch,
        DynamicLibNotFoundError,
        DynamicLibUnknownError,
        DynamicLibUnknownError,
        DynamicLibNotAvailableError,
    )
    assert pathfinder_library("nccl") == (
        "cuda-pathfinder (nccl is not a library this release knows)",
        None,
    )


def test_an_older_cuda_pathfinder_without_the_unknown_errors_still_says_not_found(monkeypatch):
    from ringplug.core.gpu.libraries import pathfinder_library

    class DynamicLibNotFoundError(Exception):
        pass

    _fake_pathfinder(monkeypatch, DynamicLibNotFoundError, DynamicLibNotFoundError)
    place, path = pathfinder_library("nccl")
    assert path is None and place.startswith("cuda-pathfinder (NVIDIA wheels")


def test_a_driver_older_than_the_runtime_is_said_so_not_taken_for_no_gpu(fakes):
    env = fake_env(fakes, FAKE_CUDA_COUNT_ERROR="35", FAKE_CUDA_DRIVER_VERSION="12080")
    report = run_python(
        """
        import json
        from ringplug.core.gpu.cuda import CudaError, CudaRuntime
        try:
            print(json.dumps({"count": CudaRuntime().device_count()}))
        except CudaError as error:
            print(json.dumps({"error": str(error)}))
    """,
        env,
    )
    message = report["error"]
    assert "CUDA error 35" in message and "driver version is insufficient" in message
    assert "supports CUDA 12.8, older than the CUDA runtime 13.0" in message
    assert "ringplug[cuda12]" in message
    none = run_python(
        """
        import json
        from ringplug.core.gpu.cuda import CudaRuntime
        print(json.dumps({"count": CudaRuntime().device_count()}))
    """,
        fake_env(fakes, FAKE_CUDA_DEVICES="0"),
    )
    assert none == {"count": 0}  # cudaErrorNoDevice is no GPU, not an error


def test_communicators_are_made_without_blocking_and_closed_by_a_deadline(fakes):
    report = run_python(
        """
        import json, threading
        from ringplug.core.gpu import cuda, nccl

        runtime = cuda.CudaRuntime()
        runtime.set_device(0)
        library = nccl.load()
        # Rank 0 of 2, and its peer never comes: the call returns, ready() says not yet.
        lonely = nccl.Communicator(library, nccl.unique_id(library), 2, 0, 0, blocking=False)
        waiting = [lonely.ready() for _ in range(3)]
        closed_lonely = lonely.close(0.5)  # nothing to finish: aborted, at once
        # Two ranks (two threads, GPUs 0 and 1) join the same id and close cleanly.
        def join(rank, uid, comms):
            runtime.set_device(rank)
            comms[rank] = nccl.Communicator(library, uid, 2, rank, rank, blocking=False)

        def pair():
            uid, comms = nccl.unique_id(library), {}
            threads = [threading.Thread(target=join, args=(r, uid, comms)) for r in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            while not all(c.ready() for c in comms.values()):
                pass
            return comms

        comms = pair()
        closed = [comms[r].close(10) for r in (0, 1)]
        # Work its peer never does: finalizing cannot finish, so close aborts at its deadline.
        again = pair()
        runtime.set_device(0)
        stream = runtime.new_stream()
        address, owner = runtime.alloc(16)
        again[0].allreduce(address, address, 4, 7, nccl.OP_SUM, stream)  # rank 1 never does
        stuck = again[0].close(0.5)
        print(json.dumps({
            "waiting": waiting, "lonely": closed_lonely, "closed": closed, "stuck": stuck,
            "call": lonely.call, "aborts": library.lib.fakeNcclAborts(),
        }))
    """,
        fake_env(fakes, FAKE_CUDA_DEVICES="2"),
    )
    assert report["waiting"] == [False, False, False]
    assert report["call"] == "ncclCommInitRankConfig(rank 0 of 2, GPU 0)"
    assert report["lonely"] is False
    assert report["closed"] == [True, True]  # finalized, then destroyed
    assert report["stuck"] is False and report["aborts"] == 2  # the lonely one, the stuck one
