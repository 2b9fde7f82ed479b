"""Hugging Face models with tied embeddings (GPT-2 by default, Llama with tie_word_embeddings):
train, stop, resume, evaluate and export them, the tie kept everywhere."""

import json

import pytest
import torch
from conftest import TINY_LLAMA, user_files
from safetensors.torch import load_file

from diloco.cli.main import main
from diloco.run.use import open_run

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64, "vocab_size": 320}
GPT2 |= {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # comparable bit for bit
FLAGS = ["--tokenizer", "bpe:300", "--seq-len", "32", "--batch-size", "4", "--inner-steps", "2"]
FLAGS += ["--rounds", "2", "--workers", "2", "--threads", "1", "--procs", "1", "--no-progress"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", [GPT2, {**TINY_LLAMA, "tie_word_embeddings": True}], ids=["gpt2", "llama"])
def test_a_tied_model_trains_resumes_evaluates_and_exports_with_its_tie(tmp_path, capsys, config):
    from transformers import AutoModelForCausalLM

    data, _ = user_files(tmp_path)
    (tmp_path / "model.json").write_text(json.dumps(config))
    flags = [*FLAGS, "--data", data, "--model-config", str(tmp_path / "model.json")]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", *flags, "--out", str(straight)]) == 0
    assert main(["train", *flags, "--checkpoint-every", "1", "--stop-after", "1", "--out", str(resumed)]) == 0
    assert main(["train", "--resume", str(resumed), "--no-progress"]) == 0
    assert (resumed / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()
    embedding = "transformer.wte.weight" if config["model_type"] == "gpt2" else "model.embed_tokens.weight"
    saved = load_file(resumed / "model.safetensors")
    assert f"model.{embedding}" in saved and "model.lm_head.weight" not in saved  # once
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["params"] == sum(t.numel() for t in saved.values())
    mode = (resumed / "config.json").stat().st_mode & 0o777
    for weights in [resumed / "model.safetensors", *resumed.glob("checkpoints/*/state.safetensors")]:
        assert weights.stat().st_mode & 0o777 == mode, weights

    capsys.readouterr()
    assert main(["eval", str(resumed), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["val_loss"] == pytest.approx(summary["val_loss"], abs=1e-6)
    finished = open_run(resumed)
    assert (
        finished.model.model.get_output_embeddings().weight
        is finished.model.model.get_input_embeddings().weight
    )

    assert main(["export", str(resumed), str(tmp_path / "hf")]) == 0
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["tie_word_embeddings"] is True and exported["eos_token_id"] == 0  # <|endoftext|>
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777 == mode
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    assert hf.get_output_embeddings().weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
    x = torch.tensor([finished.tokenizer.encode_batch(["O Romeo, Romeo!"])[0].tolist()])
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, finished.model.logits(x), atol=1e-5)
