"""What cannot work is refused before anything is written: one sentence, exit 2, no run directory.
The default suite runs the cases through the CLI's `main`; the slow one as real processes."""

import json
import os
import subprocess
import sys

import pytest
from conftest import TINY_LLAMA, tiny_config

from diloco.data.text import load_corpus
from diloco.model.gpt import GPT
from diloco.rundir.checkpoint import atomic_save_safetensors

TRAIN = ["train", "--seq-len", "32", "--batch-size", "4", "--workers", "2", "--threads", "1", "--no-progress"]
CASES = {
    "heads": (
        [*TRAIN, "--model-config", "heads.json"],
        "hidden size (30) is not a multiple of the number of attention heads (4)",
    ),
    # the model is checked before the data is read: this data's tokenizer would fail too, later
    "heads-first": (
        [*TRAIN, "--model-config", "heads.json", "--data", "text.txt", "--tokenizer", "bpe:100000"],
        "hidden size (30) is not a multiple of the number of attention heads (4)",
    ),
    "negative": ([*TRAIN, "--model-config", "negative.json"], "negative dimension -32"),
    "window": ([*TRAIN, "--seq-len", "100000"], "--seq-len 8192 or less"),
    "bpe": (
        [*TRAIN, "--data", "text.txt", "--tokenizer", "bpe:100000"],
        "fewer than --tokenizer bpe:100000",
    ),
    "vocab-byte": (
        [*TRAIN, "--init-from", "big"],
        "has a vocabulary of 512 but this run's tokenizer (byte) has 256",
    ),
    "vocab-bpe": (
        [*TRAIN, "--init-from", "big", "--data", "text.txt", "--tokenizer", "bpe:300"],
        "has a vocabulary of 512 but this run's tokenizer (bpe:300) has 300",
    ),
    "plot": (["plot", "run", "--out", "plot.txt"], "a plot cannot be written as .txt"),
    "temperature": (
        ["generate", "run", "--prompt", "x", "--temperature", "nan"],
        "--temperature must be a finite number >= 0, got nan",
    ),
}


def _finished_run(folder) -> None:
    """A run directory as `diloco train` leaves it (of an untrained tiny GPT: nothing trains here)."""
    cfg = tiny_config(folder.parent, out=str(folder))
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    atomic_save_safetensors(GPT(cfg.model).state_dict(), folder / "model.safetensors")
    evals = [{"kind": "eval", "split": "subset", "sim_time_s": t, "val_loss": 5.0 - t} for t in (0.0, 1.0)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))


def _in_process(tmp_path, capsys, argv: list[str]) -> tuple[int, str]:
    from diloco.cli.main import main

    return main(argv), capsys.readouterr().err


def _processes(tmp_path, argvs: dict[str, list[str]]) -> dict[str, tuple[int, str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "diloco", *argv], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True
        )
        for name, argv in argvs.items()
    }
    return {name: (proc.wait(timeout=170), proc.stderr.read()) for name, proc in procs.items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["main", pytest.param("processes", marks=pytest.mark.slow)])
def test_what_cannot_work_is_refused_in_one_sentence_and_leaves_nothing(tmp_path, capsys, monkeypatch, how):
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "heads.json").write_text(
        json.dumps({**TINY_LLAMA, "hidden_size": 30, "num_attention_heads": 4})
    )
    (tmp_path / "negative.json").write_text(json.dumps({**TINY_LLAMA, "hidden_size": -32}))
    (tmp_path / "text.txt").write_text(load_corpus()[0].text.decode()[:200_000])
    _finished_run(tmp_path / "run")
    big = AutoConfig.for_model(**{**TINY_LLAMA, "vocab_size": 512})  # a model of another vocabulary
    AutoModelForCausalLM.from_config(big).save_pretrained(tmp_path / "big")  # and no tokenizer.json
    argvs = {
        name: [*args, *(["--out", "out"] if args[0] == "train" else [])] for name, (args, _) in CASES.items()
    }
    if how == "processes":  # real `python -m diloco`, all at once: they spend their time importing
        results = _processes(tmp_path, argvs)
    else:
        monkeypatch.chdir(tmp_path)
        capsys.readouterr()  # save_pretrained's progress bar
        results = {name: _in_process(tmp_path, capsys, argv) for name, argv in argvs.items()}
    for name, (code, err) in results.items():
        assert code == 2, (name, err)
        assert CASES[name][1] in err, (name, err)
        assert err.startswith("diloco: error:") and err.count("\n") == 1, (name, err)
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"heads.json", "negative.json", "text.txt", "big", "run"}, left  # no out/, runs/ or plot
