"""Server rules for asynchronous Local-SGD (docs/method.md §2): how an outer_grad that arrives
on its own, possibly stale, changes the global parameters.

Every rule works in place on the server's parameters and returns whether they changed (a new
`version`). Rules are pure PyTorch; the simulator and the parameter server share them.

- `naive`: an outer Nesterov step on every arrival (momentum decays too fast, steps amplify).
- `dn`: Delayed Nesterov, Algorithm 3 of the paper: momentum updated every N arrivals from their
  sum, plain SGD steps of ε g/N (+ c β m) in between.
- `buffer`: average N arrivals, then one Nesterov step (FedBuff-like).
- `poly`: g / sqrt(1 + staleness), then Nesterov. `polythres`: poly, dropping updates with
  staleness above a threshold (default 10).
- `delaycomp`: g + λ g ⊙ g ⊙ (θ_now − θ_pulled), then Nesterov.

    python -m pytest tests/unit/test_async_rules.py
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from diloco.core.outer import Nesterov, Tensors, weighted_average

ASYNC_RULES = ("dn", "naive", "buffer", "poly", "polythres", "delaycomp")


class AsyncRule:
    """Applies one arriving outer_grad to the server's parameters."""

    def apply(
        self,
        params: Tensors,
        grad: Tensors,
        *,
        worker: int,
        staleness: int,
        pulled: Tensors | None = None,
        group_end: bool = True,
    ) -> bool:
        """Apply `grad`; `group_end`: whether it is the last of a grace group (or stands alone)."""
        raise NotImplementedError

    def apply_parts(self, params: Tensors, parts: Iterable[Tensors], **kwargs) -> bool:
        """`apply` with the outer_grad given as consecutive groups of its tensors, so a caller
        need not hold all of it decoded. Rules that use it whole join the parts; `dn` (the
        default) applies each group as it comes, the same bits as `apply`."""
        return self.apply(params, [t for part in parts for t in part], **kwargs)

    def flush(self, params: Tensors) -> bool:
        """Apply whatever the rule still holds back when training ends; True if θ changed."""
        return False

    def prepare(self, params: Tensors) -> None:
        """Allocate the rule's state now rather than at the first arrival (the parameter server
        does, so its memory at rest is what it needs)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class _NesterovRule(AsyncRule):
    """A rule that transforms the arriving outer_grad (or drops it), then steps Nesterov."""

    def __init__(self, lr: float, momentum: float):
        self.opt = Nesterov(lr, momentum)

    def transform(self, grad: Tensors, staleness: int, params: Tensors, pulled: Tensors | None):
        return grad

    def apply(self, params, grad, *, worker, staleness, pulled=None, group_end=True) -> bool:
        grad = self.transform(grad, staleness, params, pulled)
        if grad is None:
            return False
        self.opt.step(params, grad)
        return True

    def state_dict(self) -> dict:
        return {"opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["opt"])


class Naive(_NesterovRule):
    pass


class Poly(_NesterovRule):
    def __init__(self, lr: float, momentum: float, *, threshold: int | None = None):
        super().__init__(lr, momentum)
        self.threshold = threshold

    def transform(self, grad, staleness, params, pulled):
        if self.threshold is not None and staleness > self.threshold:
            return None
        scale = 1.0 / math.sqrt(1.0 + staleness)
        return [g * scale for g in grad]


class DelayComp(_NesterovRule):
    def __init__(self, lr: float, momentum: float, *, lam: float):
        super().__init__(lr, momentum)
        self.lam = lam

    def transform(self, grad, staleness, params, pulled):
        if pulled is None:
            raise ValueError("delaycomp needs the parameters the worker pulled")
        return [g + self.lam * g * g * (p - q) for g, p, q in zip(grad, params, pulled, strict=True)]


class Buffer(AsyncRule):
    """Keep N arrivals; then one Nesterov step on their mean, summed in worker order so that with
    N = k and every worker in the buffer it is exactly the synchronous DiLoCo update."""

    def __init__(self, lr: float, momentum: float, *, size: int):
        self.opt = Nesterov(lr, momentum)
        self.size = size
        self.pending: list[tuple[int, Tensors]] = []

    def apply(self, params, grad, *, worker, staleness, pulled=None, group_end=True) -> bool:
        self.pending.append((worker, [g.clone() for g in grad]))
        if len(self.pending) < self.size:
            return False
        return self.flush(params)

    def flush(self, params: Tensors) -> bool:
        """One Nesterov step on the mean of the arrivals held (all N, or the last few at the end)."""
        if not self.pending:
            return False
        arrivals = sorted(self.pending, key=lambda a: a[0])
        self.pending = []
        n = len(arrivals)
        self.opt.step(params, weighted_average([g for _, g in arrivals], [1.0 / n] * n))
        return True

    def state_dict(self) -> dict:
        return {"opt": self.opt.state_dict(), "pending": [[w, g] for w, g in self.pending]}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["opt"])
        self.pending = [(int(w), [t.clone() for t in g]) for w, g in state["pending"]]


class DelayedNesterov(AsyncRule):
    """Algorithm 3 (DN), buffer size N, c ∈ [0, 1/N]; state t, m, Δ start at 0; n counts the
    arrivals in Δ.

    Δ ← Δ + g;  n ← n + 1
    if (t + 1) mod N == 0:  m ← βm + Δ/n;  θ ← θ − ε[(1 − cN + c) β m + g/N];  Δ ← 0, n ← 0
    else:                   θ ← θ − ε[c β m + g/N]
    t ← t + 1

    (n = N at every momentum step, so this is the paper's Δ/N.) With `at_group_end` (async's
    jobs as deadlines, docs/async.md) the momentum step comes instead at the last arrival of a
    grace group once n ≥ N: whole groups of N = k are then sync DiLoCo's Nesterov rounds however
    the arrivals before them fell (probes landing apart would otherwise put the step inside
    every later group); arrivals that each stand alone (no grace period) give the paper's rule.
    """

    def __init__(self, lr: float, momentum: float, *, size: int, c: float = 0.0, at_group_end: bool = False):
        if size < 1 or not 0 <= c <= 1 / size:
            raise ValueError(f"dn needs buffer size >= 1 and 0 <= c <= 1/N, got N={size}, c={c}")
        self.lr, self.momentum, self.size, self.c = lr, momentum, size, c
        self.at_group_end = at_group_end
        self.t = self.count = 0
        self.m: Tensors | None = None
        self.delta: Tensors | None = None

    def prepare(self, params: Tensors) -> None:
        if self.m is None:
            self.m = [torch.zeros_like(p) for p in params]
            self.delta = [torch.zeros_like(p) for p in params]

    def apply(self, params, grad, *, worker, staleness, pulled=None, group_end=True) -> bool:
        return self.apply_parts(params, [grad], group_end=group_end)

    @torch.no_grad()
    def apply_parts(self, params, parts, *, group_end=True, **_) -> bool:
        self.prepare(params)
        lr, beta, n, c = self.lr, self.momentum, self.size, self.c
        self.count += 1
        count = self.count
        step_now = (group_end and count >= n) if self.at_group_end else (self.t + 1) % n == 0
        coef = (1 - c * n + c) * beta if step_now else c * beta
        start = 0
        for grad in parts:  # every op is per tensor: group by group gives the same bits as whole
            at = slice(start, start + len(grad))
            start += len(grad)
            p, m, delta = params[at], self.m[at], self.delta[at]
            # in place, one fused pass per line over every tensor (torch._foreach_*): no
            # temporaries, the server applies 600 MB models with this
            if step_now and count == 1:  # Δ held nothing: Δ/1 is g exactly, skip Δ
                torch._foreach_mul_(m, beta)
                torch._foreach_add_(m, grad)
            else:
                torch._foreach_add_(delta, grad)
                if step_now:
                    torch._foreach_mul_(m, beta)
                    torch._foreach_add_(m, delta, alpha=1.0 / count)
                    torch._foreach_zero_(delta)
            torch._foreach_add_(p, grad, alpha=-lr / n)
            if coef:
                torch._foreach_add_(p, m, alpha=-lr * coef)
        if start != len(params):
            raise ValueError(f"an outer_grad of {start} tensors for {len(params)} parameters")
        if step_now:
            self.count = 0
        self.t += 1
        return True

    def state_dict(self) -> dict:
        state = {"t": self.t, "count": self.count}
        if self.m is not None:
            state.update(m=self.m, delta=self.delta)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.t = int(state["t"])
        self.count = int(state.get("count", self.t % self.size))  # older checkpoints: the paper's rule
        self.m = [t.clone() for t in state["m"]] if "m" in state else None
        self.delta = [t.clone() for t in state["delta"]] if "delta" in state else None


def build_async_rule(
    name: str,
    *,
    lr: float,
    momentum: float,
    num_workers: int,
    buffer: int = 0,
    c: float = 0.0,
    poly_threshold: int = 10,
    delaycomp_lambda: float = 0.5,
    at_group_end: bool = False,
) -> AsyncRule:
    """The rule `name`; `buffer` 0 means N = k (the natural default); `at_group_end`: DN's
    momentum step at the end of a grace group (DelayedNesterov)."""
    size = buffer or num_workers
    if name == "dn":
        return DelayedNesterov(lr, momentum, size=size, c=c, at_group_end=at_group_end)
    if name == "naive":
        return Naive(lr, momentum)
    if name == "buffer":
        return Buffer(lr, momentum, size=size)
    if name == "poly":
        return Poly(lr, momentum)
    if name == "polythres":
        return Poly(lr, momentum, threshold=poly_threshold)
    if name == "delaycomp":
        return DelayComp(lr, momentum, lam=delaycomp_lambda)
    raise ValueError(f"unknown async rule {name!r}; use one of {', '.join(ASYNC_RULES)}")
