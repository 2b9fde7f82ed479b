"""--init-from: every method starts from given parameters; a file that does not fit is refused."""

import dataclasses

import pytest
from safetensors.torch import load_file, save_file

from diloco.cli.main import main
from diloco.run.train import train
from diloco.rundir.metrics import read_metrics


def _first_and_last_subset_loss(run_dir):
    evals = [m for m in read_metrics(run_dir) if m["kind"] == "eval" and m["split"] == "subset"]
    return evals[0]["val_loss"], evals[-1]["val_loss"]


@pytest.fixture
def pretrained(tiny, tmp_path):
    """A finished single-worker run: its model.safetensors is what the others start from."""
    train(tiny(method="single", rounds=2, out=str(tmp_path / "pre")), progress=False)
    return tmp_path / "pre"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["single", "dp", "diloco", "async"])
def test_every_method_starts_from_the_given_parameters(tiny, tmp_path, pretrained, method):
    _, pre_final = _first_and_last_subset_loss(pretrained)
    for name, init in (("dir", str(pretrained)), ("file", str(pretrained / "model.safetensors"))):
        cfg = tiny(method=method, rounds=1, init_from=init, out=str(tmp_path / f"{method}-{name}"))
        train(cfg, progress=False)
        start, _ = _first_and_last_subset_loss(tmp_path / f"{method}-{name}")
        assert start == pre_final  # the step-0 evaluation is of the pretrained parameters
    scratch = tiny(method=method, rounds=1, out=str(tmp_path / f"{method}-scratch"))
    train(scratch, progress=False)
    assert _first_and_last_subset_loss(tmp_path / f"{method}-scratch")[0] > pre_final + 0.1


@pytest.mark.timeout(60)
def test_a_resumed_run_does_not_need_the_init_file_any_more(tiny, tmp_path, pretrained):
    cfg = tiny(init_from=str(pretrained), checkpoint_every=1, out=str(tmp_path / "run"))
    train(cfg, stop_after=1, progress=False)
    straight = tiny(init_from=str(pretrained), out=str(tmp_path / "straight"))
    train(straight, progress=False)
    (pretrained / "model.safetensors").unlink()  # θ lives in the checkpoint now
    code = main(["train", "--resume", str(tmp_path / "run")])
    assert code == 0
    a, b = (
        load_file(str(tmp_path / "run" / "model.safetensors")),
        load_file(str(tmp_path / "straight" / "model.safetensors")),
    )
    assert all(a[k].equal(b[k]) for k in a)


@pytest.mark.timeout(60)
def test_parameters_that_do_not_fit_are_refused_with_one_sentence(
    tiny, tmp_path, pretrained, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    wider = dataclasses.replace(tiny().model, d_model=48)
    train(tiny(method="single", rounds=1, model=wider, out=str(tmp_path / "wide")), progress=False)
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / "unfinished").mkdir()
    partial = {
        k: v for k, v in load_file(str(pretrained / "model.safetensors")).items() if "blocks.1" not in k
    }
    save_file(partial, str(tmp_path / "partial.safetensors"))
    cfg = tmp_path / "tiny.toml"
    cfg.write_text("[model]\nn_layer = 2\nn_head = 2\nd_model = 32\n[inner]\nwarmup_steps = 2\n")
    base = ["train", "--config", str(cfg), "--seq-len", "32", "--batch-size", "4", "--inner-steps", "4"]
    cases = [
        (tmp_path / "wide", "does not fit this model: blocks.0.attn_out.bias is (48,) there, (32,) here"),
        (tmp_path / "partial.safetensors", "blocks.1.attn_out.bias is missing there"),
        (tmp_path / "garbage.safetensors", "is not a readable safetensors file"),
        (tmp_path / "unfinished", "has no model.safetensors (has that run finished?)"),
        (tmp_path / "nowhere", "does not exist"),
    ]
    for path, needle in cases:
        out = tmp_path / "out"
        try:
            code = main([*base, "--init-from", str(path), "--out", str(out)])
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and needle in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert not out.exists()
