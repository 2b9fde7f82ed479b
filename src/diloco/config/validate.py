"""Validation of a TrainConfig, run when one is built: types and choices from the declarations
(diloco.settings), then ranges, then the settings that do not apply to the run. Every check a user
can fail raises `UserError` with one sentence naming the field and the fix. What a setting's
`needs` says is checked from its declaration; only cross-checks a condition cannot say are here.

    python -c "from diloco.config import TrainConfig; TrainConfig(num_workers=0)"  # the UserError
"""

from __future__ import annotations

import math
from typing import Any

from diloco import settings
from diloco.config.parsers import parse_slowdown, parse_spec
from diloco.config.sections import GPT_MAX_SEQ_LEN, MAX_THREADS, ON_SERVER
from diloco.core.codec import TOPK_BITS
from diloco.core.membership import parse_workers_schedule
from diloco.errors import UserError


def _label(cfg: Any, path: str) -> str:
    """How messages name a setting: "inner.lr (--inner-lr)" (see diloco.config.label)."""
    return settings.label(type(cfg), path)


# a worker's batch n comes from a generator seeded by (seed · 1,000,003 + worker) · 1,000,003 + n
# (data/recipe.py, data/batches.py), which torch takes up to 2^64 − 1
MAX_SEED = 2**24 - 1
# settings that simulate faults of sync DiLoCo: (setting, what it simulates)
SIMULATED_FAULTS = (("drop_prob", "lost outer_grads"), ("workers_schedule", "workers coming and going"))


def validate(cfg: Any) -> None:
    """Reject every setting of a TrainConfig that cannot run, naming the field and the fix: types
    and choices first (from the declarations), then ranges, then settings that do not apply."""
    settings.check_types(cfg)
    settings.check_choices(cfg)
    positive = ("num_workers", "inner_steps", "rounds", "keep_checkpoints", "data.batch_size")
    for key in (*positive, "data.eval_windows", "procs_per_worker"):
        settings.at_least(cfg, key, minimum=1)
    for key in ("seed", "threads", "eval_every", "checkpoint_every", "inner.warmup_steps"):
        settings.at_least(cfg, key, minimum=0)
    settings.check(cfg.seed <= MAX_SEED, "seed (--seed)", cfg.seed, f"an integer from 0 to {MAX_SEED}")
    settings.check(cfg.threads <= MAX_THREADS, "threads (--threads)", cfg.threads, f"at most {MAX_THREADS}")
    if cfg.eval_every and cfg.method != "async" and cfg.eval_every % cfg.inner_steps:
        raise UserError(
            f"eval_every (--eval-every) must be a multiple of inner_steps ({cfg.inner_steps}), got "
            f"{cfg.eval_every}: the global model exists only between rounds; use 0 for every round."
        )
    m = cfg.model
    settings.at_least(cfg, "model.vocab_size", minimum=256)
    for key in ("model.n_layer", "model.n_head", "model.d_model"):
        settings.at_least(cfg, key, minimum=1)
    settings.at_least(cfg, "model.seq_len", minimum=2)
    if m.seq_len > GPT_MAX_SEQ_LEN and not m.hf_config:
        raise UserError(
            f"model.seq_len (--seq-len) is {m.seq_len}, longer than diloco's GPT takes ({GPT_MAX_SEQ_LEN}); "
            f"use --seq-len {GPT_MAX_SEQ_LEN} or less, or a --model-config with that many positions."
        )
    if m.d_model % m.n_head:
        raise UserError(
            f"model.d_model ({m.d_model}) must be divisible by model.n_head ({m.n_head}); change one of them."
        )
    settings.in_range(cfg, "data.val_fraction", lo=0.0, hi=0.5, lo_open=True)
    for key in ("inner.lr", "outer.lr", "outer.adam_eps", "bucket_mb", "timeout_s"):
        settings.in_range(cfg, key, lo=0.0, lo_open=True)
    for key in ("inner.weight_decay", "inner.grad_clip", "target_loss"):
        settings.in_range(cfg, key, lo=0.0)
    settings.in_range(cfg, "inner.min_lr_ratio", lo=0.0, hi=1.0)
    for key in ("inner.beta1", "inner.beta2", "outer.momentum", "outer.adam_beta1", "outer.adam_beta2"):
        settings.in_range(cfg, key, lo=0.0, hi=1.0, hi_open=True)
    settings.in_range(cfg, "drop_prob", lo=0.0, hi=1.0, hi_open=True)
    if cfg.workers_schedule:
        try:
            parse_workers_schedule(cfg.workers_schedule, cfg.num_workers)
        except (ValueError, TypeError, AttributeError):
            raise UserError(
                f"workers_schedule (--workers-schedule) must be FRACTION:WORKERS pairs like "
                f"'0:4,0.5:8', starting at 0, fractions rising below 1, 1 to num_workers "
                f"({cfg.num_workers}) workers, got {cfg.workers_schedule!r}; fix it."
            ) from None
    _validate_data(cfg)
    if cfg.on_nonfinite == "drop" and cfg.method in ("single", "dp"):
        raise UserError(
            f"on_nonfinite (--on-nonfinite) drop needs outer_grads to drop; --method {cfg.method} has one "
            "model: use --on-nonfinite stop."
        )
    if cfg.runtime == "collective" and cfg.method != "diloco":
        raise UserError("the collective runtime runs --method diloco only; use --runtime sim for others.")
    if cfg.runtime == "server":
        if cfg.method not in ("diloco", "async"):
            raise UserError(
                f"the parameter server runs --method diloco or async, not {cfg.method}; use diloco train "
                "for the baselines."
            )
        for key, what in SIMULATED_FAULTS:
            if settings.changed(cfg, key):
                raise UserError(
                    f"{_label(cfg, key)} simulates {what}, which the parameter server has for real "
                    "(timeouts, workers joining and leaving); drop it."
                )
        if cfg.dylu.by_for(cfg.method) == "time" and cfg.method == "diloco":
            raise UserError(
                "dylu.by (--dylu-by) time with --method diloco runs in the simulator and under torchrun; "
                "the parameter server plans sync rounds of H_w steps: use --dylu-by steps with diloco serve."
            )
        if not cfg.checkpoint_every:
            raise UserError(
                "checkpoint_every (--checkpoint-every) must be at least 1 for the parameter server: its "
                "write-ahead log is cut at every checkpoint, and --resume starts from one."
            )
        settings.in_range(cfg, "round_timeout_s", lo=0.0)
        settings.in_range(cfg, "worker_timeout_s", lo=0.0, lo_open=True)
        settings.in_range(cfg, "max_update_norm_ratio", lo=0.0)
        settings.at_least(cfg, "max_inflight_pushes", minimum=0)
        settings.at_least(cfg, "max_inflight_downloads", minimum=1)
        settings.at_least(cfg, "max_staleness", minimum=0)
        if cfg.max_staleness and cfg.method != "async":
            raise UserError(
                "max_staleness (--max-staleness) limits how stale an async push may be; a sync round's "
                "outer_grads are never stale: drop it or use --method async."
            )
        if 0 < cfg.max_update_norm_ratio <= 1:
            raise UserError(
                f"max_update_norm_ratio (--max-update-norm-ratio) is {cfg.max_update_norm_ratio:g}, which "
                "would refuse a typical update; give a number above 1 (10 in docs/server.md) or 0 for off."
            )
    _validate_communication(cfg)
    _validate_sim(cfg)
    _validate_async(cfg)
    _validate_dylu(cfg)
    settings.check_needs(cfg, {ON_SERVER: "diloco serve (docs/server.md)"})


def _validate_communication(cfg: Any) -> None:
    settings.in_range(cfg, "topk_fraction", lo=0.0, hi=1.0, lo_open=True)
    settings.at_least(cfg, "topk_chunk", minimum=0)
    if cfg.topk_bits not in TOPK_BITS:
        raise UserError(
            f"topk_bits (--topk-bits) must be one of {', '.join(map(str, TOPK_BITS))}, got {cfg.topk_bits}."
        )
    if cfg.error_feedback and cfg.method in ("single", "dp"):
        raise UserError(
            f"error_feedback (--error-feedback) needs outer_grads; --method {cfg.method} sends none."
        )
    settings.in_range(cfg, "ef_decay", lo=0.0, hi=1.0, lo_open=True)
    if cfg.outer.opt == "sparseloco":
        if cfg.method != "diloco":
            raise UserError(
                f"--outer-opt sparseloco is a synchronous DiLoCo method (its averaged step needs every "
                f"worker's message of the round); use --method diloco, not {cfg.method}."
            )
        if cfg.codec != "topk" or not cfg.error_feedback:
            raise UserError(
                "--outer-opt sparseloco sends each worker's top-k of its error-feedback accumulator: "
                f"it needs --codec topk with --error-feedback, got --codec {cfg.codec}"
                + ("" if cfg.error_feedback else " without --error-feedback")
                + "; drop those flags to take its defaults."
            )
    for key in ("codec", "download_codec"):
        if settings.changed(cfg, key) and cfg.method in ("single", "dp"):
            raise UserError(
                f"{_label(cfg, key)} encodes DiLoCo's messages; --method {cfg.method} sends none of them: "
                "drop it."
            )
    settings.at_least(cfg, "fragments", minimum=1)
    settings.at_least(cfg, "overlap_steps", minimum=0)
    settings.in_range(cfg, "mix_alpha", lo=0.0, hi=1.0, hi_open=True)  # 1: workers never see θ
    if not cfg.streaming.on:
        return
    P = cfg.fragments
    if P > cfg.model.n_layer and not cfg.model.hf_config:  # a Hugging Face model's blocks: at build
        raise UserError(
            f"fragments (--fragments) is {P} but the model has {cfg.model.n_layer} blocks to split; "
            f"use at most {cfg.model.n_layer}."
        )
    cfg.streaming.build()  # P <= H and τ < H / P: core.streaming.Schedule's check and message
    for key, why in SIMULATED_FAULTS:
        if settings.changed(cfg, key):
            raise UserError(
                f"Streaming DiLoCo (--fragments, --overlap-steps) does not simulate {why}: "
                f"drop {_label(cfg, key)}."
            )
    if cfg.on_nonfinite != "stop":
        raise UserError(
            "Streaming DiLoCo (--fragments, --overlap-steps) stops on a non-finite outer_grad: use "
            "--on-nonfinite stop."
        )
    if cfg.runtime == "server" and cfg.max_update_norm_ratio:
        raise UserError(
            "max_update_norm_ratio (--max-update-norm-ratio) compares whole outer_grads, and with "
            "Streaming DiLoCo (--fragments, --overlap-steps) the server takes them fragment by fragment: "
            "drop one of them."
        )


def _validate_sim(cfg: Any) -> None:
    s = cfg.sim
    settings.check(
        all(math.isfinite(v) and v > 0 for v in s.speeds),
        _label(cfg, "sim.speeds"),
        s.speeds,
        "a list of positive seconds per inner step, one per worker",
    )
    if s.speeds and len(s.speeds) != cfg.num_workers:
        raise UserError(
            f"sim.speeds (--speeds) gives {len(s.speeds)} speeds for {cfg.num_workers} workers; "
            "give one per worker."
        )
    settings.in_range(cfg, "sim.speed_jitter", lo=0.0, hi=0.99)
    settings.in_range(cfg, "sim.bandwidth_mbps", lo=0.0)
    settings.in_range(cfg, "sim.latency_ms", lo=0.0)
    settings.at_least(cfg, "sim.procs", minimum=0)
    for text in s.slowdowns:
        try:
            d = parse_slowdown(text)
            ok = 0 <= d.worker < cfg.num_workers and math.isfinite(d.factor) and d.factor > 0
            # END may be inf: slower from START to the end of the run
            ok = ok and math.isfinite(d.start_s) and 0 <= d.start_s < d.end_s
        except (ValueError, TypeError, AttributeError):
            ok = False
        want = "W:FACTOR@START-END with a valid worker, a finite FACTOR > 0 and START < END, e.g. 2:4@100-200"
        settings.check(ok, _label(cfg, "sim.slowdowns"), text, want)


def _validate_data(cfg: Any) -> None:
    d = cfg.data
    if not d.paths:
        for key in ("data.text_field", "data.source_field", "data.val_data"):
            if settings.changed(cfg, key):
                raise UserError(
                    f"{_label(cfg, key)} applies to your own text only; add --data PATH or drop it."
                )
    elif d.shards == "genre":
        raise UserError(
            "genre shards are the bundled corpus's genres; with --data use --shards by-source "
            "(each file, or each value of --source-field, a source)."
        )
    settings.in_range(cfg, "data.tune_fraction", lo=0.0, hi=0.5, hi_open=True)
    if d.eval_on == "tune" and not d.tune_fraction:
        raise UserError("--eval-on tune scores the tuning split, which needs --tune-fraction above 0.")
    if d.val_data and settings.changed(cfg, "data.val_fraction"):
        raise UserError("--val-data and --val-fraction both choose the validation text; give one of them.")
    for key in ("data.paths", "data.val_data"):
        if any(not p for p in settings.get(cfg, key)):
            raise UserError(f"{_label(cfg, key)} has an empty path; give the files or folders of your text.")
    parse_spec(d.tokenizer)  # bpe:N with a bad N is refused here
    if cfg.model.hf_config:  # diloco's GPT settings would be ignored
        gpt = [f"model.{k}" for k in ("name", "vocab_size", "n_layer", "n_head", "d_model")]
        if changed := [k for k in gpt if settings.changed(cfg, k)]:
            raise UserError(
                f"{_label(cfg, changed[0])} is a setting of diloco's GPT, and --model-config chooses another "
                "model; drop it (set sizes in the model config)."
            )
    if d.source_field and d.shards != "by-source":
        raise UserError(
            f"{_label(cfg, 'data.source_field')} names the sources of --shards by-source; "
            "add that or drop it."
        )


def _validate_dylu(cfg: Any) -> None:
    """DyLU's settings apply only while it is on; sync DiLoCo with DyLU (--method diloco --dylu)
    syncs whole rounds, which Streaming DiLoCo's fixed fragment steps cannot."""
    if cfg.method not in ("async", "diloco"):
        return  # check_needs names the method
    on = cfg.dylu.on(cfg.method)
    for path in ("dylu.by", "dylu.alpha", "dylu.oracle"):
        if settings.changed(cfg, path) and not on:
            raise UserError(
                f"{_label(cfg, path)} applies only with dynamic local updates on (this run has them off); "
                "add --dylu or drop it."
            )
    if on and cfg.method == "diloco" and (cfg.fragments > 1 or cfg.overlap_steps > 0):
        raise UserError(
            "dylu.enabled (--dylu) gives each worker its own number of inner steps, but Streaming DiLoCo "
            "(--fragments, --overlap-steps) syncs fragments at fixed steps; drop one of them."
        )
    if (
        on
        and cfg.dylu.by_for(cfg.method) == "time"
        and cfg.runtime == "collective"
        and cfg.procs_per_worker > 1
    ):
        raise UserError(
            "dylu.by (--dylu-by) time lets each rank stop at its own deadline, but the ranks of a worker "
            "(--procs-per-worker > 1) must take the same steps; use --dylu-by steps."
        )
    if on and cfg.method == "diloco" and cfg.workers_schedule:
        raise UserError(
            "workers_schedule (--workers-schedule) is given in rounds, and with --dylu the number of "
            "rounds depends on the speeds measured as the run goes; drop one of them."
        )


def _validate_async(cfg: Any) -> None:
    v = cfg.async_
    settings.at_least(cfg, "async.buffer", minimum=0)
    settings.in_range(cfg, "async.dn_c", lo=0.0, hi=1.0 / (v.buffer or cfg.num_workers))
    settings.at_least(cfg, "async.poly_threshold", minimum=0)
    settings.in_range(cfg, "async.delaycomp_lambda", lo=0.0)
    settings.in_range(cfg, "dylu.alpha", lo=0.0, hi=1.0, lo_open=True)
    g = v.grace_s
    ok = g in ("auto", "measured", "inf") if isinstance(g, str) else not math.isnan(g) and g >= 0
    settings.check(
        ok, _label(cfg, "async.grace_s"), g, "auto, measured or a number of seconds >= 0 (inf: wait for all)"
    )
    if g == "measured" and cfg.runtime == "server":
        raise UserError(
            f"{_label(cfg, 'async.grace_s')} measured is simulated only so far; on the parameter server "
            "use auto or a number of seconds."
        )
