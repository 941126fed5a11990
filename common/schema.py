"""The strict YAML loader: a YAML file → frozen dataclasses, every value checked against its annotation.

Profiles, sweep matrices and testbed profiles all go through it. YAML nodes keep their line numbers, so unknown keys,
wrong types and non-finite numbers are `UserError`s naming the file, the line and the dotted key.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path

import yaml

from common.errors import UserError


class Source:
    """Where values came from: a file name and, per dotted key, its line."""

    def __init__(self, name: str, lines: dict[str, int] | None = None):
        self.name, self.lines = name, lines or {}

    def where(self, path: str) -> str:
        line = self.lines.get(path)
        if line is None and "." in path:  # a missing key: point at its parent mapping
            line = self.lines.get(path.rsplit(".", 1)[0])
        return f"{self.name}:{line}" if line else self.name


def _node_to_python(node: yaml.Node, path: str, lines: dict[str, int]):
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out = {}
        for k, v in node.value:
            key = yaml.safe_load(yaml.serialize(k)) if not isinstance(k, yaml.ScalarNode) else k.value
            sub = f"{path}.{key}" if path else str(key)
            if key in out:
                raise UserError(f"line {k.start_mark.line + 1}: duplicate key '{sub}'")
            out[key] = _node_to_python(v, sub, lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_node_to_python(v, f"{path}[{i}]", lines) for i, v in enumerate(node.value)]
    return yaml.safe_load(yaml.serialize(node))


def read_yaml(path: Path) -> tuple[dict, dict[str, int]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: profile not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read profile ({e.__class__.__name__})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UserError(f"{where}: malformed YAML: {getattr(e, 'problem', None) or e}") from None
    lines: dict[str, int] = {}
    try:
        raw = {} if node is None else _node_to_python(node, "", lines)
    except UserError as e:
        raise UserError(f"{path}:{e}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a profile must be a mapping of sections, not {type(raw).__name__}")
    return raw, lines


_SCIENTIFIC = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp, value, path: str, src: Source):
    """Check `value` against the annotation `tp` (strictly: no str → int, no int → bool)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, path, src)
            except UserError as e:
                errors.append(e)
        raise errors[0]
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, src)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise UserError(f"{src.where(path)}: '{path}' must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, f"{path}[{i}]", src) for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise UserError(f"{src.where(path)}: '{path}' must be a mapping, got {value!r}")
        args = typing.get_args(tp)
        if not args:
            return value
        return {_coerce(args[0], k, path, src): _coerce(args[1], v, f"{path}.{k}", src) for k, v in value.items()}
    if tp is float and isinstance(value, str) and _SCIENTIFIC.match(value):
        value = float(value)  # PyYAML (YAML 1.1) reads `1e-9` as a string; users mean the number
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }[tp](value)
    if not ok:
        raise UserError(f"{src.where(path)}: '{path}' must be {_type_name(tp)}, got {value!r}")
    if tp is float:
        # YAML's .inf and .nan (and 1e999) are floats, but no setting means anything with them: `x > 0` lets inf
        # through and every comparison lets nan fail silently, so range checks below would not catch them.
        try:
            number = float(value)
        except OverflowError:  # an integer beyond the float range
            number = math.inf
        if not math.isfinite(number):
            raise UserError(f"{src.where(path)}: '{path}' must be a finite number, got {value!r}")
        return number
    return value


def build(cls, raw, path: str, src: Source):
    if not isinstance(raw, dict):
        raise UserError(f"{src.where(path)}: '{path}' must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            sub = f"{path}.{key}" if path else str(key)
            raise UserError(
                f"{src.where(sub)}: unknown key '{sub}' (known: {', '.join(sorted(names))})"
            )
    kwargs = {k: _coerce(hints[k], v, f"{path}.{k}" if path else k, src) for k, v in raw.items()}
    return cls(**kwargs)


def apply_override(raw: dict, assignment: str) -> None:
    """`a.b=value`: the value is parsed as YAML (so `1e-3`, `true`, `null`, `[1, 2]` mean what they say)."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise UserError(f"--set '{assignment}': expected KEY=VALUE, e.g. --set train.max_steps=100")
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        value = text
    parts = key.split(".")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise UserError(f"--set '{assignment}': '{p}' is not a section")
    node[parts[-1]] = value
