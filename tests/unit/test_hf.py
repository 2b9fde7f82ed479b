"""diloco.model.hf: transformers causal LMs behind diloco's model interface, and export to transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from diloco.config import ModelConfig
from diloco.errors import UserError
from diloco.model.gpt import GPT
from diloco.model.hf import (
    HFCausalLM,
    export_model,
    gpt_to_gpt2,
    is_pretrained_dir,
    load_model_config,
    load_pretrained,
)

LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 300,
    "max_position_embeddings": 64,
}
GPT2 = {
    "model_type": "gpt2",
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 2,
    "vocab_size": 300,
    "n_positions": 64,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
QWEN2 = {**LLAMA, "model_type": "qwen2"}
BERT = {
    "model_type": "bert",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 300,
    "max_position_embeddings": 64,
}


def _ids(vocab: int, B: int = 2, T: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _write(tmp_path, config: dict, name: str = "config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


# ---- building and training ----


def test_llama_forward_is_cross_entropy_of_its_own_logits():
    torch.manual_seed(0)
    model = HFCausalLM(LLAMA)
    assert (model.vocab_size, model.max_positions, model.n_blocks) == (300, 64, 2)
    assert all(k.startswith("model.") for k in model.state_dict())
    assert set(model.hf_state_dict()) == {k.removeprefix("model.") for k in model.state_dict()}
    idx, targets = _ids(300), _ids(300, seed=2)
    loss = model(idx, targets)
    hf_logits = model.model(input_ids=idx).logits
    expected = F.cross_entropy(hf_logits.reshape(-1, 300), targets.reshape(-1))
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert model.logits(idx).dtype == torch.float32 and model.logits(idx).shape == (2, 16, 300)
    assert abs(loss.item() - torch.log(torch.tensor(300.0)).item()) < 0.5  # about uniform at init


def test_one_adamw_step_lowers_the_loss():
    torch.manual_seed(0)
    model = HFCausalLM(LLAMA)
    idx, targets = _ids(300), _ids(300, seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model(idx, targets)
    before.backward()
    opt.step()
    with torch.no_grad():
        after = model(idx, targets)
    assert after.item() < before.item() - 0.05


def test_same_seed_same_parameters():
    def build(seed: int) -> dict:
        torch.manual_seed(seed)
        return HFCausalLM(LLAMA).state_dict()

    a, b, c = build(0), build(0), build(1)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


BERT_DECODER = {**BERT, "is_decoder": True}


@pytest.mark.parametrize(
    "config", [LLAMA, GPT2, QWEN2, BERT_DECODER], ids=["llama", "gpt2", "qwen2", "bert-decoder"]
)
def test_models_build_and_are_causal(config):
    torch.manual_seed(0)
    model = HFCausalLM(config).eval()
    assert model.vocab_size == 300 and model.n_blocks == 2 and model.max_positions == 64
    idx = _ids(300)
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 300
    with torch.no_grad():
        a, b = model.logits(idx), model.logits(changed)
        loss = model(idx, idx)
    assert torch.isfinite(loss)
    assert torch.equal(a[:, :-1], b[:, :-1])  # earlier positions do not see the last token
    assert not torch.equal(a[:, -1], b[:, -1])


# ---- configs a user gives ----


def test_load_model_config_from_path_and_text(tmp_path):
    path = _write(tmp_path, LLAMA)
    assert load_model_config(str(path)) == LLAMA
    assert load_model_config(json.dumps(GPT2)) == GPT2


def test_bert_is_not_a_causal_lm(tmp_path):
    path = _write(tmp_path, BERT)
    with pytest.raises(UserError, match="not a causal LM") as e:
        load_model_config(str(path))
    assert str(path) in str(e.value) and "is_decoder" in str(e.value)
    assert load_model_config(json.dumps({**BERT, "is_decoder": True}))["is_decoder"] is True


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ({**LLAMA, "model_type": "no-such-model"}, "does not know"),
        ({"model_type": "vit"}, "not a causal LM"),  # a known model type without a causal-LM class
        ({"hidden_size": 32}, "no 'model_type'"),
        ([1, 2], "not a JSON object"),
        ("{not json", "not valid JSON"),
        (
            {**LLAMA, "hidden_size": 30, "num_attention_heads": 4},
            r"hidden size \(30\) is not a multiple of the number of attention heads",
        ),
        (
            {**GPT2, "n_embd": 30, "n_head": 4},
            "must be divisible by num_heads",
        ),  # found when the model is built
        ({**LLAMA, "hidden_size": -32}, "negative dimension -32"),
    ],
    ids=["unknown", "vision", "no-type", "array", "bad-json", "heads", "gpt2-heads", "negative"],
)
def test_bad_config_files(tmp_path, content, match):
    path = tmp_path / "model.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(UserError, match=match) as e:
        load_model_config(str(path))
    assert str(path) in str(e.value)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_hf_export_writes_the_tokenizers_end_of_text_id_and_ties_weights_once(tmp_path, tie):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = HFCausalLM({**LLAMA, "tie_word_embeddings": tie})  # Llama's own ids: bos 1, eos 2
    export_model(model, tmp_path / "out", eos_id=0)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == saved["bos_token_id"] == generation["eos_token_id"] == 0
    assert model.model.config.eos_token_id == 2  # the training model is left as it was
    weights = tmp_path / "out" / "model.safetensors"
    assert ("lm_head.weight" in load_file(weights)) != tie
    assert weights.stat().st_mode & 0o777 == (tmp_path / "out" / "config.json").stat().st_mode & 0o777
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    tied = loaded.get_output_embeddings().weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()
    assert tied == tie


def test_missing_config_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(UserError, match="cannot be read") as e:
        load_model_config(str(path))
    assert str(path) in str(e.value)


def test_importing_diloco_hf_does_not_import_transformers():
    code = "import sys, diloco.model.hf; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- diloco's GPT and export ----


def test_gpt_forward_is_cross_entropy_of_logits():
    torch.manual_seed(0)
    model = GPT(ModelConfig(name="nano", vocab_size=256, n_layer=2, n_head=2, d_model=32, seq_len=16))
    idx, targets = _ids(256), _ids(256, seed=2)
    logits = model.logits(idx)
    assert logits.shape == (2, 16, 256)
    assert torch.equal(model(idx, targets), F.cross_entropy(logits.reshape(32, 256), targets.reshape(32)))


@pytest.mark.parametrize("vocab_size", [256, 300], ids=["tied", "untied"])
def test_gpt_export_round_trip(tmp_path, vocab_size):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = ModelConfig(name="nano", vocab_size=vocab_size, n_layer=2, n_head=2, d_model=32, seq_len=16)
    model = GPT(cfg).eval()
    with torch.no_grad():  # non-zero biases and norms, so that a mix-up of them shows
        for name, p in model.named_parameters():
            if not name.endswith("weight") or "ln" in name:
                p.add_(0.1 * torch.randn_like(p))
    config, sd = gpt_to_gpt2(model)
    assert config.tie_word_embeddings == (vocab_size <= 256)
    export_model(model, tmp_path / "out")
    assert is_pretrained_dir(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    idx = _ids(vocab_size)
    with torch.no_grad():
        ours, theirs = model.logits(idx), loaded(input_ids=idx).logits
    assert (ours - theirs).abs().max().item() < 1e-5
    tied = loaded.get_output_embeddings().weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()
    assert tied == (vocab_size <= 256)


def test_hf_export_and_load_pretrained_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = HFCausalLM(LLAMA).eval()
    export_model(model, tmp_path / "out")
    assert model.model.config.use_cache is False  # still off for training
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved.get("use_cache", True) is True
    idx = _ids(300)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    with torch.no_grad():
        expected = model.logits(idx)
        assert (loaded(input_ids=idx).logits - expected).abs().max().item() < 1e-5

    config, sd = load_pretrained(tmp_path / "out")
    assert config["model_type"] == "llama" and config["vocab_size"] == 300
    torch.manual_seed(1)
    again = HFCausalLM(config).eval()
    with torch.no_grad():
        assert (again.logits(idx) - expected).abs().max().item() > 1e-3  # different weights before loading
        again.load_hf_state_dict(sd)
        assert (again.logits(idx) - expected).abs().max().item() < 1e-5


def test_load_hf_state_dict_refuses_other_weights():
    model = HFCausalLM(LLAMA)
    other = HFCausalLM({**LLAMA, "intermediate_size": 48})
    with pytest.raises(UserError, match="do not fit"):
        model.load_hf_state_dict(other.hf_state_dict())


def test_not_a_pretrained_dir(tmp_path):
    assert not is_pretrained_dir(tmp_path)
    _write(tmp_path, LLAMA)
    assert not is_pretrained_dir(tmp_path)  # a config but no weights
    with pytest.raises(UserError) as e:
        load_pretrained(tmp_path)
    assert str(tmp_path) in str(e.value)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    assert is_pretrained_dir(tmp_path)
    with pytest.raises(UserError, match="cannot be loaded") as e:
        load_pretrained(tmp_path)
    assert str(tmp_path) in str(e.value)
