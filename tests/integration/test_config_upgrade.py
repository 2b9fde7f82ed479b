"""Run directories written before the async rule's table was renamed ("server" -> "async") still
resume: a run is stopped at a checkpoint, its config.json replaced by the one diloco wrote at
commit 32d56f2 for the same settings (tests/fixtures/config_32d56f2.json), and resumed with
`diloco train --resume`; it ends exactly where the run that was never stopped does."""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from diloco.cli.main import main
from diloco.config import from_dict
from diloco.run.train import train

OLD_CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "config_32d56f2.json"


def _params(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


@pytest.mark.timeout(180)
def test_a_run_whose_config_json_has_the_old_server_table_resumes_to_the_same_result(tmp_path, capsys):
    old = json.loads(OLD_CONFIG.read_text())
    assert old["server"]["rule"] == "delaycomp" and "async" not in old
    # the same settings in today's layout: the async rule is not the default (an upgrade that lost
    # the old table would resume with dn and end elsewhere, or fail to load the rule's state)
    new = {k: v for k, v in old.items() if k != "server"} | {"async": old["server"]}
    straight = from_dict({**new, "out": str(tmp_path / "straight")})
    assert straight.async_.rule == "delaycomp" and straight.dylu.enabled is False
    train(straight, progress=False)

    run = tmp_path / "stopped"
    train(from_dict({**new, "out": str(run)}), stop_after=1, progress=False)
    (run / "config.json").write_text(json.dumps({**old, "out": str(run)}, indent=2))
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert "done in" in capsys.readouterr().out
    a, b = _params(run), _params(tmp_path / "straight")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    written = json.loads((run / "config.json").read_text())  # rewritten in today's layout
    moved = ("dylu", "dylu_alpha", "dylu_oracle")  # to [dylu], with `by` added since at its default
    assert written["async"] == {k: x for k, x in old["server"].items() if k not in moved}
    assert written["dylu"] == {"enabled": False, "alpha": 0.5, "oracle": False, "by": "auto"}
    assert "server" not in written
