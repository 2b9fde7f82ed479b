"""A TrainConfig from nested dicts: a TOML file (`--config`), config.json (`--resume`), flags, or
a mix merged with `merge`; layouts written by older versions are upgraded on the way in.

    python -c "from diloco.config.load import from_dict; print(from_dict({'async': {'rule': 'naive'}, \
'method': 'async'}).async_.rule)"
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from diloco import settings
from diloco.config.parsers import is_pretrained_dir, read_model_config
from diloco.config.sections import MODEL_PRESETS
from diloco.config.train import TrainConfig
from diloco.core.outer import SPARSELOCO_DEFAULTS
from diloco.errors import UserError

# the tables of a TOML file: model, data, inner, outer, sim, async
_SECTIONS = settings.sections(TrainConfig)
# tables renamed since a release wrote them (config.json, TOML): old name -> new name
RENAMED_TABLES = {"server": "async"}  # the async rule's settings, [server] until the layout of issue 30


# keys moved from one table to another: old table -> {old key: new table.key}
MOVED_KEYS = {  # DyLU's settings were [async]'s until sync DiLoCo took DyLU too (issue 31)
    "async": {
        "dylu": "dylu.enabled",
        "dylu_by": "dylu.by",
        "dylu_alpha": "dylu.alpha",
        "dylu_oracle": "dylu.oracle",
    }
}


def upgrade(values: dict[str, Any]) -> dict[str, Any]:
    """`values` in today's layout: a table under an old name (RENAMED_TABLES) moves to its new
    one; given under both names, the new one's keys win. A key of MOVED_KEYS moves to its new
    table (the new place wins), except `async.dylu = true` in a run that is not async: that was
    the default then, which meant nothing there (DyLU is off for sync DiLoCo unless --dylu). An
    old [async] table of an async run with DyLU on and without `dylu_by` gets "steps", what its
    runs did (the default is now "auto": deadlines for async)."""
    for old, new in RENAMED_TABLES.items():
        if old in values:
            values = dict(values)
            was, now = values.pop(old), values.get(new)
            both = isinstance(was, dict) and isinstance(now, dict)
            values[new] = settings.merge(was, now) if both else (now if new in values else was)
    for table, moves in MOVED_KEYS.items():
        held = values.get(table)
        if not isinstance(held, dict) or not set(held) & set(moves):
            continue
        values, held = dict(values), dict(held)
        old_dylu_on = values.get("method") == "async" and held.get("dylu", True) is True
        if table == "async" and old_dylu_on and "dylu_by" not in held:  # before --dylu-by: H_w steps
            held["dylu_by"] = "steps"
        if table == "async" and not old_dylu_on and held.get("dylu_by") == "steps":
            del held["dylu_by"]  # the old default, written into config.json whether DyLU was on or not
        for old_key, path in moves.items():
            if old_key not in held:
                continue
            value = held.pop(old_key)
            if old_key == "dylu" and value is True and values.get("method") != "async":
                continue  # the old default, written into every run's config.json
            new_table, new_key = path.split(".")
            target = values.get(new_table)
            target = dict(target) if isinstance(target, dict) else {}
            target.setdefault(new_key, value)
            values[new_table] = target
        values[table] = held
    return values


def _inline_model(values: dict[str, Any]) -> dict[str, Any]:
    """`model.hf_config` as the JSON text of the config it names; with `--init-from` a directory
    saved by save_pretrained and no model config, that directory's config (the model it holds).
    Whether transformers can build it is checked before the data is read
    (diloco.model.init.check_model_config, called first thing in run.train.train)."""
    model = values.get("model")
    model = dict(model) if isinstance(model, dict) else {}
    given = model.get("hf_config")
    init = values.get("init_from")
    if not given and isinstance(init, str) and init and is_pretrained_dir(init):
        given = str(Path(init) / "config.json")
    if isinstance(given, str) and given:
        loaded, _ = read_model_config(given)  # a missing file or one that is not JSON: refused here
        if not given.lstrip().startswith("{"):
            model["hf_config"] = json.dumps(loaded, sort_keys=True)
            values = {**values, "model": model}
    return values


def _sparseloco(values: dict[str, Any]) -> dict[str, Any]:
    """`--outer-opt sparseloco`'s message settings where none is given (a saved run's config.json
    gives them all, so it is read as written)."""
    outer = values.get("outer")
    if isinstance(outer, dict) and outer.get("opt") == "sparseloco":
        return {**SPARSELOCO_DEFAULTS, **values}
    return values


def from_dict(values: dict[str, Any], where: str = "the config") -> TrainConfig:
    """Build a config from nested dicts (a parsed TOML file, config.json, or CLI overrides).

    `model.name` picks a preset; the other model keys then override it.
    """
    values = _sparseloco(_inline_model(settings.lists_to_tuples(TrainConfig, upgrade(values))))
    sections = {}
    for key, cls in _SECTIONS.items():
        sub = values.pop(key, {}) or {}
        if not isinstance(sub, dict):
            raise UserError(f"{key} in {where} must be a table of settings, got {sub!r}.")
        base = None
        if key == "model":
            preset = sub.get("name", "nano")
            if not isinstance(preset, str) or preset not in MODEL_PRESETS:
                raise UserError(
                    f"unknown model {preset!r} (--model); use one of: {', '.join(MODEL_PRESETS)}."
                )
            base = MODEL_PRESETS[preset]
        sections[settings.attr(key)] = settings.build(cls, sub, f"[{key}] of {where}", base)
    known = {settings.key(f.name) for f in dataclasses.fields(TrainConfig)}
    if unknown := sorted(set(values) - known):
        raise UserError(
            f"unknown key {unknown[0]!r} in {where}; top-level keys are: "
            + ", ".join(sorted(known - set(_SECTIONS)))
            + f", and the tables [{'], ['.join(_SECTIONS)}]."
        )
    try:
        return TrainConfig(**values, **sections)
    except TypeError as e:  # a value of a type dataclasses cannot even hold
        raise UserError(f"bad value in {where}: {e}; fix that setting.") from None
