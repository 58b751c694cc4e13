"""YAML configs mapped onto typed dataclasses.

`load_config(SFTConfig, "configs/sft-countdown.yaml", ["optim.lr=3e-4"])` reads the file,
applies dotted overrides, and builds the dataclass with `dacite` in strict mode: an
unknown key, a value of the wrong type (a bool is not a number here, though Python says
True == 1) or a bad choice is a `ConfigError` that names the field and says how to fix it;
so is a file that is missing, empty, not UTF-8 or not valid YAML, named with its line.
Range and cross-field checks live in each dataclass's `__post_init__`, which raises
`ConfigError` too.

Light on purpose (no torch): the command line checks a config in well under a second,
before the slow imports of training (the dataclasses are in `stabledrl.settings`).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import dacite
import yaml

__all__ = ["ConfigError", "load_config", "to_dict", "check", "field_docs"]

C = TypeVar("C")


class ConfigError(ValueError):
    """A config value is missing, unknown, mistyped or out of range."""


def check(ok: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless `ok`; for `__post_init__` validation."""
    if not ok:
        raise ConfigError(message)


def _to_float(v: Any) -> float:
    # YAML 1.1 reads "1e-3" as a string; accept it, and ints, as floats. Never bools
    # (`_reject_unknown` has named the field of a bool already).
    if isinstance(v, bool):
        return v
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
        data = _read_yaml(Path(source))
    data = _expand_shorthands(cls, data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item}: the value is not valid YAML ({_yaml_problem(e)}); quote it, "
                              "e.g. key='text', or fix its brackets") from None
        _set_dotted(data, key.strip(), value)
        data = _expand_shorthands(cls, data)
    _reject_unknown(cls, data, "")
    _start_from_field_defaults(cls, data)
    config = dacite.Config(strict=True, type_hooks={float: _to_float})
    for family in _families(cls):  # built as the member its `name` picks: its own errors, not "no match"
        config.type_hooks[family] = lambda d, f=family: d if not isinstance(d, Mapping) else dacite.from_dict(
            _section(f, d), d, config=config)
    try:
        return dacite.from_dict(cls, data, config=config)
    except dacite.WrongTypeError as e:
        raise ConfigError(f"config field {e.field_path!r}: expected {_type_name(e.field_type)}, got {e.value!r}") from None
    except dacite.MissingValueError as e:
        raise ConfigError(f"config field {e.field_path!r} is required") from None
    except dacite.DaciteError as e:
        raise ConfigError(f"bad config: {e}") from None


def _read_yaml(path: Path) -> dict:
    """The mapping in a config file; a missing, empty, non-UTF-8 or malformed file is a
    `ConfigError` naming it (and the line)."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                          "save it as UTF-8") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e)}; fix the syntax there") from None
    if data is None:
        raise ConfigError(f"config file {path} is empty: write its settings (field: value lines) in it")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of field: value")
    return data


def _yaml_problem(e: Exception) -> str:
    """A YAML error on one line: what, and where (1-based line and column)."""
    mark = getattr(e, "problem_mark", None)
    what = " ".join(str(getattr(e, "problem", None) or e).split())
    return f"{what} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else what


def _expand_shorthands(cls: Any, data: Any) -> Any:
    """`data` with each bare value of a section with ``__shorthand__`` made {field: value}, and
    each bool given for a choice among words made the word YAML read it from (``no``, ``off``,
    ``yes``, ``on`` are booleans to YAML: ``mixed_precision: no`` means "no"). A new dict."""
    if not (dataclasses.is_dataclass(cls) and isinstance(data, dict)):
        return data
    hints, out = typing.get_type_hints(cls), {}
    for key, value in data.items():
        if isinstance(value, bool) and typing.get_origin(hints.get(key)) is typing.Literal:
            words = [w for w in (("yes", "on") if value else ("no", "off")) if w in typing.get_args(hints[key])]
            if words and value not in typing.get_args(hints[key]):
                value = words[0]
        sub = _section(hints.get(key), value)
        if dataclasses.is_dataclass(sub):
            short = getattr(sub, "__shorthand__", None)
            if short is not None and not isinstance(value, Mapping):
                value = {short: value}
            value = _expand_shorthands(sub, value)
        out[key] = value
    return out


def _start_from_field_defaults(cls: Any, data: Any) -> None:
    """In place: a section given in part starts from its field's default, not from its class's
    (``rollout: {noise: counter}`` keeps TrainConfig's rollout temperature 1.0, where
    SamplingConfig's own default is 0): the keys it leaves out are filled in where the two differ."""
    if not (dataclasses.is_dataclass(cls) and isinstance(data, dict)):
        return
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub, value = _section(hints[f.name], data.get(f.name)), data.get(f.name)
        if not (dataclasses.is_dataclass(sub) and isinstance(value, dict)):
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default) and isinstance(default, sub):
            for g in dataclasses.fields(sub):
                own = (g.default if g.default is not dataclasses.MISSING else
                       g.default_factory() if g.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
                if g.name not in value and getattr(default, g.name) != own:
                    value[g.name] = getattr(default, g.name)
        _start_from_field_defaults(sub, value)


def _reject_unknown(cls: Any, data: Any, path: str) -> None:
    """Name the first unknown key with its full path and the keys its section accepts, and
    the first bool given for a number (dacite would take True for 1: bool is an int)."""
    if not (dataclasses.is_dataclass(cls) and isinstance(data, Mapping)):
        return
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        if key not in names:
            where = f"section {path!r}" if path else "the top level"
            raise ConfigError(f"unknown config key {path + '.' if path else ''}{key}; {where} accepts {names}")
        field_path = f"{path}.{key}" if path else key
        if isinstance(value, bool) and _is_number(hints[key]):
            raise ConfigError(f"config field {field_path!r}: expected {_type_name(hints[key])}, got {value!r}")
        if typing.get_origin(hints[key]) is list and not isinstance(value, list):  # dacite would iterate a string
            raise ConfigError(f"config field {field_path!r}: expected a list, got {value!r}; write [{value!r}]")
        _reject_unknown(_section(hints[key], value, field_path), value, field_path)


def _section(t: Any, value: Any = None, path: str = "") -> Any:
    """The dataclass of an optional section (``LoraSettings | None`` -> LoraSettings), or of a family of
    sections (a base whose ``__sections__`` maps each `name` to its class) the member that the value's
    ``name`` picks (none given: the first), else t."""
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        classes = [a for a in typing.get_args(t) if dataclasses.is_dataclass(a)]
        if len(classes) != 1:
            return t
        t = classes[0]
    members = getattr(t, "__sections__", None)
    if members and isinstance(value, Mapping):
        wanted = value.get("name", next(iter(members)))
        if wanted not in members:
            raise ConfigError(f"config field {path + '.' if path else ''}name: {wanted!r} is none of "
                              f"{', '.join(map(str, members))}")
        return members[wanted]
    return t


def _families(cls: Any) -> set:
    """The families of sections (chosen by `name`) among the fields of cls and its sections."""
    found: set = set()
    if dataclasses.is_dataclass(cls):
        for t in typing.get_type_hints(cls).values():
            t = _section(t)
            if getattr(t, "__sections__", None):
                found |= {t}.union(*(_families(c) for c in t.__sections__.values()))
            elif dataclasses.is_dataclass(t):
                found |= _families(t)
    return found


def _is_number(t: Any) -> bool:
    """int, float, or either or None (but not a type that also takes a bool)."""
    args = typing.get_args(t) if typing.get_origin(t) in (typing.Union, types.UnionType) else (t,)
    return bool.__name__ not in {getattr(a, "__name__", "") for a in args} and any(a in (int, float) for a in args)


def _type_name(t: Any) -> str:
    if typing.get_origin(t) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(t))
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(t))
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def to_dict(cfg: Any) -> dict:
    """A plain dict of a config dataclass (for writing the resolved config)."""
    return dataclasses.asdict(cfg)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass `cls` (the string that follows it in the
    class body, or in the body of the base class that declares it), whitespace collapsed;
    fields without one are left out."""
    docs = {}
    for c in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):  # a subclass's own doc wins
        body = ast.parse(textwrap.dedent(inspect.getsource(c))).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs
