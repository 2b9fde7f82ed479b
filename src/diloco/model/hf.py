"""Hugging Face models: train any transformers causal LM, export diloco's GPT for transformers.

- `load_model_config` reads a transformers model config (a config.json path or JSON text) and
  refuses, with a `UserError`, anything AutoModelForCausalLM cannot build as a causal LM (it
  builds the model on the meta device: sizes that do not fit fail there, not in a run).
- `HFCausalLM(config)` builds that model from the config alone (random weights, nothing
  downloaded; deterministic under `torch.manual_seed`) behind diloco's model interface:
  `forward(idx_BT, targets_BT)` is the mean cross-entropy, `logits(idx_BT)` float32 logits.
- `export_model` writes diloco's GPT (as a GPT2LMHeadModel, `gpt_to_gpt2`) or an HFCausalLM as
  a save_pretrained directory; `load_pretrained` reads such a directory back (local files only).

transformers is imported inside the functions that need it (it takes seconds to import).

    python -c "from diloco.model.hf import HFCausalLM; print(HFCausalLM({'model_type': 'gpt2', \
'n_layer': 2, 'n_embd': 32, 'n_head': 2}).n_blocks)"
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from diloco.config.parsers import is_pretrained_dir as is_pretrained_dir
from diloco.config.parsers import read_model_config
from diloco.errors import UserError

if TYPE_CHECKING:
    import transformers

# Encoder models (BERT, RoBERTa, ...) also have a causal-LM class, their LM head used as a decoder:
# it attends causally only when the config says so, with this key (default `is_decoder`).
_DECODER_SWITCH = {"xlm": "causal"}


def load_model_config(text_or_path: str, where: str | None = None) -> dict:
    """A Hugging Face model config as a dict, from a JSON file's path or from JSON text ('{...').

    UserError (naming the file, or `where`, and the fix) if it is missing, not a JSON object, has
    no known `model_type`, or that model type is not a causal LM.
    """
    config, where = read_model_config(text_or_path, where)
    model_type = config["model_type"]
    _check_causal_lm(config, where)
    from huggingface_hub.errors import StrictDataclassError  # a config's own checks fail with it

    try:
        with torch.device("meta"):  # shapes only: a config transformers cannot build fails here
            HFCausalLM(config)
    except (ValueError, TypeError, KeyError, RuntimeError, StrictDataclassError) as e:
        e = e.__cause__ if isinstance(e, StrictDataclassError) and e.__cause__ else e  # what failed
        why = " ".join(str(e).split()).rstrip(".")  # transformers' messages span lines
        raise UserError(f"{where} is not a valid {model_type!r} config ({why}): fix that field.") from None
    return config


def _check_causal_lm(config: dict, where: str) -> None:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    model_type = config["model_type"]
    if model_type not in CONFIG_MAPPING:
        raise UserError(
            f"{where} has model_type {model_type!r}, which transformers does not know: "
            'use one of its model types, such as "llama", "gpt2" or "qwen2".'
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            f"{where} has model_type {model_type!r}, which is not a causal LM (AutoModelForCausalLM "
            'cannot build it): use a decoder-only model type such as "llama", "gpt2" or "qwen2".'
        )
    # An encoder's LM head (BertLMHeadModel, ...) attends to later tokens unless configured as a
    # decoder; the decoder halves of seq2seq models (BartForCausalLM, ...) always are one.
    encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if encoder and model_type not in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        switch = _DECODER_SWITCH.get(model_type, "is_decoder")
        if config.get(switch) is not True:
            raise UserError(
                f"{where} has model_type {model_type!r}, an encoder, which is not a causal LM unless "
                f'configured as a decoder: set "{switch}": true or use a decoder-only model type.'
            )


def hf_config(config: dict) -> transformers.PretrainedConfig:
    """The transformers config of a config dict (which holds `model_type`)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**config)


class HFCausalLM(nn.Module):
    """A transformers causal LM built from a config dict, with diloco's model interface.

    `forward(idx_BT, targets_BT)` returns the mean cross-entropy, `logits(idx_BT)` float32 logits.
    The transformers model is `self.model`: state_dict keys are 'model.' + its own keys;
    `hf_state_dict` and `load_hf_state_dict` use its keys.
    """

    def __init__(self, config: dict):
        super().__init__()
        from transformers import AutoModelForCausalLM

        hf_cfg = hf_config(config)
        self._use_cache = getattr(hf_cfg, "use_cache", None)  # restored in exported configs
        hf_cfg.use_cache = False  # training: no key/value cache
        try:
            model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)
        except (ValueError, ImportError):  # no SDPA implementation for this model type
            model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager", dtype=torch.float32)
        self.model = model
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        # attribute_map gives every config these names (GPT-2's n_positions, n_layer, ...)
        text_cfg = model.config.get_text_config()
        self.max_positions: int | None = getattr(text_cfg, "max_position_embeddings", None)
        self.n_blocks: int = text_cfg.num_hidden_layers

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def logits(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx_BT, use_cache=False).logits.float()

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        logits_BTV = self.logits(idx_BT)
        return F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), targets_BT.reshape(-1))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        try:
            self.model.load_state_dict(state_dict, strict=True)
        except RuntimeError as e:
            first = str(e).strip().splitlines()
            raise UserError(
                f"the weights do not fit this {self.model.config.model_type!r} model "
                f"({' '.join(line.strip() for line in first[:3])}): load weights saved with the same config."
            ) from None


def gpt_to_gpt2(model: nn.Module) -> tuple[transformers.GPT2Config, dict[str, torch.Tensor]]:
    """diloco's GPT as a transformers GPT2LMHeadModel: its config and state dict (same numbers).

    GPT-2 uses Conv1D layers, whose weights are nn.Linear's transposed.
    """
    from transformers import GPT2Config

    cfg = model.cfg
    tied = model.head is None
    config = GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=4 * cfg.d_model,
        activation_function="gelu",  # exact erf GELU, as F.gelu
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's default
        scale_attn_weights=True,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=None,
    )
    src = {k: v.detach() for k, v in model.state_dict().items()}
    sd = {
        "transformer.wte.weight": src["tok_emb.weight"],
        "transformer.wpe.weight": src["pos_emb.weight"],
        "transformer.ln_f.weight": src["ln_f.weight"],
        "transformer.ln_f.bias": src["ln_f.bias"],
        "lm_head.weight": src["tok_emb.weight"] if tied else src["head.weight"],
    }
    names = {
        "ln_attn": "ln_1",
        "qkv": "attn.c_attn",
        "attn_out": "attn.c_proj",
        "ln_mlp": "ln_2",
        "mlp_in": "mlp.c_fc",
        "mlp_out": "mlp.c_proj",
    }
    for i in range(cfg.n_layer):
        for ours, theirs in names.items():
            weight, bias = src[f"blocks.{i}.{ours}.weight"], src[f"blocks.{i}.{ours}.bias"]
            if not ours.startswith("ln_"):
                weight = weight.T  # Conv1D stores (in, out)
            sd[f"transformer.h.{i}.{theirs}.weight"] = weight.contiguous().clone()
            sd[f"transformer.h.{i}.{theirs}.bias"] = bias.clone()
    return config, sd


def export_model(model: nn.Module, out_dir: Path, *, eos_id: int | None = None) -> None:
    """Save `model` (diloco's GPT or an HFCausalLM) as a transformers save_pretrained directory.

    `eos_id`, the tokenizer's end-of-text id (None: it has none), becomes the model's
    `eos_token_id` and `bos_token_id` (every document ends with it, so text starts after it).
    Tied weights are saved once and tied again by from_pretrained; the weight files get the mode
    config.json has (safetensors makes them 0600)."""
    from diloco.model.gpt import GPT

    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if isinstance(model, HFCausalLM):
        hf_model = model.model
        settings = {"use_cache": model._use_cache}
    elif isinstance(model, GPT):
        from transformers import GPT2LMHeadModel

        config, sd = gpt_to_gpt2(model)
        hf_model = GPT2LMHeadModel(config)
        hf_model.load_state_dict(sd, strict=True)
        settings = {}
    else:
        raise TypeError(f"export_model takes diloco's GPT or an HFCausalLM, not {type(model).__name__}")
    ids = {"bos_token_id": eos_id, "eos_token_id": eos_id}
    changes = [(hf_model.config, {**settings, **ids})]
    if getattr(hf_model, "generation_config", None) is not None:
        changes.append((hf_model.generation_config, ids))
    before = [(c, {k: getattr(c, k, None) for k in new}) for c, new in changes]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    try:
        for c, new in changes:
            for k, v in new.items():
                setattr(c, k, v)
        with _quiet():
            hf_model.save_pretrained(out_dir, safe_serialization=True)
    finally:  # an HFCausalLM goes on training as it was
        for c, old in before:
            for k, v in old.items():
                setattr(c, k, v)
    mode = (Path(out_dir) / "config.json").stat().st_mode & 0o777
    for weights in Path(out_dir).glob("*.safetensors"):
        weights.chmod(mode)


@contextlib.contextmanager
def _quiet():
    """Without transformers' progress bars (loading and writing weights), which fill run logs."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_pretrained(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, transformers-keyed state dict) of a save_pretrained directory (local files only)."""
    if not is_pretrained_dir(path):
        raise UserError(
            f"{path} is not a transformers model directory: give one written by save_pretrained "
            "(a config.json with 'model_type' and model.safetensors)."
        )
    load_model_config(str(Path(path) / "config.json"))
    from transformers import AutoModelForCausalLM

    try:
        with _quiet():
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except Exception as e:  # corrupt or foreign files fail in many ways (OSError, SafetensorError, ...)
        raise UserError(
            f"{path} cannot be loaded as a transformers causal LM ({e}): check its files."
        ) from None
    config: dict[str, Any] = model.config.to_dict()
    config.pop("_name_or_path", None)  # where it was loaded from, not part of the model
    return config, dict(model.state_dict())
