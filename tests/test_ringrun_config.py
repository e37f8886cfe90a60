"""``ringrun --config-file``: YAML and TOML settings, overridden by flags."""

from __future__ import annotations

import shlex
import sys

import pytest

from launch import run_ringrun
from ringplug.run.configfile import ConfigFileError, load_config_file
from ringplug.run.settings import RunSettings, SettingsError


def dry_run_words(*args: str) -> list[str]:
    result = run_ringrun("--dry-run", *args, timeout=30)
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout)


def test_yaml_file_sets_every_kind_of_setting(tmp_path):
    config = tmp_path / "launch.yaml"
    config.write_text(
        "np: 4\nhosts: [node1:2, node2:2]\nnetwork_interfaces: [eth0]\nssh_port: 2222\n"
        "env: {NCCL_DEBUG: INFO, RETRIES: 3}\noutput_filename: logs\nbind_to: core\n"
        "verbose: true\n"
    )
    assert load_config_file(config) == RunSettings(
        np=4,
        hosts=["node1:2", "node2:2"],
        network_interfaces=["eth0"],
        ssh_port=2222,
        env={"NCCL_DEBUG": "INFO", "RETRIES": "3"},
        output_filename="logs",
        bind_to="core",
        verbose=True,
    )


def test_toml_file_reads_the_same_settings(tmp_path):
    config = tmp_path / "launch.toml"
    config.write_text('np = 2\nhosts = "a:1,b:1"\n[env]\nFOO = "bar"\n')
    assert load_config_file(config) == RunSettings(np=2, hosts="a:1,b:1", env={"FOO": "bar"})


def test_config_file_drives_the_launch(tmp_path):
    config = tmp_path / "launch.toml"
    config.write_text('np = 3\nhosts = ["a:2", "b:1"]\nbind_to = "core"\n')
    words = dry_run_words("--config-file", str(config), "python", "x.py")
    assert "-n" in words and words[words.index("-n") + 1] == "3"
    assert words[words.index("-hosts") + 1] == "a:2,b:1"
    assert words[words.index("-bind-to") + 1] == "core"


def test_flags_win_over_the_config_file(tmp_path):
    config = tmp_path / "launch.yaml"
    config.write_text("np: 4\nhosts: a:2,b:2\nenv: {FOO: from-file, KEEP: kept}\n")
    words = dry_run_words(
        "--config-file",
        str(config),
        "-np",
        "2",
        "-H",
        "c:2",
        "-x",
        "FOO=from-flag",
        "python",
        "x.py",
    )
    assert words[words.index("-n") + 1] == "2"
    assert words[words.index("-hosts") + 1] == "c:2"
    # Both values reach mpiexec through its environment (shown by name only).
    assert "FOO=<hidden>" in words and "KEEP=<hidden>" in words
    assert not {"from-flag", "from-file", "kept"} & {part for w in words for part in w.split("=")}


def test_hostfile_flag_replaces_hosts_from_the_file(tmp_path):
    config = tmp_path / "launch.yaml"
    config.write_text("hosts: a:2\n")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("z slots=2\n")
    words = dry_run_words("--config-file", str(config), "--hostfile", str(hostfile), "python")
    assert words[words.index("-hosts") + 1] == "z:2"


def test_unknown_key_is_named_with_the_allowed_keys(tmp_path):
    config = tmp_path / "launch.yaml"
    config.write_text("np: 2\nnum_proc: 4\n")
    with pytest.raises(SettingsError) as error:
        load_config_file(config)
    message = str(error.value)
    assert "'num_proc'" in message
    assert "np, hosts, hostfile, network_interfaces" in message


def test_unknown_key_makes_ringrun_exit_with_a_usage_error(tmp_path):
    config = tmp_path / "launch.toml"
    config.write_text("nprocs = 2\n")
    result = run_ringrun("--config-file", str(config), "python", "x.py", timeout=30)
    assert result.returncode == 2
    assert "unknown setting 'nprocs'" in result.stderr


def test_wrong_value_type_says_what_was_expected(tmp_path):
    config = tmp_path / "launch.yaml"
    config.write_text("np: four\n")
    with pytest.raises(SettingsError, match="np must be a whole number"):
        load_config_file(config)


def test_yaml_without_pyyaml_says_how_to_install_it(tmp_path, monkeypatch):
    config = tmp_path / "launch.yaml"
    config.write_text("np: 2\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes `import yaml` fail
    with pytest.raises(ConfigFileError, match="pip install pyyaml"):
        load_config_file(config)


def test_unsupported_suffix_is_rejected(tmp_path):
    config = tmp_path / "launch.json"
    config.write_text("{}")
    with pytest.raises(ConfigFileError, match=r"\.yaml, \.yml or \.toml"):
        load_config_file(config)
