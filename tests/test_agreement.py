"""The checksums behind ``check_agreement``, in one process: torch's (where the tensor lives)
equal numpy's on the host, for every dtype and layout, and any changed word changes them."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ringplug.torch as rpt  # noqa: E402
from ringplug.agreement import numpy_checksum  # noqa: E402
from ringplug.torch.agreement import checksums  # noqa: E402

TENSORS = {
    "float32-odd": torch.randn(7),
    "float64": torch.randn(3, 5, dtype=torch.float64),
    "float16": torch.randn(5).half(),
    "bfloat16": torch.randn(9).bfloat16(),
    "int8": torch.arange(-5, 6, dtype=torch.int8),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(3.5),
    "empty": torch.zeros(0),
    "transposed": torch.randn(3, 4).t(),
    "unaligned-view": torch.randn(11)[1:],
    "complex": torch.randn(3, dtype=torch.complex64),
}


def host_bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_torch_checksums_equal_numpys_of_the_same_bytes(name):
    tensor = TENSORS[name]
    assert checksums([tensor]) == [numpy_checksum(host_bytes(tensor))]


def test_any_changed_element_changes_the_checksum_nan_included():
    values = torch.randn(13)
    before = checksums([values])[0]
    for index in range(values.numel()):
        changed = values.clone()
        changed[index] = torch.nextafter(changed[index], torch.tensor(float("inf")))
        assert checksums([changed])[0] != before
    nan = torch.tensor([float("nan"), 1.0])
    assert checksums([nan]) == checksums([nan.clone()])


def test_a_world_of_one_always_agrees():
    rpt.init()
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    rpt.check_agreement(model, optimizer, where="alone")
