"""Where ``tiered-kv serve``'s settings come from: flags, the environment, the YAML file.

:func:`merge` is the one place the server reads its environment. Every text value (a flag,
an environment variable, a YAML string such as ``8k``) is parsed by its setting
(:meth:`~tiered_kv.serve_option.Setting.parse`), so the three spell values alike.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiered_kv.config import read_yaml
from tiered_kv.serve_option import Setting

CONFIG_ENV = "TIERED_KV_CONFIG"


def merge(
    settings: tuple[Setting, ...],
    flags: Mapping[str, Any],
    config_file: str | os.PathLike[str] | None,
    environ: Mapping[str, str],
) -> dict[str, Any]:
    """The values given, by field name: flags (``None``: not given) over ``TIERED_KV_*`` over
    the other environment variables a setting names over the YAML file over nothing."""
    by_name = {s.name: s for s in settings}
    values: dict[str, Any] = {}
    path = config_file if config_file is not None else environ.get(CONFIG_ENV)
    if path:
        values.update(_read_yaml(Path(path), by_name))
    for setting in settings:
        for alias in reversed(setting.option.env):  # the first one named wins
            raw = environ.get(alias.name)
            if raw is None:
                continue
            try:
                value = alias.convert(raw)
            except ValueError:
                raise ValueError(f"{alias.name}={raw!r} is not valid ({alias.meaning})") from None
            if value is not None:
                values[setting.name] = value
        raw = environ.get(setting.env)
        if raw is not None:
            values[setting.name] = _parse(setting, raw, f"{setting.env}={raw!r}")
    for name, value in flags.items():
        setting = by_name.get(name)
        if setting is None or not setting.option.flag:
            raise ValueError(f"unknown setting {name!r}")
        if value is not None:
            values[name] = _typed(setting, value, setting.flag)
    return values


def _read_yaml(path: Path, by_name: Mapping[str, Setting]) -> dict[str, Any]:
    try:
        data = read_yaml(path)
    except ValueError as e:
        raise ValueError(f"--config {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of settings, got {type(data).__name__}")
    known = [name for name, s in by_name.items() if s.option.flag]
    values: dict[str, Any] = {}
    for key, value in data.items():
        setting = by_name.get(str(key).replace("-", "_"))
        if setting is None:
            raise ValueError(f"--config {path}: unknown key {key!r} (known: {', '.join(known)})")
        if not setting.option.flag:
            raise ValueError(
                f"--config {path}: {key!r} is read only from the environment ({setting.env}), "
                "never from a file"
            )
        values[setting.name] = _typed(setting, value, f"--config {path}: {key}")
    return values


def _typed(setting: Setting, value: Any, where: str) -> Any:
    """Text is parsed (``"8000"``, ``"8k"``, ``"fp8_e4m3"``); a list of strings becomes a tuple
    for a setting of several values. Any other structure is refused here, unshown: through its
    aliases a few lines of YAML can hold a list of billions of items."""
    if isinstance(value, str):
        return _parse(setting, value, f"{where} {value!r}")
    if isinstance(value, (list, tuple)) and setting.kind is tuple:
        if not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where}: expected a list of strings")
        return tuple(value)
    if value is not None and not isinstance(value, (bool, int, float)):
        raise ValueError(f"{where}: expected text, a number or a boolean, got a {type(value).__name__}")
    return value


def _parse(setting: Setting, text: str, where: str) -> Any:
    try:
        return setting.parse(text)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
