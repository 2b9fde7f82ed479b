"""Settings declared once: a config field's default, CLI flag, help text, choices and help group in
its metadata.

    num_workers: int = setting(4, flag="--workers", group="run", help="number of workers k")

`walk` lists the settings of a config class (fields of nested sections as dotted paths such as
`inner.lr`); the CLI builds `diloco train`'s flags from it, `label` names a setting and its flag in
error messages, and `check_types`, `check_choices` and `check_needs` validate any config, whether
it came from code, a TOML file, config.json or flags. Range checks stay with each config
(diloco.config.validate). `build`, `lists_to_tuples`, `merge`, `nest`, `load_toml` and `load_json`
turn files and flags into the nested dicts a config is built from.

A field named after a Python keyword takes a trailing underscore, which its key drops: the field
`async_` is the TOML table `[async]`, the config.json key "async" and the paths `async.rule`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import keyword
import math
import operator
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

from diloco.errors import UserError

_KEY = "diloco"  # the key of a field's metadata that holds its Meta


@dataclass(frozen=True)
class Meta:
    """What a field declares besides its type and default."""

    flag: str | None = None  # the option of `diloco train`; None: the setting is TOML-only
    help: str = ""  # what it means; the CLI adds the choices and the default
    choices: tuple[str, ...] = ()  # the allowed values of a str setting
    parse: Callable[[str], Any] | None = None  # flag text -> value, where the type cannot parse it
    default_help: str | None = None  # the default as help shows it, where the value does not say
    # the setting applies only while the setting at a path (from the root config) has a value:
    # (path, value), or (path, op, value) with an op of CONDITIONS, e.g. ("drop_prob", ">", 0),
    # or a tuple of such conditions that must all hold; changed from its default otherwise, it is
    # an error (check_needs), whose message gives `because` as the reason
    needs: tuple[Any, ...] | None = None
    # the group of `diloco train --help` that lists its flag; "": its section's (a top-level
    # setting must name one)
    group: str = ""
    because: str = ""  # why the setting needs its condition, for check_needs' message


def setting(
    default: Any = MISSING,
    *,
    default_factory: Callable[[], Any] | Any = MISSING,
    flag: str | None = None,
    help: str = "",
    choices: tuple[str, ...] = (),
    parse: Callable[[str], Any] | None = None,
    default_help: str | None = None,
    needs: tuple[Any, ...] | None = None,
    group: str = "",
    because: str = "",
) -> Any:
    """A dataclass field with its flag, help, choices, applicability and help group (see `Meta`)."""
    conditions(needs)  # a bad condition fails where it is declared
    meta = {_KEY: Meta(flag, help, choices, parse, default_help, needs, group, because)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# the ops of a `needs` condition: how to test it, and how messages say it ({} is the value)
CONDITIONS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "==": (operator.eq, "{}"),
    "!=": (operator.ne, "other than {}"),
    ">": (operator.gt, "above {}"),
    ">=": (operator.ge, "at least {}"),
    "in": (lambda value, allowed: value in allowed, "{}"),  # the value: a tuple, said "a or b"
}


def conditions(needs: tuple[Any, ...] | None) -> list[tuple[str, str, Any]]:
    """The (path, op, value) conditions of a `needs`, in order: (path, value) means
    (path, "==", value); a tuple of conditions gives each; None gives none."""
    if needs is None:
        return []
    if needs and all(isinstance(n, tuple) for n in needs):
        return [c for n in needs for c in conditions(n)]
    if len(needs) == 2 and isinstance(needs[0], str):
        return [(needs[0], "==", needs[1])]
    if len(needs) == 3 and isinstance(needs[0], str) and needs[1] in CONDITIONS:
        return [(needs[0], needs[1], needs[2])]
    raise ValueError(
        f"needs must be (path, value), (path, op, value) with op in {list(CONDITIONS)}, or a tuple of those"
    )


def key(name: str) -> str:
    """The key of a field (in paths, TOML tables and config.json): its name, less the trailing
    underscore of a Python keyword (`async_` -> `async`)."""
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


def attr(key: str) -> str:
    """The field name of a key: `async` -> `async_` (see `key`)."""
    return key + "_" if keyword.iskeyword(key) else key


@dataclass(frozen=True)
class Setting:
    """One leaf field of a config class, at a dotted path from the root."""

    path: str
    type: Any
    default: Any
    meta: Meta

    @property
    def flag(self) -> str | None:
        return self.meta.flag

    @property
    def section(self) -> str:
        """The section it is in ("sim" for "sim.procs"); "" at the top level."""
        return self.path.rpartition(".")[0]

    @property
    def group(self) -> str:
        """The help group of its flag: the declared one, else its section ("" for none)."""
        return self.meta.group or self.section


@functools.cache
def walk(cls: type) -> tuple[Setting, ...]:
    """Every leaf setting of `cls`, nested sections (dataclass-typed fields) flattened, in order."""
    hints = typing.get_type_hints(cls)
    out: list[Setting] = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out += [dataclasses.replace(s, path=f"{key(f.name)}.{s.path}") for s in walk(kind)]
        else:
            default = f.default if f.default is not MISSING else f.default_factory()
            out.append(Setting(key(f.name), kind, default, f.metadata.get(_KEY, Meta())))
    return tuple(out)


@functools.cache
def _by_path(cls: type) -> dict[str, Setting]:
    return {s.path: s for s in walk(cls)}


def find(cls: type, path: str) -> Setting:
    """The setting at `path` (e.g. "sim.procs"); KeyError if there is none."""
    return _by_path(cls)[path]


def label(cls: type, path: str) -> str:
    """How error messages name a setting: `inner.lr (--inner-lr)`, or the path if it has no flag."""
    s = _by_path(cls).get(path)
    return f"{path} ({s.flag})" if s is not None and s.flag else path


def get(obj: Any, path: str) -> Any:
    """The value at a dotted path of keys ("async.rule" reads obj.async_.rule)."""
    return functools.reduce(lambda o, k: getattr(o, attr(k)), path.split("."), obj)


def check(ok: bool, name: str, value: Any, want: str) -> None:
    """Raise the one-sentence UserError for a setting `name` (see `label`) that is not `want`."""
    if not ok:
        shown = list(value) if isinstance(value, tuple) else value
        raise UserError(f"{name} must be {want}, got {shown!r}; set it to {want}.")


def _element(kind: Any) -> Any:
    """X of tuple[X, ...], or None for a type that is not a homogeneous tuple."""
    args = typing.get_args(kind)
    return args[0] if typing.get_origin(kind) is tuple and len(args) == 2 and args[1] is Ellipsis else None


def is_switch(kind: Any) -> bool:
    """Whether a setting of type `kind` is an on/off switch: bool, or bool | None (None: unset, a
    default that depends on other settings)."""
    return kind is bool or set(_alternatives(kind)) == {bool, type(None)}


def is_list(kind: Any) -> bool:
    return _element(kind) is not None


def _alternatives(kind: Any) -> tuple[Any, ...]:
    """X and Y of `X | Y`; () for a type that is not a union."""
    return typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else ()


def describe(kind: Any) -> str:
    """The expected type in words, for error messages."""
    if alternatives := _alternatives(kind):
        return " or ".join(describe(a) for a in alternatives)
    if (item := _element(kind)) is not None:
        return {int: "a list of integers", float: "a list of numbers", str: "a list of strings"}[item]
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        type(None): "unset",
    }[kind]


def type_ok(kind: Any, value: Any) -> bool:
    """Whether `value` has type `kind`. A bool is never a number; an int is a float."""
    if alternatives := _alternatives(kind):
        return any(type_ok(a, value) for a in alternatives)
    if (item := _element(kind)) is not None:
        return isinstance(value, tuple) and all(type_ok(item, v) for v in value)
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


@functools.cache
def sections(cls: type) -> dict[str, type]:
    """The fields of `cls` that are sections (nested config dataclasses), by key (see `key`)."""
    hints = typing.get_type_hints(cls)
    return {
        key(f.name): hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])
    }


def check_types(cfg: Any) -> None:
    """Reject a value of the wrong type in any setting of `cfg`, before any range check."""
    cls = type(cfg)
    for name, kind in sections(cls).items():
        if not isinstance(getattr(cfg, attr(name)), kind):
            got = getattr(cfg, attr(name))
            raise UserError(
                f"{name} must be a {kind.__name__}, got {got!r}; build it with {kind.__name__}(...)."
            )
    for s in walk(cls):
        check(type_ok(s.type, get(cfg, s.path)), label(cls, s.path), get(cfg, s.path), describe(s.type))


def check_choices(cfg: Any) -> None:
    """Reject a value outside a setting's declared choices."""
    for s in walk(type(cfg)):
        if s.meta.choices:
            want = "one of " + ", ".join(s.meta.choices)
            check(get(cfg, s.path) in s.meta.choices, label(type(cfg), s.path), get(cfg, s.path), want)


def changed(cfg: Any, path: str) -> bool:
    """Whether a setting differs from its field's default."""
    return get(cfg, path) != find(type(cfg), path).default


def check_needs(cfg: Any, commands: dict[tuple[str, Any], str] | None = None) -> None:
    """A setting changed from its default whose `needs` does not hold is an error, never ignored.
    `commands` names the command that meets a need no flag can (the server runtime: diloco serve)."""
    cls = type(cfg)
    for s in walk(cls):
        if not changed(cfg, s.path):
            continue
        for path, op, wanted in conditions(s.meta.needs):  # the first that fails is reported
            test, phrase = CONDITIONS[op]
            if test(get(cfg, path), wanted):
                continue
            flag = find(cls, path).flag
            why = f": {s.meta.because}" if s.meta.because else ""
            if op == "==" and (command := (commands or {}).get((path, wanted))):
                raise UserError(
                    f"{label(cls, s.path)} applies only with {path} = {wanted!r} (this run has "
                    f"{get(cfg, path)}){why}; run it with {command}, or drop it."
                )
            if op == "==":
                need = (flag if wanted is True else f"{flag} {wanted}") if flag else f"{path} = {wanted!r}"
                fix = f"add {need}"
            else:
                shown = " or ".join(map(str, wanted)) if op == "in" else wanted
                need = f"{flag or path} {phrase.format(shown)}"
                fix = f"set {need}"
            raise UserError(
                f"{label(cls, s.path)} applies only with {need} (this run has {get(cfg, path)}){why}; "
                f"{fix} or drop it."
            )


def default_text(s: Setting) -> str:
    """A setting's default as help and docs/config.md show it."""
    if s.meta.default_help is not None:
        return s.meta.default_help
    return ("on" if s.default else "off") if s.type is bool else str(s.default)


def help_text(s: Setting) -> str:
    """A flag's help: its meaning, then its choices and its default (from the field's default)."""
    shown = default_text(s)
    choices = " | ".join(s.meta.choices) + "; " if s.meta.choices else ""
    return f"{s.meta.help} ({choices}default: {shown})".replace("%", "%%")


def at_least(cfg: Any, path: str, *, minimum: int) -> None:
    """Range check of an integer setting (its type is checked already)."""
    value = get(cfg, path)
    check(value >= minimum, label(type(cfg), path), value, f"an integer >= {minimum}")


def in_range(
    cfg: Any, path: str, *, lo: float, hi: float = math.inf, lo_open: bool = False, hi_open: bool = False
) -> None:
    """Range check of a number setting: finite, from lo to hi (open or closed ends)."""
    value = get(cfg, path)
    ok = math.isfinite(value) and (value > lo if lo_open else value >= lo)
    ok = ok and (value < hi if hi_open else value <= hi)
    want = f"a finite number {'>' if lo_open else '>='} {lo}"
    if hi != math.inf:
        want += f" and {'<' if hi_open else '<='} {hi}"
    check(ok, label(type(cfg), path), value, want)


def lists_to_tuples(cls: type, values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A copy of nested `values` (for config class `cls`) with lists made tuples where the setting
    is a tuple: JSON and TOML give lists."""
    lists = {s.path for s in walk(cls) if is_list(s.type)}
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and not prefix:
            out[key] = lists_to_tuples(cls, value, key + ".")
        else:
            out[key] = tuple(value) if isinstance(value, list) and prefix + key in lists else value
    return out


def build(cls: type, values: dict[str, Any], where: str, base: Any | None = None) -> Any:
    """`cls(**values)` (or `base` with `values` replaced), refusing a key `cls` does not have."""
    known = sorted(key(f.name) for f in dataclasses.fields(cls))
    if unknown := sorted(set(values) - set(known)):
        raise UserError(f"unknown key {unknown[0]!r} in {where}; use one of: {', '.join(known)}.")
    values = {attr(k): v for k, v in values.items()}
    return dataclasses.replace(base, **values) if base is not None else cls(**values)


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `overrides` into a copy of `base` (nested tables merge key by key)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def nest(path: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for path "a.b": a setting as the nested dict `merge` takes."""
    head, _, rest = path.partition(".")
    return {head: nest(rest, value) if rest else value}


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise UserError(f"config file {path} is a folder; give --config the path of a TOML file.")
    if not path.is_file():
        raise UserError(f"config file {path} does not exist; check the path given to --config.")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"config file {path} is not valid TOML ({e}); fix its syntax.") from None


def load_json(path: str | Path) -> dict[str, Any]:
    """A run directory's JSON object (config.json, summary.json); UserError if missing or corrupt."""
    path = Path(path)
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} does not exist; is this a diloco run directory?") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a folder, not a JSON file; the run directory is corrupt.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); the run directory is corrupt.") from None
    if not isinstance(value, dict):
        raise UserError(
            f"{path} holds a JSON {type(value).__name__}, not an object; the run directory is corrupt."
        )
    return value
