"""YAML configs mapped onto typed dataclasses.

`load_config(SFTConfig, "configs/sft-countdown.yaml", ["optim.lr=3e-4"])` reads the file,
applies dotted overrides, and builds the dataclass with `dacite` in strict mode: an
unknown key, a value of the wrong type or a bad choice is a `ConfigError` that names the
field and says how to fix it. Range and cross-field checks live in each dataclass's
`__post_init__`, which raises `ConfigError` too.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import dacite
import yaml

__all__ = ["ConfigError", "load_config", "to_dict", "check"]

C = TypeVar("C")


class ConfigError(ValueError):
    """A config value is missing, unknown, mistyped or out of range."""


def check(ok: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless `ok`; for `__post_init__` validation."""
    if not ok:
        raise ConfigError(message)


def _to_float(v: Any) -> float:
    # YAML 1.1 reads "1e-3" as a string; accept it, and ints, as floats. Never bools.
    if isinstance(v, bool):
        raise ConfigError(f"expected a number, got {v!r}")
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            pass
    return v  # dacite reports the type error with the field name


def _set_dotted(data: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {p!r} is not a section")
    node[leaf] = value


def load_config(cls: type[C], source: str | Path | Mapping[str, Any] | None = None, overrides: Sequence[str] = ()) -> C:
    """Build `cls` from a YAML file (or a mapping) plus `key.sub=value` overrides."""
    if source is None:
        data: dict = {}
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of field: value")
    _expand_shorthands(cls, data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        _set_dotted(data, key.strip(), yaml.safe_load(raw))
        _expand_shorthands(cls, data)
    _reject_unknown(cls, data, "")
    try:
        return dacite.from_dict(cls, data, config=dacite.Config(strict=True, type_hooks={float: _to_float}))
    except dacite.WrongTypeError as e:
        raise ConfigError(f"config field {e.field_path!r}: expected {_type_name(e.field_type)}, got {e.value!r}") from None
    except dacite.MissingValueError as e:
        raise ConfigError(f"config field {e.field_path!r} is required") from None
    except dacite.DaciteError as e:
        raise ConfigError(f"bad config: {e}") from None


def _expand_shorthands(cls: Any, data: Any) -> None:
    """In place: a bare value of a section with ``__shorthand__`` becomes {field: value}."""
    if not (dataclasses.is_dataclass(cls) and isinstance(data, dict)):
        return
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        sub = hints.get(key)
        if dataclasses.is_dataclass(sub):
            short = getattr(sub, "__shorthand__", None)
            if short is not None and not isinstance(value, Mapping):
                data[key] = value = {short: value}
            _expand_shorthands(sub, value)


def _reject_unknown(cls: Any, data: Any, path: str) -> None:
    """Name the first unknown key with its full path and the keys its section accepts."""
    if not (dataclasses.is_dataclass(cls) and isinstance(data, Mapping)):
        return
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        if key not in names:
            where = f"section {path!r}" if path else "the top level"
            raise ConfigError(f"unknown config key {path + '.' if path else ''}{key}; {where} accepts {names}")
        _reject_unknown(hints[key], value, f"{path}.{key}" if path else key)


def _type_name(t: Any) -> str:
    if typing.get_origin(t) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(t))
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def to_dict(cfg: Any) -> dict:
    """A plain dict of a config dataclass (for writing the resolved config)."""
    return dataclasses.asdict(cfg)
