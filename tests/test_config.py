"""RINGPLUG_* settings: read in one place, with errors that say what to write."""

from __future__ import annotations

import pytest

from ringplug.core.config import Settings, parse_bytes, read_settings
from ringplug.core.ops import ReduceOp, as_op


@pytest.mark.parametrize(
    ("text", "count"),
    [("65536", 65536), ("64K", 65536), ("16M", 16 << 20), ("1G", 1 << 30), ("16MiB", 16 << 20),
     ("0", 0), ("1.5K", 1536)],
)  # fmt: skip
def test_byte_counts_take_binary_units(text, count):
    assert parse_bytes(text) == count


def test_a_byte_count_that_is_not_one_says_how_to_write_it():
    with pytest.raises(ValueError, match="write e.g. 65536, 64K or 16M"):
        parse_bytes("lots")


def test_unset_variables_give_the_defaults(monkeypatch):
    for name in ("RINGPLUG_TIMEOUT", "RINGPLUG_RING_THRESHOLD", "RINGPLUG_RING_SEGMENT",
                 "RINGPLUG_LOG_LEVEL", "RINGPLUG_FUSION_THRESHOLD", "RINGPLUG_CYCLE_TIME",
                 "RINGPLUG_STALL_CHECK_SECONDS", "RINGPLUG_STALL_SHUTDOWN_SECONDS",
                 "RINGPLUG_TIMELINE", "RINGPLUG_EAGER_THRESHOLD",
                 "RINGPLUG_BARRIER_TIMEOUT"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    assert read_settings() == Settings()
    assert Settings().timeout == 600  # ten minutes, as torch's NCCL watchdog
    assert Settings().barrier_timeout == 7200  # a long download in prepare_data


def test_a_bad_barrier_timeout_names_the_variable(monkeypatch):
    monkeypatch.setenv("RINGPLUG_BARRIER_TIMEOUT", "0")
    with pytest.raises(ValueError, match="RINGPLUG_BARRIER_TIMEOUT='0' must be a positive"):
        read_settings()


def test_variables_override_the_defaults(monkeypatch):
    monkeypatch.setenv("RINGPLUG_TIMEOUT", "30")
    monkeypatch.setenv("RINGPLUG_RING_THRESHOLD", "2M")
    monkeypatch.setenv("RINGPLUG_LOG_LEVEL", "debug")
    settings = read_settings()
    assert (settings.timeout, settings.ring_threshold, settings.log_level) == (30, 2 << 20, "DEBUG")


@pytest.mark.parametrize("value", ["soon", "0", "-5"])
def test_a_bad_timeout_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("RINGPLUG_TIMEOUT", value)
    with pytest.raises(ValueError, match="RINGPLUG_TIMEOUT"):
        read_settings()


@pytest.mark.parametrize(
    ("name", "op"),
    [("sum", ReduceOp.SUM), ("mean", ReduceOp.AVERAGE), ("avg", ReduceOp.AVERAGE),
     ("MAX", ReduceOp.MAX), ("min", ReduceOp.MIN), ("prod", ReduceOp.PRODUCT)],
)  # fmt: skip
def test_ops_can_be_named_as_strings(name, op):
    assert as_op(name) is op


def test_an_unknown_op_lists_the_known_ones():
    with pytest.raises(ValueError, match="Unknown reduce op 'median'"):
        as_op("median")
