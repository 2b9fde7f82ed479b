"""The model of a run and its initial parameters: diloco's GPT or a Hugging Face causal LM, fitted
to the tokenizer, from the seed or from `--init-from` (checked against the model and the
tokenizer before anything trains).

    python -c "from diloco.model.init import initial_model; from diloco.config import TrainConfig; \
print(sum(p.numel() for p in initial_model(TrainConfig(), None).parameters()))"
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file

from diloco.config import TrainConfig
from diloco.data.text import TOKENIZER_FILE
from diloco.data.tokenizer import Tokenizer
from diloco.errors import UserError
from diloco.model.gpt import GPT


def check_model_config(cfg: TrainConfig) -> None:
    """Refuse a --model-config transformers cannot build (a UserError naming it and the fix), before
    any data is read or tokenized. The config layer reads the file; building needs the model room."""
    if cfg.model.hf_config:
        from diloco.model.hf import load_model_config

        load_model_config(cfg.model.hf_config, where="the model config (--model-config)")


def fit_model(cfg: TrainConfig, tokenizer: Tokenizer) -> TrainConfig:
    """`cfg` with a model that fits the tokenizer: diloco's GPT gets at least its vocabulary; a
    Hugging Face config must already have it, and positions for --seq-len."""
    vocab = tokenizer.vocab_size
    if not cfg.model.hf_config:
        return dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, vocab_size=max(cfg.model.vocab_size, vocab))
        )
    from diloco.model.hf import hf_config, load_model_config

    # transformers must build it (a UserError naming --model-config otherwise), with its defaults
    config = load_model_config(cfg.model.hf_config, where="the model config (--model-config)")
    spec = hf_config(config).get_text_config()
    if spec.vocab_size < vocab:
        raise UserError(
            f"the model config's vocab_size is {spec.vocab_size} but the tokenizer "
            f"({cfg.data.tokenizer}) has {vocab} tokens; raise vocab_size in the config to at least {vocab}, "
            "or use a smaller tokenizer."
        )
    positions = getattr(spec, "max_position_embeddings", None)  # GPT-2's n_positions too
    if positions is not None and positions < cfg.model.seq_len:
        raise UserError(
            f"the model config allows {positions} positions but --seq-len is {cfg.model.seq_len}; "
            f"use --seq-len {positions} or less."
        )
    blocks = getattr(spec, "num_hidden_layers", None)
    if blocks is not None and blocks < 1:
        raise UserError(
            f"the model config has {blocks} blocks (num_hidden_layers); set num_hidden_layers to 1 or more."
        )
    if blocks is not None and cfg.fragments > blocks:
        raise UserError(
            f"fragments (--fragments) is {cfg.fragments} but the model has {blocks} blocks; "
            f"use at most {blocks}."
        )
    return cfg


def build_model(cfg: TrainConfig) -> nn.Module:
    """The run's model, untrained: diloco's GPT, or the Hugging Face causal LM of --model-config."""
    if cfg.model.hf_config:
        from diloco.model.hf import HFCausalLM

        return HFCausalLM(json.loads(cfg.model.hf_config))
    return GPT(cfg.model)


def load_init(cfg: TrainConfig, tokenizer: Tokenizer | None = None) -> dict[str, torch.Tensor] | None:
    """The parameters `--init-from` names (a run directory's model.safetensors, that file, or a
    directory saved by save_pretrained), checked against the model `cfg` builds and, where that
    directory holds a tokenizer.json, against `tokenizer`; None without --init-from."""
    if not cfg.init_from:
        return None
    from diloco.model import hf

    path = Path(cfg.init_from)
    fix = (
        "give a finished run directory, a model.safetensors file, or a save_pretrained directory "
        "of the same model"
    )
    if hf.is_pretrained_dir(path):
        if not cfg.model.hf_config:
            raise UserError(
                f"--init-from {path} holds a Hugging Face model; give its config.json to --model-config too."
            )
        tensors = {f"model.{k}": v for k, v in hf.load_pretrained(path)[1].items()}
    else:
        if path.is_dir():
            if not (path / "model.safetensors").is_file():
                raise UserError(
                    f"--init-from {path} has no model.safetensors (has that run finished?); {fix}."
                )
            path = path / "model.safetensors"
        if not path.is_file():
            raise UserError(f"--init-from {path} does not exist; {fix}.")
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise UserError(f"--init-from {path} is not a readable safetensors file ({e}); {fix}.") from None
    with torch.device("meta"):  # shapes only: nothing allocated
        model = build_model(cfg)
    tensors = with_tied(model, tensors)
    want = {k: v.shape for k, v in model.state_dict().items()}
    got = {k: v.shape for k, v in tensors.items()}
    vocab = (
        cfg.model.vocab_size if not cfg.model.hf_config else json.loads(cfg.model.hf_config).get("vocab_size")
    )
    for name in sorted(want.keys() & got.keys()):  # a vocabulary of another size: the likely cause
        there, here = got[name], want[name]
        if there != here and there[1:] == here[1:] and here[0] == vocab:
            raise UserError(
                f"--init-from {path} has a vocabulary of {there[0]} ({name}) but this run's tokenizer "
                f"and model have {here[0]}; use the tokenizer (--tokenizer) of the run it came from."
            )
    for name in sorted(want.keys() | got.keys()):
        if want.get(name) != got.get(name):
            there, here = got.get(name), want.get(name)
            shapes = (
                f"{tuple(there) if there is not None else 'missing'} there, "
                f"{tuple(here) if here is not None else 'absent'} here"
            )
            raise UserError(
                f"--init-from {path} does not fit this model: {name} is {shapes}; "
                "use the model settings (--model, --model-config) of the run it came from."
            )
    if tokenizer is None:
        return tensors
    known = check_init_tokenizer(path if path.is_dir() else path.parent, tokenizer)
    # diloco's GPT has the rows this tokenizer gives it (checked above); a Hugging Face model
    # learned its vocabulary's tokens, unknown here unless its folder names this tokenizer
    if cfg.model.hf_config and not known and model.vocab_size != tokenizer.vocab_size:
        raise UserError(
            f"--init-from {path} has a vocabulary of {model.vocab_size} but this run's tokenizer "
            f"({cfg.data.tokenizer}) has {tokenizer.vocab_size}, and its folder has no {TOKENIZER_FILE} "
            "to show they match; give --tokenizer the tokenizer.json the model was trained with."
        )
    return tensors


def check_init_tokenizer(folder: Path, tokenizer: Tokenizer) -> bool:
    """A model to start from was trained with the tokenizer its folder names (its tokenizer.json,
    or a diloco run's config.json saying byte): this run's tokenizer must give the same ids, or
    the model would read other tokens than it learned. Returns whether the folder names one."""
    from diloco.data.tokenizer import ByteTokenizer, load_tokenizer_file

    if (folder / TOKENIZER_FILE).is_file():
        theirs: Tokenizer = load_tokenizer_file(folder / TOKENIZER_FILE)
        why, use = f"its {TOKENIZER_FILE} splits text differently", folder / TOKENIZER_FILE
    elif _run_tokenizer(folder) == "byte":
        theirs, why, use = ByteTokenizer(), "bytes, its config.json says", "byte"
    else:
        return False
    probe = [PROBE_TEXT]
    if theirs.encode_batch(probe)[0].tolist() != tokenizer.encode_batch(probe)[0].tolist():
        raise UserError(
            f"--init-from {folder} was trained with another tokenizer ({why}); give --tokenizer {use}."
        )
    return True


def _run_tokenizer(folder: Path) -> str | None:
    """The --tokenizer of the diloco run in `folder` (from its config.json), if it is one."""
    try:
        data = json.loads((folder / "config.json").read_text()).get("data")
    except (OSError, ValueError, AttributeError):
        return None
    return data.get("tokenizer") if isinstance(data, dict) else None


# text every tokenizer must split the same way to be the same tokenizer (a sample, not a proof)
PROBE_TEXT = (
    "ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
    "  Tabs\tand   spaces, numbers 0123456789, punctuation !?;:'\"()[]{}<>-_=+*/\\|@#$%^&~`\n"
    "Unicode: café, naïve, Ærøskøbing, Ελληνικά, русский, 漢字, 日本語, 한국어, emoji 🙂🚀\n"
)


def initial_model(cfg: TrainConfig, init: dict[str, torch.Tensor] | None) -> nn.Module:
    """The global model at the start: from `cfg.seed`, then `init`'s parameters if given."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    if init is not None:
        model.load_state_dict(init)
    return model


def with_tied(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (a state dict of `model` saved with each tied weight once) with every name of a
    tied weight filled in, as `model.load_state_dict` wants them. Works on the meta device."""
    keys = model.state_dict().keys()
    names: dict[int, list[str]] = {}  # each parameter or buffer: the state dict names it has
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        if name in keys:
            names.setdefault(id(t), []).append(name)
    full = dict(tensors)
    for group in names.values():
        if len(group) > 1 and (have := next((n for n in group if n in full), None)) is not None:
            for name in group:
                full.setdefault(name, full[have])
    return full
