"""RINGPLUG_* settings: read in one place, with errors that say what to write."""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ringplug import config, wire
from ringplug.config import Settings, parse_bytes, read_settings
from ringplug.core import log
from ringplug.core.ops import ReduceOp, as_op


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("65536", 65536),
        ("64K", 65536),
        ("16M", 16 << 20),
        ("1G", 1 << 30),
        ("16MiB", 16 << 20),
        ("0", 0),
        ("1.5K", 1536),
    ],
)
def test_byte_counts_take_binary_units(text, count):
    assert parse_bytes(text) == count


def test_a_byte_count_that_is_not_one_says_how_to_write_it():
    with pytest.raises(ValueError, match="write e.g. 65536, 64K or 16M"):
        parse_bytes("lots")


def test_unset_variables_give_the_defaults(monkeypatch):
    for name in (
        "RINGPLUG_TIMEOUT",
        "RINGPLUG_RING_THRESHOLD",
        "RINGPLUG_RING_SEGMENT",
        "RINGPLUG_LOG_LEVEL",
        "RINGPLUG_FUSION_THRESHOLD",
        "RINGPLUG_CYCLE_TIME",
        "RINGPLUG_STALL_CHECK_SECONDS",
        "RINGPLUG_STALL_SHUTDOWN_SECONDS",
        "RINGPLUG_TIMELINE",
        "RINGPLUG_EAGER_THRESHOLD",
        "RINGPLUG_BARRIER_TIMEOUT",
        "RINGPLUG_CALIBRATION",  # tests/conftest.py sets it for the suite's jobs
        "RINGPLUG_CALIBRATION_SECONDS",
        "RINGPLUG_ALGORITHM",
    ):
        monkeypatch.delenv(name, raising=False)
    assert read_settings() == Settings()
    assert Settings().timeout == 600  # ten minutes, as torch's NCCL watchdog
    assert Settings().barrier_timeout == 7200  # a long download in prepare_data


def test_a_calibration_that_is_no_choice_names_the_choices(monkeypatch):
    monkeypatch.setenv("RINGPLUG_CALIBRATION", "sometimes")
    with pytest.raises(
        ValueError, match="RINGPLUG_CALIBRATION='sometimes': use one of auto, fresh, fixed"
    ):
        read_settings()
    monkeypatch.setenv("RINGPLUG_CALIBRATION", " FIXED")
    assert read_settings().calibration == "fixed"


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
    [
        ("sum", ReduceOp.SUM),
        ("mean", ReduceOp.AVERAGE),
        ("avg", ReduceOp.AVERAGE),
        ("MAX", ReduceOp.MAX),
        ("min", ReduceOp.MIN),
        ("prod", ReduceOp.PRODUCT),
    ],
)
def test_ops_can_be_named_as_strings(name, op):
    assert as_op(name) is op


def test_an_unknown_op_lists_the_known_ones():
    with pytest.raises(ValueError, match="Unknown reduce op 'median'"):
        as_op("median")


# ------------------------------------------------------------- one declaration per setting
DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
SRC = Path(__file__).resolve().parents[1] / "src" / "ringplug"


def test_the_docs_table_is_the_one_the_declarations_make():
    # python tools/settings_table.py rewrites it; a declaration changed without it fails here.
    page = DOCS.read_text(encoding="utf-8")
    assert config.generated_part(page), "docs/configuration.md lost its generated tables"
    assert config.generated_part(page) == config.markdown(), (
        "docs/configuration.md differs from src/ringplug/config.py: run "
        "`python tools/settings_table.py`"
    )


def test_the_table_check_fails_when_a_declaration_changes(monkeypatch):
    page = DOCS.read_text(encoding="utf-8")
    changed = dataclasses.replace(config.TIMEOUT, default=601.0)
    monkeypatch.setattr(
        config, "VARIABLES", tuple(changed if v is config.TIMEOUT else v for v in config.VARIABLES)
    )
    assert config.generated_part(page) != config.markdown()
    assert "| `601` |" in config.rewrite(page)


def test_every_settings_field_is_read_from_one_declared_variable():
    fields = {field.name: field.default for field in dataclasses.fields(Settings)}
    declared = {v.field: v for v in config.VARIABLES if v.field is not None}
    assert set(fields) == set(declared)
    for name, variable in declared.items():  # the defaults too, in the field's unit
        assert fields[name] == variable.field_value(variable.default), name


def test_every_ringplug_variable_named_in_the_source_is_declared_once():
    # A setting read somewhere without a declaration (or the wire's names written out again)
    # is what this catches: every "RINGPLUG_..." string outside the two declaring modules.
    known = set(config.BY_NAME) | {
        value for name, value in vars(wire).items() if name.endswith("_VARIABLE")
    }
    stray = {}
    for path in SRC.rglob("*.py"):
        if path.name in ("config.py", "wire.py") and path.parent == SRC:
            continue
        for name in re.findall(r"[\"'](RINGPLUG_[A-Z_]+)[\"']", path.read_text(encoding="utf-8")):
            if name not in known:
                stray[name] = path.relative_to(SRC)
    assert stray == {}
    assert len(config.BY_NAME) == len(config.VARIABLES)  # no name declared twice


@pytest.mark.parametrize("variable", config.VARIABLES, ids=lambda v: v.name)
def test_each_declared_default_is_a_value_the_variable_takes(variable):
    if variable.default is not None and variable.form not in (config.PATH, config.PROGRAM):
        text = config.bytes_text(variable.default) if variable.form == config.BYTES else None
        assert variable.parse(text or f"{variable.default}") == variable.default


def test_bounds_are_the_declarations_for_ranks_and_ringrun_alike(monkeypatch):
    monkeypatch.setenv("RINGPLUG_CYCLE_TIME", "1001")
    with pytest.raises(ValueError, match="RINGPLUG_CYCLE_TIME='1001' must be at most 1000"):
        read_settings()
    assert read_settings({"RINGPLUG_CYCLE_TIME": "1000"}).cycle_time == 1.0
    with pytest.raises(ValueError, match="at least 64 bytes"):
        read_settings({"RINGPLUG_RING_SEGMENT": "32"})
    with pytest.raises(ValueError, match="from 0 to 1048576"):
        read_settings({"RINGPLUG_FLIGHT_RECORD": "many"})


def test_the_log_level_is_read_through_its_declaration(monkeypatch):
    logger = logging.getLogger("ringplug")
    try:
        monkeypatch.delenv("RINGPLUG_LOG_LEVEL", raising=False)
        log.configure(1, "DEBUG")
        assert logger.level == logging.ERROR  # not set explicitly: ranks > 0 log errors only
        monkeypatch.setenv("RINGPLUG_LOG_LEVEL", "debug")
        log.configure(1, "DEBUG")
        assert logger.level == logging.DEBUG
    finally:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True


def test_ringruns_side_loads_the_declarations_without_the_core():
    # ringrun and the per-rank wrapper use ringplug.config and ringplug.wire: the core and
    # numpy stay out of them, and a later core import shares the same declarations.
    code = (
        "import sys, ringplug.run.launch.wrapper, ringplug.run.cli\n"
        "print(sorted(m for m in ('numpy', 'mpi4py', 'ringplug.core', 'ringplug.core.engine')"
        " if m in sys.modules))\n"
        "from ringplug import config\n"
        "import ringplug.core.runtime as runtime\n"
        "print(runtime.Settings is config.Settings is sys.modules[config.__name__].Settings)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "True"]
