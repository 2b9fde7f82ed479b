"""Use a finished run: its model's loss on any text, text sampled from it, and an export that
Hugging Face transformers loads. Each reads the run directory only (config.json, the final
model.safetensors and, for bpe:N or a tokenizer file, tokenizer.json) and never writes to it.

    diloco eval runs/diloco-k4-H50-s0 --data notes.txt --json
    diloco generate runs/diloco-k4-H50-s0 --prompt "ROMEO:" --max-new-tokens 200
    diloco export runs/diloco-k4-H50-s0 exported/
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file

from diloco.config import TrainConfig
from diloco.data.batches import eval_windows
from diloco.data.recipe import check_data, data_record, validation
from diloco.data.text import TOKENIZER_FILE, bundled_text, eval_corpus, load_tokenizer, user_text
from diloco.data.tokenizer import Tokenizer
from diloco.errors import UserError, brief
from diloco.model.evaluate import evaluate
from diloco.model.init import build_model, with_tied
from diloco.rundir import load_run_config, resume_command
from diloco.rundir.metrics import perplexity


@dataclasses.dataclass
class Finished:
    """A finished run's config, final model (in eval mode) and tokenizer."""

    cfg: TrainConfig
    model: nn.Module
    tokenizer: Tokenizer
    run_dir: Path


def open_run(run_dir: Path) -> Finished:
    cfg = load_run_config(run_dir)
    path = run_dir / "model.safetensors"
    if not path.is_file():
        command = resume_command(cfg, run_dir)
        again = "diloco serve" if cfg.runtime == "server" else "diloco train"
        finish = (
            f"finish it with {command}"
            if command
            else f"it saved no checkpoint to finish from, so train it again with {again} (another --out, "
            f"or delete {run_dir} first)"
        )
        raise UserError(
            f"{run_dir} has no model.safetensors: the run has not finished; {finish}, or give a finished run."
        )
    if cfg.data.tokenizer != "byte" and not (run_dir / TOKENIZER_FILE).is_file():
        raise UserError(
            f"{run_dir} has no {TOKENIZER_FILE} although it used --tokenizer {cfg.data.tokenizer}; "
            "restore that file from the run."
        )
    tokenizer = load_tokenizer(cfg.data, bundled_text(), lambda: iter(()), run_dir)
    model = build_model(cfg)
    try:
        model.load_state_dict(with_tied(model, load_file(str(path))))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise UserError(
            f"{path} does not load into the model of {run_dir / 'config.json'} ({brief(e)}); "
            "restore the run's own files."
        ) from None
    model.eval()
    return Finished(cfg, model, tokenizer, run_dir)


def evaluate_run(
    run_dir: Path,
    paths: list[str] | None = None,
    *,
    text_field: str | None = None,
    progress: bool | None = None,
) -> dict:
    """{val_loss, val_ppl, tokens} of the run's final model on `paths` (every document of
    them), or on the run's own validation split."""
    run = open_run(run_dir)
    d = run.cfg.data
    if paths:
        text = user_text(paths, text_field=text_field or d.text_field, source_field="")
        tokens = eval_corpus(text, run.tokenizer, d, progress).split(True)
    else:
        check_data(run_dir, data_record(run.cfg), "evaluate its model on the text as it is with --data")
        tokens = validation(run.cfg, run.tokenizer, progress)
    if paths and len(tokens) <= run.cfg.model.seq_len:  # eval has no --seq-len: the run's is fixed
        raise UserError(
            f"--data holds {len(tokens)} tokens, fewer than one window of this run's model "
            f"({run.cfg.model.seq_len + 1} tokens); give more text."
        )
    windows = eval_windows(tokens, run.cfg.model.seq_len)
    loss = evaluate(run.model, windows)
    return {"val_loss": loss, "val_ppl": perplexity(loss), "tokens": windows.tokens_predicted()}


@torch.no_grad()
def sample(
    model: nn.Module,
    ids: list[int],
    *,
    max_new_tokens: int,
    seq_len: int,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
) -> list[int]:
    """`ids` and `max_new_tokens` more, each drawn from the model's next-token distribution
    (over the last seq_len tokens) at `temperature` (0: the most likely), among the `top_k`
    most likely (0: all)."""
    generator = torch.Generator().manual_seed(seed)
    x_BT = torch.tensor([ids], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits_V = model.logits(x_BT[:, -seq_len:])[0, -1].float()
        if temperature == 0:
            nxt = int(logits_V.argmax())
        else:
            logits_V = logits_V / temperature
            if top_k:
                kth = torch.topk(logits_V, min(top_k, len(logits_V))).values[-1]
                logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits_V, dim=0), 1, generator=generator))
        x_BT = torch.cat([x_BT, torch.tensor([[nxt]])], dim=1)
    return x_BT[0].tolist()


def generate(
    run_dir: Path, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int, seed: int
) -> str:
    """The prompt and what the run's final model writes after it."""
    for flag, value, example in (
        ("--max-new-tokens", max_new_tokens, 200),
        ("--temperature", temperature, 0.8),
        ("--top-k", top_k, 0),
    ):
        if not 0 <= value < math.inf:  # nan and inf too
            raise UserError(f"{flag} must be a finite number >= 0, got {value}; use e.g. {flag} {example}.")
    run = open_run(run_dir)
    ids = [int(i) for i in run.tokenizer.encode_batch([prompt])[0]]
    if not ids:
        if run.tokenizer.eos_id is None:
            raise UserError(
                "--prompt is empty and this tokenizer has no end-of-text token to start from; give a prompt."
            )
        ids = [run.tokenizer.eos_id]
    out = sample(
        run.model,
        ids,
        max_new_tokens=max_new_tokens,
        seq_len=run.cfg.model.seq_len,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
    )
    return run.tokenizer.decode(out if prompt else out[1:])


def export(run_dir: Path, out_dir: Path) -> Path:
    """Write the run's final model and tokenizer to `out_dir` in Hugging Face's layout
    (AutoModelForCausalLM / AutoTokenizer .from_pretrained load it). The folder appears whole:
    it is written beside `out_dir` and renamed."""
    from diloco.data.tokenizer import export_tokenizer
    from diloco.model.hf import export_model

    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} is a file; give as OUT_DIR a new (or an empty) folder.")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"{out_dir} already exists and is not empty; choose a new OUT_DIR or delete it.")
    run = open_run(run_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise UserError(f"cannot create {tmp} ({e.strerror}); choose another OUT_DIR.") from None
    try:
        export_model(run.model, tmp, eos_id=run.tokenizer.eos_id)
        export_tokenizer(run.tokenizer, tmp, model_max_length=run.cfg.model.seq_len)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
