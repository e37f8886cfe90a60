"""Each rank on its own GPU: `ringplug.keras.init()` pins the backend to the local rank's.

With several ranks on a host, TensorFlow and JAX would each compute on GPU 0 and reserve
memory on every GPU they see (TensorFlow most of each one, JAX 75%), so the ranks would
share one GPU and starve the others. Horovod's examples pin by hand
(``tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")``); `init()` does it:

- TensorFlow: only the local rank's GPU visible, with memory growth (TensorFlow then
  takes memory as it needs it), before TensorFlow sets up its devices.
- JAX: ``jax_cuda_visible_devices`` set to the local rank's GPU before JAX starts its
  backends (what ``jax.distributed.initialize(local_device_ids=...)`` sets too).
- torch: ``cuda:LOCAL_RANK`` made torch's current device (`ringplug.torch.device`), which
  is what Keras's ``"cuda"`` means.

Once the framework has set its devices up, they cannot change: then `init()` raises
(with more than one GPU visible and more than one rank on the host), saying to call it
first.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import pkgutil
from typing import Any

from .. import core
from ..core.errors import RingplugError

logger = logging.getLogger(__name__)


def pin_local_gpu(backend: str) -> int | None:
    """Pin `backend` to this rank's GPU; returns its index among the visible GPUs, or None
    when the process sees none (or the backend has no GPU support here)."""
    if backend == "tensorflow":
        return _pin_tensorflow()
    if backend == "jax":
        return _pin_jax()
    if backend == "torch":
        from ..torch.device import use_local_gpu

        return use_local_gpu()
    return None


def gpu_for_this_rank(visible: int, framework: str) -> int:
    """Which of `visible` GPUs this rank takes; raises when it has none of its own."""
    local_rank, local_size = core.local_rank(), core.local_size()
    if visible == 1:
        return 0  # the host has one, or the launcher gave each rank its own
    if local_rank >= visible:
        raise RingplugError(
            f"Rank {core.rank()} is local rank {local_rank} of {local_size} on its host, which "
            f"shows {framework} {visible} GPUs: it has no GPU of its own (ranks sharing a GPU "
            f"would each reserve its memory). Start at most {visible} ranks per host "
            f"(ringrun -H host:{visible},...), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to "
            "train on CPUs."
        )
    return local_rank


def _too_late(framework: str, seen: str, wanted: int, how: str) -> RingplugError:
    return RingplugError(
        f"{framework} set up its GPUs ({seen}) before ringplug.keras.init() could give rank "
        f"{core.rank()} (local rank {core.local_rank()} of {core.local_size()} on this host) "
        f"its own GPU, {wanted}: every rank would compute on the same GPU and reserve memory "
        f"on all of them. Call ringplug.keras.init() at the top of the script, before any "
        f"{framework} operation or Keras model, or pin it yourself first ({how})."
    )


# ------------------------------------------------------------------ TensorFlow
def _pin_tensorflow() -> int | None:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    index = gpu_for_this_rank(len(gpus), "TensorFlow")
    wanted = gpus[index]
    try:
        tf.config.set_visible_devices(wanted, "GPU")
        if tf.config.get_logical_device_configuration(wanted) is None:
            # Not with virtual devices (a memory limit the user set): TensorFlow refuses both.
            tf.config.experimental.set_memory_growth(wanted, True)
    except RuntimeError:  # "cannot be modified after being initialized"
        visible = tf.config.get_visible_devices("GPU")
        if visible == [wanted] or (core.local_size() == 1 and visible[:1] == [wanted]):
            return index  # already this rank's GPU (pinned by hand, or one rank here)
        names = ", ".join(device.name for device in visible) or "none"
        raise _too_late(
            "TensorFlow",
            f"visible: {names}",
            index,
            'tf.config.set_visible_devices(gpus[local_rank], "GPU")',
        ) from None
    logger.debug("TensorFlow pinned to %s", wanted.name)
    return index


@functools.cache  # TensorFlow's devices are fixed once it exports tensors
def physical_gpu(logical: int) -> int:
    """The CUDA device index (among the visible ones) of TensorFlow's ``GPU:logical``.

    TensorFlow numbers the GPUs it was allowed to use from 0 (its DLPack exports say 0 for
    the one `init()` pinned), while NCCL and the CUDA runtime count every visible GPU.
    """
    import tensorflow as tf

    visible = tf.config.get_visible_devices("GPU")
    if len(tf.config.list_logical_devices("GPU")) != len(visible) or logical >= len(visible):
        return logical  # virtual devices split a GPU: no one-to-one map; keep TF's number
    return int(visible[logical].name.rsplit(":", 1)[1])


# ------------------------------------------------------------------ JAX
def _pin_jax() -> int | None:
    if not _jax_has_cuda():
        return None
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return _check_jax_started(jax)
    visible = _cuda_device_count()
    if visible == 0:
        return None
    index = core.local_rank() if visible is None else gpu_for_this_rank(visible, "JAX")
    requested = jax.config.read("jax_cuda_visible_devices")
    if requested != "all":
        logger.debug("jax_cuda_visible_devices=%s was set by the user; left as it is", requested)
        return None
    jax.config.update("jax_cuda_visible_devices", str(index))
    logger.debug("JAX pinned to CUDA device %d", index)
    return index


def _check_jax_started(jax: Any) -> int | None:
    """JAX already started: fine if it sees one GPU (or this host runs one rank)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend came up
        return None
    if len(gpus) <= 1 or core.local_size() == 1:
        return 0
    index = gpu_for_this_rank(len(gpus), "JAX")
    raise _too_late(
        "JAX",
        f"{len(gpus)} GPUs",
        index,
        'jax.config.update("jax_cuda_visible_devices", str(local_rank))',
    )


def _jax_has_cuda() -> bool:
    """Whether a CUDA plugin for JAX is installed (jax[cuda12] / jax[cuda13])."""
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    import jax_plugins

    return any("cuda" in module.name for module in pkgutil.iter_modules(jax_plugins.__path__))


def _cuda_device_count() -> int | None:
    """How many GPUs the CUDA runtime sees (without starting JAX), or None if unknown."""
    from ..core.gpu.cuda import CudaError, CudaRuntime

    try:
        return CudaRuntime().device_count()
    except (CudaError, OSError):
        return None
