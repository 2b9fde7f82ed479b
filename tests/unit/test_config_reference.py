"""docs/config.md is what diloco.config.reference writes from the settings table, and every key it
lists is one a config file may set (the loader takes it, `diloco train` reads it back)."""

from __future__ import annotations

import re

import pytest

from diloco import settings
from diloco.config import TrainConfig, from_dict, reference


@pytest.mark.timeout(30)
def test_docs_config_md_is_generated_from_the_settings():
    assert reference.DOC.read_text() == reference.markdown(), (
        "docs/config.md is out of date: run `python -m diloco.config.reference --write`"
    )


@pytest.mark.timeout(30)
def test_every_listed_key_loads_from_a_config_file_under_its_table():
    text = reference.DOC.read_text()
    listed = []
    table = ""
    for line in text.splitlines():
        if line.startswith("## "):
            m = re.match(r"## `\[([\w.]+)\]`", line)
            table = m.group(1) if m else ""
        elif m := re.match(r"\| `(\w+)` \|", line):
            listed.append(f"{table}.{m.group(1)}" if table else m.group(1))
    assert listed == [s.path for s in settings.walk(TrainConfig)]
    for s in settings.walk(TrainConfig):  # a file setting each key to its default loads, unchanged
        section, _, key = s.path.rpartition(".")
        layout = {section: {key: s.default}} if section else {key: s.default}
        assert settings.get(from_dict(layout), s.path) == s.default, s.path
