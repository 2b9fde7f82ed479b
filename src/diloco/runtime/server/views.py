"""What the parameter server shows of its state: summary.json's per-worker rows and the status
page's view (`/status`, `/`, `/metrics`, status.py). A part of `ServerState` (state.py).

    python -m pytest tests/integration/test_status_page.py
"""

from __future__ import annotations

import time
from typing import Any


class Views:
    """`ServerState`'s views (see the module docstring)."""

    def summary(self) -> dict[str, Any]:
        """summary.json's per-worker rows and the events count. Lock held."""
        now, c = time.time(), self.coord
        rows = []
        for w, tot in enumerate(c.totals):
            present_s = tot["present_s"] + (now - c.workers[w]["joined_t"] if w in c.workers else 0.0)
            compute_s, present_s = round(tot["compute_s"], 3), round(present_s, 3)
            train_s = round(tot.get("train_s", 0.0), 3)
            rows.append(
                {
                    "worker": w,
                    "ranks": tot.get("ranks", 1),  # its processes (a torchrun group: data parallel)
                    "jobs": tot["jobs"],
                    "inner_steps": self.side.worker_steps[w],  # as summary.json's inner_steps_per_worker
                    "compute_s": compute_s,
                    "present_s": present_s,  # registered
                    "train_s": train_s,  # its first job's compute, then first push to last push
                    "compute_utilisation": round(compute_s / train_s, 4) if train_s > 0 else None,
                    "mean_staleness": tot["staleness"] / tot["jobs"] if tot["jobs"] and not c.sync else None,
                    "step_s": c.workers[w]["step_s"] if w in c.workers else tot["step_s"],
                    "wire_bytes_sent": self._wire[w]["sent"],
                    "wire_bytes_received": self._wire[w]["received"],
                }
            )
        # --max-inflight-pushes: its limit, the most received at once, how many waited (slots.py);
        # --max-inflight-downloads: its limit, the most θ versions held at once (async)
        slots = {"push_slots": self.push_slots.figures(), "downloads": dict(self.downloads)}
        return {"workers": rows, "events": c.seq, **slots}

    def status(self) -> dict[str, Any]:
        """The run at a glance, for the status page (`/status`, `/`, `/metrics`)."""
        with self.cond:
            c, now, mono = self.coord, time.time(), time.monotonic()
            done = sum(t["steps"] for t in c.totals)
            elapsed = now - self.t0
            rate = (done - self._steps_at_start) / elapsed if elapsed > 0 else 0.0
            workers = []
            for w, tot in enumerate(c.totals):
                rec = c.workers.get(w)
                if rec is None and not tot["jobs"]:
                    continue
                job = c.jobs.get(rec["job"]) if rec and rec["job"] is not None else None
                waiting = any(j.worker == w for _, _, j in c.arrived) or (c.sync and w in c.inbox)
                state = "gone" if rec is None else "working" if job else "pushed" if waiting else "idle"
                seen = self._last_seen.get(w)
                workers.append(
                    {
                        "worker": w,
                        "host": rec["name"] if rec else None,
                        "device": rec["device"] if rec else None,
                        "ranks": tot.get("ranks", 1),
                        "state": state,
                        "step_s": rec["step_s"] if rec else tot["step_s"],
                        "steps": job.steps if job else tot.get("last_steps"),
                        "staleness": tot.get("last_staleness"),
                        "jobs": tot["jobs"],
                        "inner_steps": tot["steps"],
                        "bytes_sent": self._wire[w]["sent"],
                        "bytes_received": self._wire[w]["received"],
                        "last_seen_s": None if seen is None else round(mono - seen, 1),
                    }
                )
            return {
                "run_dir": str(self.run_dir),
                "run_id": self.run_id,
                "method": self.cfg.method,
                "rule": self.cfg.async_.rule if not c.sync else self.cfg.outer.opt,
                "k": self.cfg.num_workers,
                "H": self.cfg.inner_steps,
                "version": self.side.version,
                "inner_steps": done,
                "inner_step_budget": c.step_budget,
                "eta_s": round((c.step_budget - done) / rate, 1) if rate > 0 and not c.finished else None,
                "elapsed_s": round(elapsed, 1),
                "finished": c.finished,
                "tls": self.opts.tls_cert is not None,
                "auth": self.token is not None,
                "workers": workers,
                "rejected": dict(c.rejected),
                "recent_rejected": list(self._recent_rejected),
                "unauthenticated": self.refusals.count,
                "push_seconds": sorted(self._push_seconds),
                "push_slots": self.push_slots.figures(),
                "downloads": dict(self.downloads),
            }

    # -- checkpoints ---------------------------------------------------------------------------
