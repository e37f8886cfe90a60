"""Reading ``ringrun --config-file`` files (YAML or TOML) into :class:`RunSettings`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ringplug.run.settings import RunSettings, SettingsError, read_text_file


class ConfigFileError(SettingsError):
    """A config file that cannot be read, parsed or understood."""


def load_config_file(path: str | Path) -> RunSettings:
    """Read launch settings from a ``.yaml``/``.yml`` or ``.toml`` file.

    The file holds the keys of :class:`RunSettings` at its top level, for example::

        np: 4
        hosts: [node1:2, node2:2]
        env: {NCCL_DEBUG: INFO}

    Raises:
        ConfigFileError: the file is missing, is not valid YAML/TOML, has an unknown
            suffix, or (for YAML) pyyaml is not installed.
        SettingsError: an unknown key or a value of the wrong type.
    """
    path = Path(path)
    text = read_text_file(path, "config file", ConfigFileError)
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        values = _parse_yaml(text, path)
    elif suffix == ".toml":
        values = _parse_toml(text, path)
    else:
        raise ConfigFileError(
            f"config file {path} must end in .yaml, .yml or .toml, so ringrun knows how to read it"
        )
    if values is None:
        # An empty YAML file means "no settings", not an error.
        values = {}
    if not isinstance(values, dict):
        raise ConfigFileError(
            f"config file {path} must hold a mapping of settings at its top level, "
            f"got {type(values).__name__}"
        )
    return RunSettings.from_mapping(values, source=str(path))


def _parse_yaml(text: str, path: Path) -> Any:
    """Parse YAML text, explaining how to get pyyaml when it is missing."""
    try:
        import yaml
    except ImportError:
        raise ConfigFileError(
            f"reading {path} needs pyyaml, which is not installed. Install it with "
            "`pip install pyyaml` (or `pip install 'ringplug[yaml]'`), or write the "
            "settings as TOML instead."
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigFileError(f"{path} is not valid YAML: {error}") from None


def _parse_toml(text: str, path: Path) -> Any:
    """Parse TOML text with the standard library (Python 3.11+) or tomli before that."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised only on Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigFileError(
                f"reading {path} on Python 3.10 needs tomli: `pip install tomli`"
            ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigFileError(f"{path} is not valid TOML: {error}") from None
