"""The CUDA-runtime (ctypes) path on a GPU, without torch: CuPy or JAX arrays by DLPack.

This is the path TensorFlow's tensors take (TensorFlow is not on the GPU machine); CuPy and
JAX arrays exercise the same code: DLPack export, ``libcudart`` streams, events and copies,
NCCL on raw device pointers. Prints PASS, SKIP or FAIL; exits 1 on failure.
"""

from __future__ import annotations

import sys

import numpy as np


def arrays():
    """(name, make(values) -> device array, to_numpy, capsule_of)."""
    try:
        import cupy

        return ("cupy", cupy.asarray, cupy.asnumpy, lambda a: a.toDlpack())
    except ImportError:
        pass
    try:
        import jax
        import jax.numpy as jnp

        if not any(d.platform == "gpu" for d in jax.devices()):
            return None
        return (
            "jax",
            lambda v: jax.device_put(jnp.asarray(v), jax.devices("gpu")[0]),
            np.asarray,
            lambda a: a.__dlpack__(),
        )
    except ImportError:
        return None


def main() -> int:
    found = arrays()
    if found is None:
        print("SKIP the CUDA-runtime path: neither CuPy nor JAX with a GPU is installed")
        return 0
    name, make, to_numpy, capsule_of = found
    import ringplug
    from ringplug.core import device_collectives
    from ringplug.core.gpu import cuda
    from ringplug.core.gpu.device import from_dlpack

    ringplug.init()
    runtime = cuda.default_runtime()
    assert isinstance(runtime, cuda.CudaRuntime), f"expected the ctypes runtime, got {runtime}"
    print(f"  {name} arrays; CUDA runtime {runtime.path}; {runtime.device_count()} GPU(s)")
    values = np.arange(1000, dtype=np.float32)
    source, target = make(values), make(np.zeros_like(values))
    send, out = from_dlpack(capsule_of(source), source), from_dlpack(capsule_of(target), target)
    handle = device_collectives.allreduce_async(
        [send], [out], [(1000,)], "sum", prescale_factor=2.0, name="cudart.sum"
    )
    handle.wait()
    result = to_numpy(target)
    if not np.allclose(result, values * 2):
        print(f"FAIL the CUDA-runtime path: got {result[:5]}..., expected {values[:5] * 2}...")
        return 1
    if not np.array_equal(to_numpy(source), values):
        print("FAIL the CUDA-runtime path: the input was written")
        return 1
    print(f"PASS the CUDA-runtime path ({name} arrays by DLPack, out of place, premul sum)")
    ringplug.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
