"""`ringrun -np N python gpu_defaults.py FRAMEWORK OUTDIR`: which GPU each rank takes by
default, on a host whose GPUs are faked (this machine has none), and which choices are
refused. Each rank writes OUTDIR/FRAMEWORK-RANK.json with what it saw.

- ``lightning``: ``Trainer(accelerator="gpu")`` with strategy "ring" and `RingStrategy()`,
  default and explicit ``devices``, hosts of 4, 2 and 1 visible GPUs; then
  ``ringplug.torch.init()`` and ``init_process_group("ringplug")``.
- ``keras``: ``ringplug.keras.init()`` on TensorFlow (4 fake GPUs; TensorFlow set up
  already), and the JAX pin (before and after JAX started).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ringplug


def error_of(make: Callable[[], Any]) -> str:
    """`make()`'s error message, or "" when it succeeded."""
    try:
        make()
    except Exception as error:  # noqa: BLE001 - the message is what the test reads
        return f"{type(error).__name__}: {error}"
    return ""


# ------------------------------------------------------------------ Lightning and torch
@contextlib.contextmanager
def fake_cuda(visible: int) -> Iterator[None]:
    """torch (and so Lightning) sees `visible` GPUs; CUDA itself is never touched."""
    import torch

    saved = torch.cuda.is_available, torch.cuda.device_count, torch.cuda.is_initialized
    torch.cuda.is_available = lambda: visible > 0
    torch.cuda.device_count = lambda: visible
    torch.cuda.is_initialized = lambda: False
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.device_count, torch.cuda.is_initialized = saved


def lightning(report: dict[str, Any]) -> None:
    import lightning.pytorch as pl
    import torch

    from ringplug.lightning import RingStrategy

    def trainer(strategy: Any = "ring", **kwargs: Any) -> pl.Trainer:
        return pl.Trainer(
            strategy=strategy,
            accelerator="gpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            **kwargs,
        )

    def placed(made: pl.Trainer) -> dict[str, Any]:
        return {
            "root": str(made.strategy.root_device),
            "num_devices": made.num_devices,
            "world": made.world_size,
        }

    with fake_cuda(4):
        report["auto_by_name"] = placed(trainer())
        report["auto_instance"] = placed(trainer(RingStrategy()))
        report["devices_2"] = error_of(lambda: trainer(devices=2))
        report["devices_1"] = error_of(lambda: trainer(devices=1))
        report["num_nodes_2"] = error_of(lambda: trainer(num_nodes=2))
    with fake_cuda(2):
        report["two_gpus"] = error_of(trainer) or placed(trainer())
    with fake_cuda(1):  # each rank given its own GPU (CUDA_VISIBLE_DEVICES per rank)
        report["one_gpu_each"] = placed(trainer())

    # ringplug.torch.init() and the torch.distributed backend: cuda:LOCAL_RANK, queued with
    # torch's lazy CUDA initialisation (which never comes here: it is run by hand).
    import torch.distributed as dist

    import ringplug.torch as rpt
    from ringplug.torch import device as rpt_device

    queued: list[Callable[[], None]] = []
    chosen: list[int] = []
    real_lazy_call, real_set_device = torch.cuda._lazy_call, torch.cuda.set_device
    torch.cuda._lazy_call = lambda call, **_: queued.append(call)
    torch.cuda.set_device = lambda index: chosen.append(int(index))
    try:
        with fake_cuda(4):
            rpt.init()
            report["torch_init_queued"] = len(queued)
            for call in queued:
                call()
            report["torch_init_device"] = chosen[:]
            rpt.init()  # again: nothing more is queued
            report["torch_init_again_queued"] = len(queued)
            rpt_device._queued.clear()
            queued.clear()
            chosen.clear()
            dist.init_process_group(
                "ringplug", store=dist.HashStore(), rank=ringplug.rank(), world_size=ringplug.size()
            )
            dist.destroy_process_group()
            for call in queued:
                call()
            report["backend_device"] = chosen[:]
            rpt_device._queued.clear()
            queued.clear()
            torch.cuda.is_initialized = lambda: True  # the user already chose a device
            torch.cuda.current_device = lambda: 0
            rpt.init()
            report["user_chose_queued"] = len(queued)
    finally:
        torch.cuda._lazy_call, torch.cuda.set_device = real_lazy_call, real_set_device


# ------------------------------------------------------------------ Keras
def keras(report: dict[str, Any]) -> None:
    import tensorflow as tf

    import ringplug.keras as rk
    from ringplug.keras import _devices

    gpus = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(4)]
    real_list = tf.config.list_physical_devices
    calls: dict[str, list[Any]] = {"visible": [], "growth": []}

    def list_physical_devices(device_type: str | None = None) -> list[Any]:
        return gpus if device_type == "GPU" else real_list(device_type)

    tf.config.list_physical_devices = list_physical_devices
    tf.config.set_visible_devices = lambda devices, kind=None: calls["visible"].append(
        (getattr(devices, "name", None), kind)
    )
    tf.config.get_logical_device_configuration = lambda device: None
    tf.config.experimental.set_memory_growth = lambda device, on: calls["growth"].append(
        (device.name, on)
    )
    rk.init()
    report["tf_visible"] = calls["visible"]
    report["tf_growth"] = calls["growth"]

    def already_started(devices: Any, kind: Any = None) -> None:
        raise RuntimeError("Visible devices cannot be modified after being initialized")

    tf.config.set_visible_devices = already_started
    tf.config.get_visible_devices = lambda kind=None: gpus
    report["tf_too_late"] = error_of(rk.init)
    tf.config.get_visible_devices = lambda kind=None: [gpus[ringplug.local_rank()]]
    report["tf_pinned_by_hand"] = error_of(rk.init)

    # JAX: the pin is a flag read when JAX starts its backends.
    import jax
    from jax._src import xla_bridge

    _devices._jax_has_cuda = lambda: True
    _devices._cuda_device_count = lambda: 4
    report["jax_pinned"] = _devices.pin_local_gpu("jax")
    report["jax_flag"] = jax.config.read("jax_cuda_visible_devices")
    report["jax_user_flag_kept"] = _devices.pin_local_gpu("jax")
    jax.config.update("jax_cuda_visible_devices", "all")
    real_started, real_devices = xla_bridge.backends_are_initialized, jax.devices
    xla_bridge.backends_are_initialized = lambda: True
    jax.devices = lambda backend=None: ["gpu0", "gpu1", "gpu2", "gpu3"]
    report["jax_too_late"] = error_of(lambda: _devices.pin_local_gpu("jax"))
    xla_bridge.backends_are_initialized, jax.devices = real_started, real_devices


def main(framework: str, outdir: str) -> None:
    ringplug.init()
    report: dict[str, Any] = {
        "rank": ringplug.rank(),
        "local_rank": ringplug.local_rank(),
        "local_size": ringplug.local_size(),
    }
    {"lightning": lightning, "keras": keras}[framework](report)
    path = Path(outdir) / f"{framework}-{ringplug.rank()}.json"
    path.write_text(json.dumps(report))
    ringplug.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
