"""A Lightning fit and a Keras fit with ringplug's defaults, one rank (run by check_gpu.sh).

    python tests/gpu/check_fits.py lightning [--device cuda|cpu]
    python tests/gpu/check_fits.py keras [--backend jax|torch|tensorflow] [--device cuda|cpu]

Each check prints PASS, FAIL (with the reason) or SKIP (with the reason); the exit code is
the number of failures (2 for bad arguments). On the GPU (``--device cuda``, the default)
the checks prove that the defaults put the rank on its GPU (``cuda:LOCAL_RANK``, here 0)
without being told, and that a fit there gives the weights of the same training done by
hand. ``--device cpu`` runs the same fits on CPUs, so the script itself is tested on
machines without a GPU (tests/test_gpu_defaults.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable

RESULTS: list[tuple[str, str]] = []


def check(name: str, body: Callable[[], str | None]) -> None:
    """Run one check and print its line (a failure does not stop the others)."""
    start = time.perf_counter()
    try:
        skipped = body()
        status, detail = ("SKIP", skipped) if skipped else ("PASS", "")
    except Exception as error:  # noqa: BLE001 - every check reports, none stops the rest
        status, detail = "FAIL", f"{type(error).__name__}: {error}"
        traceback.print_exc()
    RESULTS.append((name, status))
    print(f"{status} {name} ({time.perf_counter() - start:.1f} s) {detail}", flush=True)


# ------------------------------------------------------------------ Lightning
def lightning(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        check("Lightning on the GPU", lambda: "torch sees no GPU here")
        return
    import ringplug.lightning  # noqa: F401 - strategy="ring"
    import ringplug.torch as rpt

    def torch_init() -> str | None:
        if device != "cuda":
            return "no CUDA with --device cpu"
        fresh = not torch.cuda.is_initialized()
        rpt.init()
        if fresh:  # queued with torch's lazy initialisation: no CUDA context made yet
            assert not torch.cuda.is_initialized(), "ringplug.torch.init() started CUDA"
        current = torch.cuda.current_device()  # starts CUDA, which runs the queued choice
        assert current == rpt.local_rank(), f"current device {current}, local rank 0"
        assert torch.ones(1, device="cuda").device == torch.device("cuda", rpt.local_rank())
        return None

    check("ringplug.torch.init() makes cuda:LOCAL_RANK torch's device, lazily", torch_init)
    accelerator = "gpu" if device == "cuda" else "cpu"
    check(
        f"Lightning: Trainer(strategy='ring', accelerator={accelerator!r}) with default "
        "devices fits like plain torch",
        lambda: lightning_fit(device),
    )


def lightning_fit(device: str) -> None:
    import lightning.pytorch as pl
    import torch

    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x @ torch.arange(1.0, 9.0).unsqueeze(1)
    start = torch.nn.Linear(8, 1).state_dict()

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.net.load_state_dict(start)

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return torch.nn.functional.mse_loss(self.net(inputs), targets)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    model = Model()
    trainer = pl.Trainer(
        strategy="ring",
        accelerator="gpu" if device == "cuda" else "cpu",
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,  # one rank: the batches in order
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    expected_device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    assert trainer.strategy.root_device == expected_device, trainer.strategy.root_device
    assert trainer.num_devices == 1, trainer.num_devices
    trainer.fit(model, data)
    assert trainer.state.finished, trainer.state
    assert next(model.parameters()).device == expected_device  # where it trained

    # The same training by hand, on the same device.
    reference = torch.nn.Linear(8, 1).to(expected_device)
    reference.load_state_dict(start)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for _ in range(3):
        for inputs, targets in data:
            optimizer.zero_grad()
            inputs, targets = inputs.to(expected_device), targets.to(expected_device)
            torch.nn.functional.mse_loss(reference(inputs), targets).backward()
            optimizer.step()
    for got, want in zip(model.net.parameters(), reference.parameters(), strict=True):
        difference = (got.detach() - want.detach()).abs().max().item()
        assert difference < 1e-5, f"weights differ from plain torch by {difference}"


# ------------------------------------------------------------------ Keras
def keras_checks(device: str, backend: str) -> None:
    import importlib.util

    if importlib.util.find_spec(backend) is None or importlib.util.find_spec("keras") is None:
        check(f"Keras ({backend})", lambda: f"keras or {backend} is not installed here")
        return
    import keras

    import ringplug.keras as rk

    def init() -> str | None:
        rk.init()
        where = _backend_device(backend)
        if device == "cpu":
            assert where == "cpu", f"{backend} computes on {where} with --device cpu"
            return None
        assert where == "gpu", f"{backend} computes on {where}"
        chosen = _pinned_gpu(backend)
        assert chosen == 0, f"{backend} pinned to GPU {chosen}, local rank 0"
        return None

    check(f"ringplug.keras.init() puts {backend} on this rank's {device.upper()}", init)
    check(
        f"Keras ({backend}): fit with DistributedOptimizer equals the plain optimizer's",
        lambda: keras_fit(keras, rk, backend, device),
    )


def _pinned_gpu(backend: str) -> object:
    """The GPU `init()` left the backend (CUDA's number), as the backend reports it."""
    if backend == "jax":
        import jax

        return int(jax.config.read("jax_cuda_visible_devices"))
    if backend == "torch":
        import torch

        return torch.cuda.current_device()
    import tensorflow as tf

    visible = tf.config.get_visible_devices("GPU")
    return int(visible[0].name.rsplit(":", 1)[1]) if len(visible) == 1 else visible


def _backend_device(backend: str) -> str:
    """Where the backend puts a new tensor: "gpu" or "cpu"."""
    if backend == "jax":
        import jax

        platform = jax.numpy.ones(1).devices().pop().platform
        return "gpu" if platform in ("gpu", "cuda") else platform
    if backend == "torch":
        import keras

        return "gpu" if keras.ops.ones(1).device.type == "cuda" else "cpu"
    import tensorflow as tf

    return "gpu" if "GPU" in tf.ones(1).device.upper() else "cpu"


def keras_fit(keras, rk, backend: str, device: str) -> None:
    import numpy as np

    generator = np.random.default_rng(0)
    x = generator.standard_normal((64, 8)).astype("float32")
    y = (x @ np.arange(1.0, 9.0, dtype="float32"))[:, None]

    def trained(optimizer) -> list[np.ndarray]:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
        assert _variable_device(model.weights[0], backend) == _expected(device), "placement"
        return [np.asarray(keras.ops.convert_to_numpy(w)) for w in model.weights]

    plain = trained(keras.optimizers.SGD(0.05))
    distributed = trained(rk.DistributedOptimizer(keras.optimizers.SGD(0.05)))
    for got, want in zip(distributed, plain, strict=True):
        difference = float(np.abs(got - want).max())
        assert difference < 1e-5, f"weights differ from the plain optimizer's by {difference}"


def _expected(device: str) -> str:
    return "gpu" if device == "cuda" else "cpu"


def _variable_device(variable, backend: str) -> str:
    value = variable.value
    if backend == "jax":
        platform = value.devices().pop().platform
        return "gpu" if platform in ("gpu", "cuda") else platform
    if backend == "torch":
        return "gpu" if value.device.type == "cuda" else "cpu"
    return "gpu" if "GPU" in value.device.upper() else "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("framework", choices=["lightning", "keras"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--backend",
        choices=["jax", "torch", "tensorflow"],
        default="jax",
        help="Keras's backend (default jax: the GPU machine has no TensorFlow)",
    )
    args = parser.parse_args(argv)
    if args.device == "cpu":
        # Before any framework starts: nothing may find a GPU.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["JAX_PLATFORMS"] = "cpu"
    if args.framework == "keras":
        os.environ["KERAS_BACKEND"] = args.backend  # read once, when Keras is imported
        keras_checks(args.device, args.backend)
    else:
        lightning(args.device)
    failures = sum(status == "FAIL" for _, status in RESULTS)
    print(
        f"check_fits.py {args.framework}: {len(RESULTS) - failures} of {len(RESULTS)} passed "
        f"or skipped, {failures} failed",
        flush=True,
    )
    return failures


if __name__ == "__main__":
    sys.exit(main())
