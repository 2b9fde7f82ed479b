"""A run's shard plan: which units of its training text each worker's shard holds, recorded in
RUN_DIR/shards.json.

The plan is made once, by the process that starts the run (the simulator, rank 0 of a torchrun
job, the parameter server), written to the run directory and handed to everyone else: the
server sends it to each worker that registers, rank 0 broadcasts it, `--resume` and `diloco
replay` read it back. Nobody else makes their own, so every worker trains on the same shards even
where k-means (data.kmeans_groups) would come out otherwise on another machine.

Units are what a shard kind deals out (data.shard_units): 4,096-token blocks of the training
text (`iid`), ~4,096-token parts of documents (`kmeans`), documents (`genre`, `by-source`).

    python -c "from diloco.data.recipe import prepare_data; from diloco.config import TrainConfig; \
print(prepare_data(TrainConfig()).plan.digest)"
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from diloco.errors import UserError

SHARDS_FILE = "shards.json"


@dataclass(frozen=True)
class ShardPlan:
    kind: str  # --shards
    seed: int
    units: int  # how many units the training text makes: a plan fits only that text
    groups: tuple[tuple[int, ...], ...]  # each worker's units, in the order its shard reads them
    tokens: tuple[int, ...]  # each shard's tokens (checked against the text it is applied to)
    source: str = field(default="this run", compare=False)  # where it came from, for messages

    def _body(self) -> dict:
        fields = ("kind", "seed", "units", "groups", "tokens")
        return {name: getattr(self, name) for name in fields}

    @property
    def digest(self) -> str:
        """A hash of the plan (not of where it came from): equal plans, equal digests."""
        return hashlib.sha256(json.dumps(self._body(), separators=(",", ":")).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        """What shards.json holds and the server sends: the plan and its digest, a shard a line."""
        head = {**{k: v for k, v in self._body().items() if k != "groups"}, "digest": self.digest}
        lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
        groups = ",\n".join(f"    {json.dumps(list(g))}" for g in self.groups)
        return "{\n" + "\n".join(lines) + f'\n  "groups": [\n{groups}\n  ]\n}}\n'

    @classmethod
    def from_json(cls, text: str, source: str) -> ShardPlan:
        """The plan `to_json` wrote; `source` names where it came from. A damaged one (not such
        JSON, or its digest does not match) is a UserError."""
        try:
            saved = json.loads(text)
            plan = cls(
                str(saved["kind"]),
                int(saved["seed"]),
                int(saved["units"]),
                tuple(tuple(int(u) for u in g) for g in saved["groups"]),
                tuple(int(n) for n in saved["tokens"]),
                source,
            )
            ok = plan.digest == saved["digest"]
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise UserError(
                f"the shard plan of {source} is damaged (its digest does not match its shards); restore "
                "the run's shards.json from a copy, or start a new run."
            )
        return plan

    def check(self, kind: str, k: int, seed: int) -> None:
        """Refuse a plan made for other settings than the run's (--shards, --workers, --seed)."""
        if (self.kind, len(self.groups), self.seed) != (kind, k, seed):
            raise UserError(
                f"the shard plan of {self.source} is for {self.kind} shards of {len(self.groups)} workers "
                f"(seed {self.seed}), but the run has {kind} shards of {k} workers (seed {seed}); restore "
                "the run's own shards.json, or start a new run."
            )


def recorded_plan(run_dir: Path) -> ShardPlan | None:
    """The plan in `run_dir`, None where there is none (runs before this file: planned again)."""
    path = run_dir / SHARDS_FILE
    return ShardPlan.from_json(path.read_text(), str(path)) if path.is_file() else None
