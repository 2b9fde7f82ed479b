"""The parameter server's coordinator saved in and restored from a checkpoint: everything but θ
and the outer update (the outer side's own state_dict holds those). `Coordinator.state_dict` and
`load_state_dict` are these.

    python -m pytest tests/integration/test_server.py -k resumed
"""

from __future__ import annotations

from collections import deque
from typing import Any

from diloco.core.codec import Encoded
from diloco.runtime.server.jobs import Job, job_state


def save(self: Any) -> dict[str, Any]:
    """Everything but θ and the outer update (the side's own state_dict holds those). Sync
    runs are saved between rounds (the log holds a round in progress)."""
    if self.members:
        raise RuntimeError("a sync server is checkpointed between rounds, not during one")
    jobs = [*self.jobs.values(), *(job for _, _, job in self.arrived)]
    versions = {job.version: job.pulled for job in jobs if job.pulled is not None}  # async: let go
    return {
        "seq": self.seq,
        "workers": {str(w): dict(rec) for w, rec in self.workers.items()},
        "jobs": [job_state(j) for j in self.jobs.values()],
        "pulled": {str(v): list(p) for v, p in versions.items()},
        "pushed": sorted(self.pushed.items()),
        "norms": list(self.norms),
        "rejected": dict(self.rejected),
        "late": sorted(self.late),
        "next_job": self.next_job,
        "shard_steps": list(self.shard_steps),
        "dispatched": self.dispatched,
        "applied": self.applied,
        "members": list(self.members),
        "inbox": {str(w): [push, m.state_dict()] for w, (push, m) in self.inbox.items()},
        "arrived": [[push, m.state_dict(), job_state(job)] for push, m, job in self.arrived],
        "flushed": self.flushed,
        "totals": [dict(t) for t in self.totals],
        "fragment_round": list(self.fragment_round),  # streaming (fragments.py)
        **({"dylu": self.planner.state_dict()} if self.planner is not None else {}),
    }


def load(self: Any, s: dict[str, Any]) -> None:
    pulled = {int(v): self.stored_pulls(list(p)) for v, p in s["pulled"].items()}

    def job(state):
        state = {"position": state["lr_step"], **state}  # checkpoints of protocol 2: one number
        return Job(**state, pulled=pulled.get(state["version"]))  # None: asked for again, regiven

    self.seq = int(s["seq"])
    self.workers = {int(w): dict(rec) for w, rec in s["workers"].items()}
    self.jobs = {j["job"]: job(j) for j in s["jobs"]}
    self.pushed = {int(j): int(w) for j, w in s["pushed"]}
    self.norms = deque(s["norms"], maxlen=self.norms.maxlen)
    self.rejected = dict(s["rejected"])
    self.late = set(s["late"])
    self.next_job = int(s["next_job"])
    self.shard_steps = [int(n) for n in s["shard_steps"]]
    self.dispatched, self.applied = int(s["dispatched"]), int(s["applied"])
    self.members = [int(w) for w in s["members"]]
    self.inbox = {int(w): (push, Encoded.from_state(m)) for w, (push, m) in s["inbox"].items()}
    self.arrived = [(push, Encoded.from_state(m), job(j)) for push, m, j in s["arrived"]]
    self.flushed = bool(s["flushed"])
    self.totals = [dict(t) for t in s["totals"]]
    self.fragment_round = [int(r) for r in s.get("fragment_round", self.fragment_round)]
    if self.planner is not None and "dylu" in s:
        self.planner.load_state_dict(s["dylu"])
