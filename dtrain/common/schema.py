"""The strict YAML loader: a YAML file → frozen dataclasses, every value checked against its annotation.

Profiles, sweep matrices and testbed profiles all go through it. YAML nodes keep their line numbers, so unknown keys,
wrong types and non-finite numbers are `UserError`s naming the file, the line and the dotted key.

A profile may be an overlay: `include: base.yaml` (or a list of files, merged in order), paths relative to the
including file, nested includes allowed. Mappings merge key by key, the including file winning; any other value
(a list too) replaces the included one. Every key remembers the file and line it came from (`Source`), so an error
in an included file names that file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from pathlib import Path

import yaml

from dtrain.common.errors import UserError, unknown
from dtrain.common.paths import resolve_profile

INCLUDE = "include"  # the top-level key of an overlay


class Source:
    """Where values came from: a file name and, per dotted key, its line; `files` names the file of each key that
    came from another file than `name` (an included one)."""

    def __init__(self, name: str, lines: dict[str, int] | None = None, files: dict[str, str] | None = None):
        self.name, self.lines, self.files = name, lines or {}, files or {}

    def where(self, path: str) -> str:
        key = path
        while key not in self.lines and "." in key:  # a missing key: point at the closest mapping that holds it
            key = key.rsplit(".", 1)[0]
        line = self.lines.get(key)
        return f"{self.files.get(key, self.name)}:{line}" if line else self.name

    def forget(self, path: str) -> None:
        """`path` and everything below it no longer come from a file (a `--set` replaced them)."""
        for key in [k for k in self.lines if _under(k, path)]:
            del self.lines[key]
        for key in [k for k in self.files if _under(k, path)]:
            del self.files[key]


def _under(key: str, path: str) -> bool:
    """`key` is `path` or a key inside it (`path.x`, `path[0]`)."""
    return key == path or key.startswith(path + ".") or key.startswith(path + "[")


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


def read_yaml(path: Path, what: str = "profile") -> tuple[dict, dict[str, int]]:
    """One YAML file (a mapping; empty: {}) and the line of each dotted key; `what` names the file in errors."""
    path = resolve_profile(path, what)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read {what} ({e.__class__.__name__})") from None
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
        raise UserError(f"{path}: a {what} must be a mapping of sections, not {type(raw).__name__}")
    return raw, lines


def read_overlay(path: str | Path, what: str = "profile") -> tuple[dict, Source]:
    """A YAML file with its includes merged under it (see the module docstring), and where each key came from."""
    path = resolve_profile(path, what)  # includes are then relative to the file found
    raw, lines, files = _layer(path, what, [])
    return raw, Source(str(path), lines, files)


def _layer(path: Path, what: str, chain: list[Path]) -> tuple[dict, dict[str, int], dict[str, str]]:
    """`path` over its includes: (raw, line of each key, file of each key that is not from `path` itself)."""
    raw, lines = read_yaml(path, what)
    spec = raw.pop(INCLUDE, None)
    at = {k: lines.pop(k) for k in [k for k in lines if _under(k, INCLUDE)]}
    if spec is None:
        return raw, lines, {}
    names = [spec] if isinstance(spec, str) else spec
    if not (isinstance(names, list) and names and all(isinstance(n, str) and n for n in names)):
        raise UserError(f"{path}:{at[INCLUDE]}: '{INCLUDE}' must be a file name or a list of them, got {spec!r}")
    merged: dict = {}
    merged_lines: dict[str, int] = {}
    merged_files: dict[str, str] = {}
    here = chain + [path]
    for i, name in enumerate(names):
        line = at.get(f"{INCLUDE}[{i}]", at[INCLUDE])
        target = Path(os.path.normpath(path.parent / name))  # errors name it as the user would
        if target.resolve() in [p.resolve() for p in here]:
            cycle = " -> ".join(str(p) for p in here + [target])
            raise UserError(f"{path}:{line}: '{INCLUDE}' makes a cycle: {cycle}")
        if not target.is_file():
            raise UserError(f"{path}:{line}: '{INCLUDE}' names '{name}', which is not a file ({target})")
        base, base_lines, base_files = _layer(target, what, here)
        base_files = {k: base_files.get(k, str(target)) for k in base_lines}
        _overlay(merged, merged_lines, merged_files, base, base_lines, base_files, "")
    _overlay(merged, merged_lines, merged_files, raw, lines, {}, "")
    return merged, merged_lines, merged_files


def _overlay(dst: dict, dst_lines: dict, dst_files: dict, top: dict, top_lines: dict, top_files: dict,
             prefix: str) -> None:
    """Merge `top` into `dst` in place: mappings key by key, anything else replaced; lines and files follow."""
    for key, value in top.items():
        sub = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _overlay(dst[key], dst_lines, dst_files, value, top_lines, top_files, sub)
        else:
            dst[key] = value
            for k in [k for k in dst_lines if _under(k, sub)]:
                del dst_lines[k]
                dst_files.pop(k, None)
            for k in [k for k in top_lines if _under(k, sub)]:
                dst_lines[k] = top_lines[k]
                if k in top_files:
                    dst_files[k] = top_files[k]
        dst_lines[sub] = top_lines[sub]  # a merged mapping is where the top file names it
        if sub in top_files:
            dst_files[sub] = top_files[sub]
        else:
            dst_files.pop(sub, None)


_SCIENTIFIC = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp, value, path: str, src: Source):
    """Check `value` against the annotation `tp` (strictly: no str → int, no int → bool)."""
    if tp is typing.Any:
        return value
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
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise UserError(f"{src.where(path)}: '{path}' must be a list, got {value!r}")
        args = typing.get_args(tp)
        return [_coerce(args[0], v, f"{path}[{i}]", src) for i, v in enumerate(value)] if args else value
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
            raise UserError(f"{src.where(sub)}: {unknown('key', str(key), names, f'{path}.' if path else '')}")
    kwargs = {k: _coerce(hints[k], v, f"{path}.{k}" if path else k, src) for k, v in raw.items()}
    return cls(**kwargs)


def deep_merge(dst: dict, top: dict) -> None:
    """`top` merged into `dst` in place: mappings key by key, any other value replacing `dst`'s (no line records: for
    mappings made in code; profiles overlay through `read_overlay`)."""
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            deep_merge(dst[k], v)
        else:
            dst[k] = v


def apply_overrides(raw: dict, src: Source, overrides) -> Source:
    """`--set` assignments applied to `raw`; the keys they set no longer point at a file line, and the source's
    name says so."""
    for assignment in overrides:
        apply_override(raw, assignment)
        src.forget(assignment.partition("=")[0])
    if overrides:
        src.name += " (with --set)"
    return src


def apply_override(raw: dict, assignment: str) -> None:
    """`a.b=value`: the value is parsed as YAML (so `1e-3`, `true`, `null`, `[1, 2]` mean what they say)."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise UserError(f"--set '{assignment}': expected KEY=VALUE, e.g. --set train.max_steps=100")
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        value = text
    set_dotted(raw, key, value, f"--set '{assignment}'")


def set_dotted(raw: dict, key: str, value, where: str) -> None:
    """`raw[a][b] = value` for the dotted key `a.b`, making the sections on the way; `where` names the assignment in
    the one-line error when a part of the way is not a section."""
    parts = key.split(".")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise UserError(f"{where}: '{p}' is not a section")
    node[parts[-1]] = value
