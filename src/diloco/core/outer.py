"""Outer optimizers and outer_grad averaging (docs/method.md §1).

The averaged outer_grad Δ = Σ w_i Δ_i is used as a gradient on the global parameters θ:
- Nesterov (the paper's choice, lr 0.7, momentum 0.9), in the PyTorch form
  m ← βm + Δ;  θ ← θ − ε(Δ + βm);
- SGD with optional heavy-ball momentum (lr 1.0 without momentum is FedAvg: θ ← mean θ_i);
- Adam (FedOpt), which the paper found needs eps ≈ 0.1 to be stable.

All updates are in place on the given parameter tensors, in a fixed order, so every runtime
that applies the same Δ gets bit-identical parameters.

    python -m pytest tests/unit/test_outer.py
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

Tensors = list[torch.Tensor]
OUTER_OPTS = ("nesterov", "sgd", "adam", "sparseloco")  # --outer-opt (`build_outer_opt`)
# What `--outer-opt sparseloco` sends unless told otherwise (SparseLoCo, Sarfi et al. 2025:
# top-k per chunk of 4096 values in 2 bits, each worker's error-feedback accumulator decayed;
# config/load.py fills them in, config/sections.py names them in the flag's help)
SPARSELOCO_DEFAULTS = {
    "codec": "topk",
    "error_feedback": True,
    "topk_chunk": 4096,
    "topk_bits": 2,
    "ef_decay": 0.95,
}
OUTER_OPT_HELP = "outer optimizer; sparseloco also sets, where not given, " + ", ".join(
    f"{k} {str(v).lower()}" for k, v in SPARSELOCO_DEFAULTS.items()
)


def weighted_average(outer_grads: list[Tensors], weights: list[float]) -> Tensors:
    """Σ_i w_i Δ_i, summed in worker order (the order matters for bitwise reproducibility)."""
    if len(outer_grads) != len(weights):
        raise ValueError(f"{len(outer_grads)} outer_grads but {len(weights)} weights")
    out = [torch.zeros_like(t) for t in outer_grads[0]]
    for grads, w in zip(outer_grads, weights, strict=True):
        for acc, g in zip(out, grads, strict=True):
            acc.add_(g, alpha=w)
    return out


def kept_weights(weights: list[float], kept: list[bool]) -> list[float]:
    """The weights of the kept outer_grads of the first len(kept) workers: unchanged when every
    worker's is kept, else rescaled to sum to 1 (dropped or inactive workers take their weight
    with them). Every runtime uses this, so they agree bit for bit."""
    if len(kept) == len(weights) and all(kept):
        return list(weights)
    total = sum(w for w, k in zip(weights, kept, strict=False) if k)
    return [w / total for w, k in zip(weights, kept, strict=False) if k]


def sum_in_order(parts: Iterable[Iterable[torch.Tensor]], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Σ parts in the given (worker) order, on the first part, each part consumed tensor by
    tensor; zeros like `like` for none."""
    total: list[torch.Tensor] | None = None
    for part in parts:
        if total is None:
            total = list(part)
            continue
        for acc, t in zip(total, part, strict=True):
            acc.add_(t)
    return total if total is not None else [torch.zeros_like(t) for t in like]


def in_groups(tensors: Iterable[torch.Tensor], nbytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive groups of `tensors` of about `nbytes` each (a larger tensor alone)."""
    group: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        group.append(t)
        size += t.numel() * t.element_size()
        if size >= nbytes:
            yield group
            group, size = [], 0
    if group:
        yield group


def after_each(items: Iterable, done: Callable) -> Iterator:
    """`items`, calling done(item) once the consumer asks for the next (it is done with it)."""
    for item in items:
        yield item
        done(item)


class OuterOpt:
    """An optimizer on the global parameters whose gradient is the averaged outer_grad."""

    def step(self, params: Tensors, grads: Tensors) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class SGD(OuterOpt):
    """SGD with optional momentum, as torch.optim.SGD with dampening 0 and no weight decay.

    m ← βm + Δ (m starts at the first Δ, as in torch); the step is Δ + βm with Nesterov,
    m without, Δ without momentum.
    """

    def __init__(self, lr: float = 1.0, momentum: float = 0.0, *, nesterov: bool = False):
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError(f"outer SGD needs lr > 0 and 0 <= momentum < 1, got {lr}, {momentum}")
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.buf: Tensors | None = None

    @torch.no_grad()
    def step(self, params: Tensors, grads: Tensors) -> None:
        if self.momentum == 0:
            for p, g in zip(params, grads, strict=True):
                p.add_(g, alpha=-self.lr)
            return
        if self.buf is None:
            self.buf = [g.clone() for g in grads]
        else:
            for m, g in zip(self.buf, grads, strict=True):
                m.mul_(self.momentum).add_(g)
        for p, m, g in zip(params, self.buf, grads, strict=True):
            p.add_(g.add(m, alpha=self.momentum) if self.nesterov else m, alpha=-self.lr)

    def state_dict(self) -> dict:
        return {"buf": self.buf} if self.buf is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self.buf = [t.clone() for t in state["buf"]] if "buf" in state else None


class Nesterov(SGD):
    """The DiLoCo outer optimizer: SGD with Nesterov momentum (default lr 0.7, momentum 0.9)."""

    def __init__(self, lr: float = 0.7, momentum: float = 0.9):
        super().__init__(lr, momentum, nesterov=True)


class Adam(OuterOpt):
    """Adam on outer_grads (FedOpt), as torch.optim.Adam without weight decay."""

    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 0.1):
        self.lr, self.betas, self.eps = lr, betas, eps
        self.t = 0
        self.m: Tensors | None = None
        self.v: Tensors | None = None

    @torch.no_grad()
    def step(self, params: Tensors, grads: Tensors) -> None:
        b1, b2 = self.betas
        if self.m is None:
            self.m = [torch.zeros_like(g) for g in grads]
            self.v = [torch.zeros_like(g) for g in grads]
        self.t += 1
        c1, c2 = 1 - b1**self.t, 1 - b2**self.t
        for p, g, m, v in zip(params, grads, self.m, self.v, strict=True):
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / c2**0.5).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / c1)

    def state_dict(self) -> dict:
        if self.m is None:
            return {"t": self.t}
        return {"t": self.t, "m": self.m, "v": self.v}

    def load_state_dict(self, state: dict) -> None:
        self.t = int(state["t"])
        self.m = [t.clone() for t in state["m"]] if "m" in state else None
        self.v = [t.clone() for t in state["v"]] if "v" in state else None


class Fragmented(OuterOpt):
    """One outer optimizer per fragment of Streaming DiLoCo (streaming.py): fragment p's step
    updates its own parameters with its own state (momentum, Adam's moments and count)."""

    def __init__(self, parts: list[OuterOpt]):
        self.parts = parts

    def step(self, params: Tensors, grads: Tensors) -> None:
        raise TypeError("a Fragmented outer optimizer steps one fragment at a time: use step_part")

    def step_part(self, p: int, params: Tensors, grads: Tensors) -> None:
        self.parts[p].step(params, grads)

    def state_dict(self) -> dict:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        if len(state.get("parts", ())) != len(self.parts):
            raise ValueError(
                f"the checkpoint's outer optimizer has {len(state.get('parts', ()))} fragments, this run "
                f"{len(self.parts)}; resume with the same --fragments"
            )
        for part, s in zip(self.parts, state["parts"], strict=True):
            part.load_state_dict(s)


def build_outer_opt(
    name: str,
    *,
    lr: float,
    momentum: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 0.1,
) -> OuterOpt:
    """The outer optimizer `name` (one of OUTER_OPTS); `momentum` is nesterov's and sgd's,
    `betas` and `eps` adam's (diloco.config.OuterConfig.build passes a run's settings)."""
    if name == "nesterov":
        return Nesterov(lr, momentum)
    if name == "sgd":
        return SGD(lr, momentum)
    if name == "adam":
        return Adam(lr, betas, eps)
    if name == "sparseloco":  # θ ← θ − α · mean(m): the workers' decayed accumulators stand in for momentum
        return SGD(lr, 0.0)
    raise ValueError(f"unknown outer optimizer {name!r}; use one of {', '.join(OUTER_OPTS)}")
