"""Loaded by every Python process of a run of tests/acceptance/fabric_examples.py (this folder
is on their PYTHONPATH; Python imports `sitecustomize` at start-up). It changes no line of
the examples. Only when ``FABRIC_EXAMPLES_RECORDS`` names a folder, it:

- stands in for CelebA: ``torchvision.datasets.CelebA`` becomes `StandInCelebA`, synthetic
  faces with CelebA's interface (torchvision's class checks the md5 of 1.4 GB of files and
  downloads them otherwise). ``FABRIC_EXAMPLES_CELEBA_IMAGES`` sets how many (default 48).
  Every sample it serves is written down (rank, process, index), so that the run can show
  which rank read which images;
- records, at the start of every forward of every module set up by ``Fabric.setup``, a digest
  of the module's parameters and buffers, after ringplug's own forward pre-hook
  (``BufferSync``) has run: ranks trained as one job hold the same digests forward by forward.

Nothing here imports torch, torchvision or Lightning before the example does: each change is
made right after the module it changes has been imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

RECORDS = os.environ.get("FABRIC_EXAMPLES_RECORDS")
RANK = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "solo"))


def _append(kind: str, record: dict[str, Any]) -> None:
    # One file per process: DataLoader workers are forked and write at the same time.
    path = Path(RECORDS or ".", f"{kind}-{RANK}-{os.getpid()}.jsonl")
    with path.open("a") as file:
        file.write(json.dumps({**record, "time": time.time()}) + "\n")


def _stand_in_celeba() -> type:
    import numpy as np
    import torch
    from PIL import Image
    from torch.utils.data import Dataset

    class StandInCelebA(Dataset):
        """CelebA's stand-in: synthetic 178x218 RGB faces (an ellipse of skin on a
        background, with noise), 40 binary attributes, an identity, a box and landmarks,
        with torchvision's ``CelebA(root, split, target_type, transform, target_transform,
        download)`` signature. ``root`` and ``download`` are ignored; every split has
        ``FABRIC_EXAMPLES_CELEBA_IMAGES`` images."""

        def __init__(
            self,
            root: Any,
            split: str = "train",
            target_type: Any = "attr",
            transform: Any = None,
            target_transform: Any = None,
            download: bool = False,
        ) -> None:
            count = int(os.environ.get("FABRIC_EXAMPLES_CELEBA_IMAGES", "48"))
            self.root, self.split = root, split
            self.target_type = [target_type] if isinstance(target_type, str) else target_type
            self.transform, self.target_transform = transform, target_transform
            rng = np.random.default_rng(7)
            self.filename = [f"{index + 1:06d}.jpg" for index in range(count)]
            self.attr = torch.from_numpy(rng.integers(0, 2, (count, 40)))
            self.identity = torch.from_numpy(rng.integers(1, 10178, (count, 1)))
            self.bbox = torch.from_numpy(rng.integers(0, 100, (count, 4)))
            self.landmarks_align = torch.from_numpy(rng.integers(60, 160, (count, 10)))
            self.attr_names = [f"attribute_{index}" for index in range(40)]

        def __len__(self) -> int:
            return len(self.filename)

        def __getitem__(self, index: int) -> tuple[Any, Any]:
            _append("served", {"index": int(index)})
            rng = np.random.default_rng(index)
            rows, columns = np.mgrid[0:218, 0:178]
            centre_row, centre_column = rng.uniform(95, 125), rng.uniform(75, 105)
            face = ((rows - centre_row) / 70) ** 2 + ((columns - centre_column) / 50) ** 2 < 1
            image = np.empty((218, 178, 3))
            image[:] = rng.uniform(0, 255, 3)
            image[face] = rng.uniform([150, 90, 60], [250, 190, 160])
            image += rng.normal(0, 12, image.shape)
            picture = Image.fromarray(image.clip(0, 255).astype(np.uint8), "RGB")
            targets = []
            for kind in self.target_type:
                if kind == "attr":
                    targets.append(self.attr[index])
                elif kind == "identity":
                    targets.append(int(self.identity[index, 0]))
                elif kind == "bbox":
                    targets.append(self.bbox[index])
                elif kind == "landmarks":
                    targets.append(self.landmarks_align[index])
                else:
                    raise ValueError(f'Target type "{kind}" is not recognized.')
            if self.transform is not None:
                picture = self.transform(picture)
            target: Any = None
            if targets:
                target = tuple(targets) if len(targets) > 1 else targets[0]
                if self.target_transform is not None:
                    target = self.target_transform(target)
            return picture, target

    return StandInCelebA


def _digest(number: int) -> Any:
    def record(module: Any, args: Any) -> None:
        hasher = hashlib.blake2b(digest_size=16)
        finite = True
        for name, tensor in module.state_dict(keep_vars=True).items():
            values = tensor.detach().cpu().contiguous()
            hasher.update(name.encode())
            hasher.update(values.numpy().tobytes())
            finite = finite and bool(values.float().isfinite().all())
        counters = [int(b) for n, b in module.named_buffers() if n.endswith("num_batches_tracked")]
        _append(
            "forward",
            {
                "module": number,
                "training": module.training,
                "digest": hasher.hexdigest(),
                "finite": finite,
                "batches_tracked": counters[0] if counters else None,
            },
        )

    return record


def _probe_setup(fabric_module: Any) -> None:
    original = fabric_module.Fabric.setup
    count = [0]

    def setup(self: Any, module: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, module, *args, **kwargs)
        wrapped = result[0] if isinstance(result, tuple) else result
        # The module the strategy returned: ringplug's BufferSync hooks it first.
        wrapped._forward_module.register_forward_pre_hook(_digest(count[0]))
        count[0] += 1
        return result

    fabric_module.Fabric.setup = setup


def _replace_celeba(datasets: Any) -> None:
    datasets.CelebA = _stand_in_celeba()


AFTER_IMPORT = {"torchvision.datasets": _replace_celeba, "lightning.fabric.fabric": _probe_setup}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs AFTER_IMPORT[name](module) once module `name` has been executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        change = AFTER_IMPORT.pop(fullname, None)
        if change is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            change(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if RECORDS:
    with contextlib.suppress(OSError):
        Path(RECORDS).mkdir(parents=True, exist_ok=True)
    sys.meta_path.insert(0, _AfterImport())
