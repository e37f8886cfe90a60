"""A ringrun setting is one declaration: the parser, config file, merge, checks and rank
variables all come from the field that declares it."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from ringplug.run import settings as declared
from ringplug.run.cli import build_parser, settings_from_args
from ringplug.run.settings import NUMBER, RunSettings, SettingsError, setting, within

DOCS = Path(__file__).resolve().parents[1] / "docs" / "ringrun.md"


@dataclass
class WithWarmup(RunSettings):
    """RunSettings and one more setting, declared as a new one would be."""

    warmup_seconds: float | None = setting(
        NUMBER,
        "seconds of warm-up before timing",
        flags=("--warmup-seconds",),
        horovodrun=("--warmup-time",),
        metavar="S",
        check=within("warmup_seconds must be 0 or more, got {value}", low=0),
        ranks=lambda seconds: {"RINGPLUG_WARMUP_SECONDS": f"{seconds:g}"},
    )


def parse(cls: type, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    declared.add_flags(cls, parser, horovodrun=False)
    declared.add_flags(cls, parser.add_argument_group("horovodrun"), horovodrun=True)
    return parser.parse_args(argv)


def test_a_new_field_is_a_flag_in_both_spellings():
    assert declared.from_flags(WithWarmup, parse(WithWarmup, ["--warmup-seconds", "2.5"])) == (
        WithWarmup(warmup_seconds=2.5)
    )
    assert declared.from_flags(WithWarmup, parse(WithWarmup, ["--warmup-time", "1"])) == (
        WithWarmup(warmup_seconds=1.0)
    )


def test_a_new_field_is_a_config_key_with_its_type_checked():
    assert WithWarmup.from_mapping({"warmup_seconds": 3}, "job.toml").warmup_seconds == 3.0
    with pytest.raises(SettingsError, match="job.toml: warmup_seconds must be a number, got 'x'"):
        WithWarmup.from_mapping({"warmup_seconds": "x"}, "job.toml")
    assert WithWarmup.keys()[-1] == "warmup_seconds"


def test_a_new_field_is_checked_merged_and_reaches_the_ranks():
    with pytest.raises(SettingsError, match="warmup_seconds must be 0 or more, got -1"):
        WithWarmup(warmup_seconds=-1.0).validate()
    merged = WithWarmup(warmup_seconds=4.0, np=2).overridden_by(WithWarmup(warmup_seconds=1.0))
    assert (merged.warmup_seconds, merged.np) == (1.0, 2)
    assert WithWarmup(warmup_seconds=0.5).rank_variables() == {"RINGPLUG_WARMUP_SECONDS": "0.5"}
    assert WithWarmup().rank_variables() == {}


def test_flags_win_over_the_config_file_and_hosts_replace_a_hostfile(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text('np = 4\nhostfile = "hosts.txt"\nenv = {A = "file", B = "file"}\n')
    args = build_parser().parse_args(
        ["--config-file", str(config), "-H", "a:2", "-x", "B=flag", "python"]
    )
    settings = settings_from_args(args)
    assert (settings.np, settings.hosts, settings.hostfile) == (4, "a:2", None)
    assert settings.env == {"A": "file", "B": "flag"}


def test_every_flag_of_every_setting_is_in_the_ringrun_guide():
    text = DOCS.read_text()
    missing = [
        spelling
        for _, declaration in declared.declarations(RunSettings)
        for flag in declaration.flags
        for spelling in flag.spellings
        if not re.search(f"`{re.escape(spelling)}[ `=/]", text)
    ]
    assert missing == []


def test_every_setting_is_a_config_key_and_has_help():
    names = RunSettings.keys()
    assert names[:4] == ["np", "hosts", "hostfile", "network_interfaces"]
    for _, declaration in declared.declarations(RunSettings):
        assert declaration.help and declaration.help[0].islower()
