"""diloco.settings on a small config of its own: declarations, sections, the checks and their
one-sentence messages, flags' help, `needs` conditions, and the dicts files and flags become."""

import math
from dataclasses import dataclass, field

import pytest

from diloco import settings
from diloco.errors import UserError
from diloco.settings import setting


@dataclass(frozen=True)
class Part:
    """A section."""

    size: int = setting(2, flag="--size", help="how big")
    names: tuple[str, ...] = setting((), flag="--name", help="names", default_help="none")
    rate: float = 0.5  # a plain field: TOML only, no flag


@dataclass(frozen=True)
class Rule:
    """A section whose key is a Python keyword."""

    kind: str = setting("a", flag="--kind", choices=("a", "b"), needs=("mode", "fast"), help="which")


@dataclass(frozen=True)
class Root:
    mode: str = setting("slow", flag="--mode", group="run", choices=("slow", "fast"), help="how")
    steps: int = setting(0, flag="--steps", group="run", help="steps; 0: none")
    keep: int = setting(3, flag="--keep", group="run", needs=("steps", ">", 0), help="kept")
    ratio: float = setting(0.0, needs=("mode", "!=", "slow"), help="no flag")
    level: int = setting(0, flag="--level", group="run", needs=("steps", ">=", 2), help="at least 2 steps")
    on: bool = setting(False, flag="--on", group="run", help="a switch")
    depth: int = setting(
        0,
        flag="--depth",
        group="run",
        needs=(("mode", "fast"), ("steps", ">", 0)),  # both must hold
        because="it counts down the steps",
        help="depth",
    )
    part: Part = field(default_factory=Part)
    global_: Rule = field(default_factory=Rule)  # `global` is a keyword: its key drops the underscore


def test_setting_keeps_its_declaration_in_the_field_metadata():
    s = settings.find(Root, "keep")
    assert (s.flag, s.default, s.type, s.section, s.group) == ("--keep", 3, int, "", "run")
    assert s.meta.needs == ("steps", ">", 0) and s.meta.help == "kept"
    assert settings.find(Root, "part.rate").meta == settings.Meta()  # a plain field declares nothing
    with pytest.raises(ValueError, match="needs must be"):
        setting(1, needs=("steps", "~", 0))
    with pytest.raises(ValueError, match="needs must be"):
        setting(1, needs=("steps",))
    with pytest.raises(ValueError, match="needs must be"):
        setting(1, needs=(("steps", ">", 0), "mode"))
    assert settings.conditions(settings.find(Root, "depth").meta.needs) == [
        ("mode", "==", "fast"),
        ("steps", ">", 0),
    ]
    assert settings.conditions(None) == []
    assert settings.conditions(("mode", "fast")) == [("mode", "==", "fast")]


def test_walk_flattens_sections_to_dotted_paths_by_key():
    paths = [s.path for s in settings.walk(Root)]
    assert paths == [
        "mode",
        "steps",
        "keep",
        "ratio",
        "level",
        "on",
        "depth",
        "part.size",
        "part.names",
        "part.rate",
        "global.kind",
    ]
    assert settings.sections(Root) == {"part": Part, "global": Rule}
    assert settings.find(Root, "part.size").group == "part"  # a section's setting: its section's group
    assert (settings.key("global_"), settings.attr("global")) == ("global", "global_")
    assert (settings.key("size_"), settings.attr("size")) == ("size_", "size")  # not keywords
    with pytest.raises(KeyError):
        settings.find(Root, "global_.kind")


def test_get_label_and_changed_read_paths_by_key():
    cfg = Root(mode="fast", global_=Rule(kind="b"))
    assert settings.get(cfg, "global.kind") == "b" and settings.get(cfg, "part.size") == 2
    assert settings.label(Root, "global.kind") == "global.kind (--kind)"
    assert settings.label(Root, "ratio") == "ratio"  # no flag: the path alone
    assert settings.changed(cfg, "global.kind") and not settings.changed(cfg, "part.size")


def test_type_and_choice_checks_name_the_setting_its_flag_and_the_type():
    with pytest.raises(UserError) as e:
        settings.check_types(Root(steps=True))  # a bool is not an int
    assert str(e.value) == "steps (--steps) must be an integer, got True; set it to an integer."
    with pytest.raises(UserError, match=r"part.names \(--name\) must be a list of strings, got \['x', 1\]"):
        settings.check_types(Root(part=Part(names=("x", 1))))
    with pytest.raises(UserError, match="part must be a Part, got 3; build it with Part"):
        settings.check_types(Root(part=3))
    settings.check_types(Root(part=Part(rate=1)))  # an int is a float
    with pytest.raises(UserError, match=r"global.kind \(--kind\) must be one of a, b, got 'c'"):
        settings.check_choices(Root(global_=Rule(kind="c")))


@pytest.mark.parametrize(
    "cfg,message",
    [
        (
            Root(global_=Rule(kind="b")),
            "global.kind (--kind) applies only with --mode fast (this run has slow); add --mode fast or "
            "drop it.",
        ),
        (
            Root(keep=5),
            "keep (--keep) applies only with --steps above 0 (this run has 0); set --steps above 0 or "
            "drop it.",
        ),
        (
            Root(steps=1, level=1),
            "level (--level) applies only with --steps at least 2 (this run has 1); set --steps at least 2 "
            "or drop it.",
        ),
        (
            Root(ratio=0.5),
            "ratio applies only with --mode other than slow (this run has slow); set --mode other than slow "
            "or drop it.",
        ),
        (  # several conditions: the first that fails is named, with the reason
            Root(depth=1, steps=1),
            "depth (--depth) applies only with --mode fast (this run has slow): it counts down the steps; "
            "add --mode fast or drop it.",
        ),
        (
            Root(depth=1, mode="fast"),
            "depth (--depth) applies only with --steps above 0 (this run has 0): it counts down the steps; "
            "set --steps above 0 or drop it.",
        ),
    ],
)
def test_a_changed_setting_whose_condition_fails_is_an_error(cfg, message):
    with pytest.raises(UserError) as e:
        settings.check_needs(cfg)
    assert str(e.value) == message


def test_conditions_that_hold_or_settings_at_their_defaults_pass():
    settings.check_needs(Root())  # defaults apply anywhere: no error
    held = dict(mode="fast", steps=2, keep=5, level=1, depth=3, ratio=0.5, global_=Rule(kind="b"))
    settings.check_needs(Root(**held))  # every condition holds: no error
    # and each condition is really checked: one setting off and the same run is refused
    for off in (dict(steps=1), dict(mode="slow")):
        with pytest.raises(UserError, match="applies only with"):
            settings.check_needs(Root(**{**held, **off}))


def test_a_need_no_flag_meets_names_its_command():
    with pytest.raises(UserError) as e:
        settings.check_needs(Root(global_=Rule(kind="b")), {("mode", "fast"): "tool fast"})
    assert "applies only with mode = 'fast' (this run has slow); run it with tool fast, or drop it." in str(
        e.value
    )


def test_help_shows_meaning_choices_and_default():
    assert settings.help_text(settings.find(Root, "mode")) == "how (slow | fast; default: slow)"
    assert settings.help_text(settings.find(Root, "on")) == "a switch (default: off)"
    assert settings.help_text(settings.find(Root, "part.names")) == "names (default: none)"
    assert "%%" in settings.help_text(settings.Setting("x", int, 1, settings.Meta(help="5%")))


def test_range_checks():
    settings.at_least(Root(steps=2), "steps", minimum=0)
    with pytest.raises(UserError, match=r"steps \(--steps\) must be an integer >= 1, got 0; set it to"):
        settings.at_least(Root(), "steps", minimum=1)
    settings.in_range(Root(part=Part(rate=1.0)), "part.rate", lo=0.0, hi=1.0)
    with pytest.raises(UserError, match=r"must be a finite number > 0.0 and < 1.0, got 1.0"):
        settings.in_range(Root(part=Part(rate=1.0)), "part.rate", lo=0.0, hi=1.0, lo_open=True, hi_open=True)
    with pytest.raises(UserError, match="a finite number >= 0.0, got inf"):
        settings.in_range(Root(part=Part(rate=math.inf)), "part.rate", lo=0.0)


def test_files_and_flags_become_nested_dicts_and_configs():
    values = settings.lists_to_tuples(Root, {"part": {"names": ["a"], "size": 3}, "mode": "fast"})
    assert values == {"part": {"names": ("a",), "size": 3}, "mode": "fast"}
    assert settings.nest("global.kind", "b") == {"global": {"kind": "b"}}
    merged = settings.merge({"part": {"size": 3, "rate": 0.1}, "mode": "fast"}, {"part": {"size": 4}})
    assert merged == {"part": {"size": 4, "rate": 0.1}, "mode": "fast"}
    assert settings.merge({"part": 1}, {"part": {"size": 2}}) == {"part": {"size": 2}}  # a table replaces
    assert settings.build(Part, {"size": 5}, "[part]") == Part(size=5)
    assert settings.build(Part, {"rate": 0.2}, "[part]", Part(size=7)) == Part(size=7, rate=0.2)
    assert settings.build(Root, {"global": Rule(kind="b")}, "x").global_ == Rule(kind="b")
    with pytest.raises(UserError) as e:
        settings.build(Part, {"sise": 1}, "[part] of my.toml")
    assert str(e.value) == "unknown key 'sise' in [part] of my.toml; use one of: names, rate, size."


def test_load_toml_and_load_json_refuse_missing_and_broken_files(tmp_path):
    toml, js = tmp_path / "c.toml", tmp_path / "config.json"
    toml.write_text('mode = "fast"\n[part]\nsize = 3\n')
    js.write_text('{"mode": "fast"}')
    assert settings.load_toml(toml) == {"mode": "fast", "part": {"size": 3}}
    assert settings.load_json(js) == {"mode": "fast"}
    with pytest.raises(UserError, match="does not exist; check the path given to --config"):
        settings.load_toml(tmp_path / "none.toml")
    with pytest.raises(UserError, match="does not exist; is this a diloco run directory"):
        settings.load_json(tmp_path / "none.json")
    toml.write_text("mode = [")
    js.write_text("{")
    with pytest.raises(UserError, match="is not valid TOML"):
        settings.load_toml(toml)
    with pytest.raises(UserError, match="is not valid JSON .*the run directory is corrupt"):
        settings.load_json(js)
    js.write_bytes(b"\xff\xfe")
    with pytest.raises(UserError, match="is not valid JSON"):
        settings.load_json(js)
