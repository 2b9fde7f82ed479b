"""`diloco plan` against real runs (issue 34): each configuration is planned, then run for real on
the shaped links of benchmarks/wan.py, and the prediction is compared with what the run measured.

The machines are emulated so that the planner can be told them: every inner step is padded to
STEP_S seconds (torchrun: `--speeds`; a server's worker: `diloco worker --step-s`, times its
`--slowdown`), and every link is a token bucket of LINK_MBPS (wan.py: a veth pair per worker,
both ends shaped). The planner gets the same settings, those step times, and the link rate as
a TCP transfer measured it on the shaped link (latency 0: a veth). Rows:

- torchrun (2 ranks, `diloco plan --runtime collective`): fp32; fp4 with error feedback;
  Streaming DiLoCo with 4 fragments and one overlapped step;
- the server (sync, 2 workers): fp32; fp4 with a bf16 download; a worker 2× slower; a worker
  slowed 2× for a window of its run (its jitter: `--slowdown 2@A-B`, planned as the simulator's
  `--slowdown 1:2@...` shifted by the first download) beside one that is not;
- the server, async, DN + DyLU (the default) and naive with fixed H, workers 1× and 2.5×.

Measured: the training's wall time (sync: the rounds' wall times summed, summary.json's
compute_s + comm_s; async: the longest worker's `train_s`, its first job's compute then its
first push to its last, which the plan predicts in the same terms), the compute utilisation
(summary.json's; the plan's is counted the same way), the bytes the run counted (sent and
received, summed).
Reported per row: `predicted_wall_s`, `measured_wall_s`, `wall_error` (predicted ÷ measured − 1),
the utilisations, `bytes_exact`; `worst_wall_error`. Targets: |wall_error| ≤ 10%, bytes exact,
utilisation within 0.05. A figure: docs/figures/plan_vs_real.png.

Needs root, `ip` and `tc` (as wan.py). The machine to itself: ~8 minutes.

    python benchmarks/plan_vs_real.py           # writes benchmarks/results/plan_vs_real.json
    python benchmarks/plan_vs_real.py --rows server_fp32,collective_fp32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import wan

RESULTS = Path(__file__).parent / "results"
FIGURE = Path(__file__).parent.parent / "docs" / "figures" / "plan_vs_real.png"
STEP_S, H, ROUNDS, LINK_MBPS = 0.2, 10, 5, 16.0
RUN = ["--inner-steps", str(H), "--rounds", str(ROUNDS), "--eval-every", str(H * ROUNDS)]
JITTER = (2.0, 3.0, 8.0)  # worker 2 is 2x slower from 3 s to 8 s after its first inner step

# name -> (kind, settings flags, each worker's slowdown)
ROWS: dict[str, tuple[str, list[str], tuple[float, ...]]] = {
    "collective_fp32": ("collective", ["--codec", "fp32"], (1.0, 1.0)),
    "collective_fp4": ("collective", ["--codec", "fp4", "--error-feedback"], (1.0, 1.0)),
    "collective_streaming": ("collective", ["--fragments", "4", "--overlap-steps", "1"], (1.0, 1.0)),
    "server_fp32": ("server", ["--codec", "fp32"], (1.0, 1.0)),
    "server_fp4": ("server", ["--codec", "fp4", "--error-feedback", "--download-codec", "bf16"], (1.0, 1.0)),
    "server_slow_worker": ("server", ["--codec", "fp32"], (1.0, 2.0)),
    "server_jittered_worker": ("server", ["--codec", "fp32"], (1.0, JITTER[0])),
    "server_async_dn_dylu": ("server", ["--method", "async"], (1.0, 2.5)),
    "server_async_naive": (
        "server",
        ["--method", "async", "--async-rule", "naive", "--no-dylu", "--grace-s", "0"],
        (1.0, 2.5),
    ),
}


def _plan(name: str, flags: list[str], slow: tuple[float, ...], link_mbps: float, pull_s: float) -> dict:
    kind = ROWS[name][0]
    step = ",".join(f"{STEP_S * f:g}" for f in slow)
    cmd = [sys.executable, "-m", "diloco", "plan", "--workers", "2", *RUN, *flags, "--json"]
    cmd += ["--step-s", step, "--link-mbps", f"{link_mbps:.6g}", "--rounds-simulated", str(ROUNDS)]
    if kind == "collective":
        cmd += ["--runtime", "collective"]
    if name == "server_jittered_worker":  # its window, from the worker's first step (after its pull)
        factor, start, end = JITTER
        cmd[cmd.index("--step-s") + 1] = f"{STEP_S:g},{STEP_S:g}"
        cmd += ["--slowdown", f"1:{factor:g}@{start + pull_s:.4f}-{end + pull_s:.4f}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"diloco plan failed for {name}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def _run(name: str, link, star, root: Path, port: int) -> dict:
    kind, flags, slow = ROWS[name]
    if kind == "collective":
        speeds = ["--speeds", ",".join(f"{STEP_S * f:g}" for f in slow)]
        return wan.run_config(link, [*RUN, *flags, *speeds], run_dir=root / name, port=port, timeout_s=600)
    worker_flags = []
    for f in slow:
        w = ["--step-s", f"{STEP_S:g}"]
        if name == "server_jittered_worker" and f != 1.0:
            w += ["--slowdown", f"{JITTER[0]:g}@{JITTER[1]:g}-{JITTER[2]:g}"]
        elif f != 1.0:
            w += ["--slowdown", f"{f:g}"]
        worker_flags.append(w)
    serve = ["--workers", "2", *RUN, "--checkpoint-every", str(ROUNDS), *flags]
    if "async" not in flags:
        serve = ["--method", "diloco", *serve]
    return wan.run_server_config(
        star, serve, run_dir=root / name, port=port, timeout_s=600, worker_flags=worker_flags
    )


def _measured_wall(row: dict, asynchronous: bool) -> float:
    if asynchronous:
        return max(t for t in row["workers_train_s"] if t is not None)
    return row["compute_s"] + row["comm_s"]


def compare(name: str, plan: dict, real: dict) -> dict:
    asynchronous = "--method" in ROWS[name][1] and "async" in ROWS[name][1]
    if "error" in real:
        return {"name": name, "error": real["error"]}
    measured = _measured_wall(real, asynchronous)
    predicted = max(plan["train_s"]) if asynchronous else plan["wall_time_s"]
    sent = sum(plan["bytes_per_worker"]["sent"])
    received = sum(plan["bytes_per_worker"]["received"])
    return {
        "name": name,
        "predicted_wall_s": round(predicted, 3),
        "measured_wall_s": round(measured, 3),
        "wall_error": round(predicted / measured - 1, 4),
        "predicted_utilisation": round(plan["utilisation"]["mean"], 4),
        "measured_utilisation": real.get("compute_utilisation"),
        "predicted_bytes": [sent, received],
        "measured_bytes": [real.get("bytes_sent"), real.get("bytes_received")],
        "bytes_exact": [sent, received] == [real.get("bytes_sent"), real.get("bytes_received")],
    }


def figure(configs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [c for c in configs if "error" not in c]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = range(len(ok))
    ax.bar([i - 0.2 for i in x], [c["measured_wall_s"] for c in ok], width=0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [c["predicted_wall_s"] for c in ok], width=0.4, label="diloco plan")
    ax.set_xticks(list(x), [c["name"] for c in ok], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("training wall time (s)")
    ax.set_title("diloco plan vs real runs on shaped links")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    global H, RUN
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows (default: all)")
    ap.add_argument("--out", type=Path, default=RESULTS / "plan_vs_real.json")
    ap.add_argument("--inner-steps", type=int, default=H, help=f"H of every row (default {H})")
    ap.add_argument("--figure", type=Path, default=FIGURE, help="where the figure goes")
    ap.add_argument("--keep", type=Path, metavar="DIR", help="keep every row's run directory under DIR")
    ap.add_argument(
        "--link-mbps", type=float, default=LINK_MBPS, help=f"the shaped rate (default {LINK_MBPS:g})"
    )
    args = ap.parse_args()
    H, RUN = args.inner_steps, ["--inner-steps", str(args.inner_steps), "--rounds", str(ROUNDS)]
    RUN += ["--eval-every", str(args.inner_steps * ROUNDS)]
    names = [n for n in args.rows.split(",") if n]
    if (problem := wan.missing()) is not None:
        print(f"plan_vs_real: {problem}", file=sys.stderr)
        sys.exit(2)
    wan.install_signal_handlers()
    ports = iter(range(29501, 29600))
    configs, measured_link = [], {}
    with tempfile.TemporaryDirectory(prefix="plan-vs-real-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for kind in ("collective", "server"):
            rows = [n for n in names if ROWS[n][0] == kind]
            if not rows:
                continue
            net = wan.Link(args.link_mbps) if kind == "collective" else wan.Star(2, args.link_mbps)
            with net:
                nbytes = int(args.link_mbps * 1e6 / 8 * 2)
                if kind == "collective":
                    rate = min(net.measure_mbps(nbytes, sender=s) for s in (1, 0))
                else:
                    rate = min(
                        net.measure_mbps(nbytes, worker=1, to=net.hub_addr),
                        net.measure_mbps(nbytes, worker=2, sender=0),
                    )
                measured_link[kind] = round(rate, 3)
                wan.log(f"{kind}: link shaped to {args.link_mbps} Mbit/s, measured {rate:.3f}")
                for name in rows:
                    pull_s = 0.0
                    if name == "server_jittered_worker":
                        fp32 = _plan("server_fp32", ROWS["server_fp32"][1], (1.0, 1.0), rate, 0.0)
                        pull_s = fp32["bytes_per_worker"]["received"][0] / ROUNDS * 8 / (rate * 1e6)
                    plan = _plan(name, ROWS[name][1], ROWS[name][2], rate, pull_s)
                    real = _run(name, net if kind == "collective" else None, net, root, next(ports))
                    row = compare(name, plan, real)
                    wan.log(f"{name}: {row}")
                    configs.append(row)
    ok = [c for c in configs if "error" not in c]
    result = {
        "benchmark": "plan_vs_real",
        "step_s": STEP_S,
        "inner_steps": H,
        "rounds": ROUNDS,
        "link_mbps": args.link_mbps,
        "measured_link_mbps": measured_link,
        "configs": configs,
        "worst_wall_error": max((abs(c["wall_error"]) for c in ok), default=None),
        "worst_utilisation_error": max(
            (abs(c["predicted_utilisation"] - c["measured_utilisation"]) for c in ok), default=None
        ),
        "bytes_exact": all(c["bytes_exact"] for c in ok) if ok else None,
        "target_wall_error": 0.10,
    }
    if ok:
        figure(configs, args.figure)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
