"""Element types: what the core accepts, and bfloat16 handled as raw 16-bit words."""

from __future__ import annotations

import numpy as np
import pytest

from ringplug.core.dtypes import DType, bfloat16_to_float32, classify, float32_to_bfloat16


@pytest.mark.parametrize(
    ("dtype", "code"),
    [
        (np.float16, DType.FLOAT16),
        (np.float32, DType.FLOAT32),
        (np.float64, DType.FLOAT64),
        (np.int8, DType.INT8),
        (np.int16, DType.INT16),
        (np.int32, DType.INT32),
        (np.int64, DType.INT64),
        (np.uint8, DType.UINT8),
        (np.bool_, DType.BOOL),
    ],
)
def test_numpy_types_map_to_their_wire_codes(dtype, code):
    assert classify(np.zeros(2, dtype)) is code


def test_raw_words_are_read_as_bfloat16_only_when_asked():
    words = np.zeros(4, np.uint16)
    assert classify(words, "bfloat16") is DType.BFLOAT16
    with pytest.raises(TypeError, match="Unsupported dtype uint16"):
        classify(words)


def test_a_buffer_of_the_wrong_width_cannot_be_read_as_bfloat16():
    with pytest.raises(TypeError, match="4 bytes per element.*cannot be read as bfloat16"):
        classify(np.zeros(4, np.float32), "bfloat16")


@pytest.mark.parametrize("dtype", [np.complex64, np.uint32, np.float128])
def test_unsupported_types_are_refused_with_the_supported_list(dtype):
    with pytest.raises(TypeError, match="ringplug reduces float16, bfloat16, float32"):
        classify(np.zeros(2, dtype))


def test_bfloat16_words_widen_to_the_float32_with_the_same_top_half():
    words = np.array([0x3F80, 0xC000, 0x0000, 0x7F80], np.uint16)  # 1, -2, 0, +inf
    assert bfloat16_to_float32(words).tolist() == [1.0, -2.0, 0.0, float("inf")]


def test_float32_rounds_to_the_nearest_bfloat16_with_ties_to_even():
    one_ulp = 2.0**-7  # bfloat16 spacing just above 1.0
    values = np.array(
        [
            1.0 + one_ulp / 2,  # halfway between 1.0 (even) and 1+ulp: rounds down to even
            1.0 + 3 * one_ulp / 2,  # halfway between 1+ulp (odd) and 1+2ulp (even): rounds up
            1.0 + one_ulp * 0.51,
        ],  # above halfway: rounds up
        np.float32,
    )
    words = float32_to_bfloat16(values, np.empty(3, np.uint16))
    assert bfloat16_to_float32(words).tolist() == [1.0, 1.0 + 2 * one_ulp, 1.0 + one_ulp]


def test_nan_stays_nan_when_rounded_to_bfloat16():
    words = float32_to_bfloat16(np.array([np.nan, -np.nan], np.float32), np.empty(2, np.uint16))
    assert np.isnan(bfloat16_to_float32(words)).all()
