"""Checkpoints of the asynchronous simulator (async_sim.py): the server's whole state between
grace groups, with the results of the jobs in flight, so a resumed run is the same run.

    python -m pytest tests/integration/test_resume.py -k async
"""

from __future__ import annotations

import heapq
from typing import Any

from diloco.core.async_policy import ArrivalScatter
from diloco.core.inner import InnerResult
from diloco.errors import UserError


class AsyncCheckpoint:
    """`AsyncDiLoCo.state_dict` and `load_state_dict` (the attributes are async_sim.py's)."""

    def state_dict(self) -> dict[str, Any]:
        if not self.at_boundary:
            raise RuntimeError("AsyncDiLoCo.state_dict in the middle of a grace group; save at_boundary")
        for w in list(self._inflight):  # results first: the pools hold no job in flight after this
            if w not in self._ready:
                self._ready[w] = self.pool.result(w)
        inflight = [
            {
                **{k: v for k, v in job.items() if k != "pulled"},
                "worker": w,
                "pulled": job["pulled"] if job["pulled"] is not None else [],
                "result": self._ready[w].state_dict(),
            }
            for w, job in sorted(self._inflight.items())
        ]
        version, internal, gauss = self.rng.getstate()
        return {
            "outer": self.side.state_dict(),
            "workers": self.pool.state_dict(),
            "runtime": {
                "async": {
                    "sim_time_s": self._sim_time_s,
                    "dispatched": self.dispatched,
                    "applied": self.applied,
                    "busy_s": list(self.busy_s),
                    "started": self._started,
                    "jobs": list(self._jobs),
                    "heap": [list(e) for e in self._heap],
                    "inflight": inflight,
                    "speed_estimates": [e.step_s for e in self.estimators],
                    "probes": [
                        list(self._probes[w]) if w in self._probes else None
                        for w in range(len(self.estimators))
                    ],
                    "shard_steps": list(self.shard_steps),
                    "rng": [version, list(internal), gauss],
                    "scatter": list(self.scatter.residuals),
                    "waiting": list(self._waiting),
                }
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "async" not in state.get("runtime", {}):
            raise ValueError("this checkpoint is not from an asynchronous run (--method async)")
        a = state["runtime"]["async"]
        if "probes" not in a:
            raise UserError(
                "this asynchronous checkpoint was written by an older diloco, before first jobs probed "
                "their speed; resume it with the diloco that wrote it, or start the run again."
            )
        self.side.load_state_dict(state["outer"])
        self.pool.load_state_dict(state["workers"])
        self._sim_time_s = float(a["sim_time_s"])
        self.dispatched, self.applied = int(a["dispatched"]), int(a["applied"])
        self.busy_s = [float(x) for x in a.get("busy_s", self.busy_s)]
        self._started = bool(a["started"])
        self._jobs = [int(j) for j in a["jobs"]]
        self._heap = [(float(t), int(i), int(w)) for t, i, w in a["heap"]]
        heapq.heapify(self._heap)
        self._inflight, self._ready = {}, {}
        for job in a["inflight"]:
            w = int(job["worker"])
            self._ready[w] = InnerResult.from_state(job["result"])
            self._inflight[w] = {
                "steps": int(job["steps"]),
                "started_s": float(job["started_s"]),
                "compute_s": float(job["compute_s"]),
                "version": int(job["version"]),
                "pulled": [t.clone() for t in job["pulled"]] if job["pulled"] else None,
                "shard": int(job["shard"]),
                "seconds": None if job.get("seconds") is None else float(job["seconds"]),
                "expected": job.get("expected"),
                # a deadline job's reservation and cap (older checkpoints: none)
                "reserved": int(job.get("reserved", job["steps"])),
                "cap": None if job.get("cap") is None else int(job["cap"]),
            }
        self._probes = {w: (float(p[0]), float(p[1])) for w, p in enumerate(a["probes"]) if p is not None}
        for e, step_s in zip(self.estimators, a["speed_estimates"], strict=True):
            e.step_s = None if step_s is None else float(step_s)
        self.shard_steps = [int(n) for n in a["shard_steps"]]
        self.scatter = ArrivalScatter(float(r) for r in a.get("scatter", []))
        self._waiting = [int(w) for w in a.get("waiting", [])]
        version, internal, gauss = a["rng"]
        self.rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
