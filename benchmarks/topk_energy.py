"""What a sparse message carries (issue 35): why SparseLoCo and top-k need rounds at nano.

Two of bytes_to_loss.py's runs again (nano, k = 4, H = 50, 20 rounds, warm start of seed 0),
with every worker's outer_grad measured as it is encoded:

- DiLoCo fp32 (Nesterov, outer lr 1.0): the share of an outer_grad's energy (squared norm) in
  the top 1%, 3% and 10% of each 4,096-value chunk, the set top-k codecs send, and the mean
  cosine between the outer_grads of two workers in a round (1: all signal, 0: all noise);
- SparseLoCo 3% (outer lr 5.6, β = 0.95): the share of the accumulator e ← β e + Δ that the
  2-bit message carries, the accumulator's size against the round's outer_grad, and the
  overlap (Jaccard) of two workers' sent positions in a round.

Each run's final loss must equal its ledger row's (the measurement does not change the run).
Per round, the mean over workers; JSON: benchmarks/results/topk_energy.json (`fp32`:
`top_share[p]`, `cos` per round and their means; `sparseloco3`: `sent_share`, `acc_vs_delta`,
`overlap` per round; each run's final loss and its ledger row's). Runs in two subprocesses
at once, one thread each (~8 min).

    python benchmarks/topk_energy.py                # needs the warm start: bytes_to_loss.py's
    python benchmarks/topk_energy.py --init DIR     # pretraining run of seed 0 (its folder)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "topk_energy.json"
INIT = ROOT / "benchmarks" / "results" / "reproduce_runs" / "pretrain-s0-54bdd750052a"
SHARES = (0.01, 0.03, 0.1)
WORKERS = 4
CHUNK = 4096
COMMON = ["--seed", "0", "--model", "nano", "--method", "diloco", "--workers", str(WORKERS)]
COMMON += ["--inner-steps", "50", "--rounds", "20", "--threads", "1", "--procs", "1", "--no-progress"]
RUNS = {  # name -> flags (those of the ledger's runs) and the ledger row's label
    "fp32": (["--outer-opt", "nesterov", "--outer-lr", "1"], "diloco k=4 H=50 nesterov lr=1 warm s0"),
    "sparseloco3": (
        ["--outer-opt", "sparseloco", "--outer-lr", "5.6", "--topk-fraction", "0.03"],
        "diloco k=4 H=50 sparseloco lr=5.6 sparseloco3 warm s0",
    ),
}
LEDGER = ROOT / "benchmarks" / "results" / "reproduce_ledger" / "runs.jsonl"


def _log(text: str) -> None:
    print(f"[topk_energy] {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def top_share(tensors: list, fraction: float) -> float:
    """The share of the tensors' energy in the `fraction` largest |values| of each chunk."""
    import torch

    from diloco.core.topk import TopKCodec

    keep = TopKCodec(fraction=fraction).keep  # each chunk keeps ⌈fraction × its length⌉
    kept = total = 0.0
    for t in tensors:
        for c in t.reshape(-1).float().split(CHUNK):
            sq = c * c
            kept += float(torch.topk(sq, keep(c.numel())).values.sum())
            total += float(sq.sum())
    return kept / total if total else 0.0


def measure(name: str, init: Path, workdir: Path) -> dict:
    """Run one of RUNS with `Codec.encode` measured; returns its per-encode records and summary."""
    import torch

    from diloco.cli.parser import build_parser
    from diloco.cli.train import train_command
    from diloco.core import codec_base

    records: list[dict] = []
    seen: list[torch.Tensor] = []  # per encode: the outer_grad (fp32), or where the message is nonzero
    encode = codec_base.Codec.encode

    def measured(self, tensors, state=None):  # noqa: ANN001
        if state is None:  # not a worker's outer_grad
            return encode(self, tensors, state)
        delta = sum(float((t.float() ** 2).sum()) for t in tensors)
        message = encode(self, tensors, state)
        row = {"delta": delta}
        if name == "fp32":
            row.update({str(p): top_share(tensors, p) for p in SHARES})
            seen.append(torch.cat([t.reshape(-1).float() for t in tensors]))
        else:
            decoded = list(self._decode(message))
            seen.append(torch.cat([d.reshape(-1) for d in decoded]) != 0)
            # the accumulator e = βe + Δ that was encoded: what was sent plus what encode kept back
            acc_sq = sum(float(((d + r) ** 2).sum()) for d, r in zip(decoded, state["residual"], strict=True))
            row["sent_share"] = sum(float((d**2).sum()) for d in decoded) / acc_sq
            row["acc_vs_delta"] = (acc_sq / delta) ** 0.5
        records.append(row)
        return message

    args = build_parser().parse_args(
        ["train", *COMMON, *RUNS[name][0], "--init-from", str(init), "--out", str(workdir / name)]
    )
    codec_base.Codec.encode = measured
    try:
        _, summary = train_command(args)
    finally:
        codec_base.Codec.encode = encode
    for i, row in enumerate(records):  # against the other workers of its round
        others = [seen[j] for j in range(i - i % WORKERS, i - i % WORKERS + WORKERS) if j != i]
        if name == "fp32":
            row["cos"] = statistics.fmean(
                float(torch.nn.functional.cosine_similarity(seen[i], o, dim=0)) for o in others
            )
        else:
            jaccard = (float((seen[i] & o).sum() / (seen[i] | o).sum()) for o in others)
            row["overlap"] = statistics.fmean(jaccard)
    return {"records": records, "final_subset_val_loss": summary["final_subset_val_loss"]}


def per_round(records: list[dict], key: str) -> list[float]:
    """The mean over workers of `key`, round by round (each round's encodes come in a block)."""
    return [mean_of(records[i : i + WORKERS], key) for i in range(0, len(records), WORKERS)]


def mean_of(records: list[dict], key: str) -> float:
    return round(statistics.fmean(r[key] for r in records), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init", type=Path, default=INIT, help="the pretraining run of seed 0 (a run folder)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/topk_energy"))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--one", choices=sorted(RUNS), help=argparse.SUPPRESS)  # a subprocess's run
    args = ap.parse_args()
    if not (args.init / "model.safetensors").is_file():
        sys.exit(
            f"topk_energy: {args.init} holds no model.safetensors; give --init the folder of "
            "bytes_to_loss.py's pretraining run of seed 0 (it makes it on its first run)."
        )
    if args.one:
        result = measure(args.one, args.init, args.workdir)
        (args.workdir / f"{args.one}.json").write_text(json.dumps(result))
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    _log(f"2 runs at once in {args.workdir}")
    env = {"PYTHONPATH": f"{ROOT / 'src'}", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--one", name, "--init", str(args.init)]
            + ["--workdir", str(args.workdir)],
            env=env,
        )
        for name in RUNS
    ]
    if any(p.wait() for p in procs):
        sys.exit("topk_energy: a run failed (its output is above)")
    got = {name: json.loads((args.workdir / f"{name}.json").read_text()) for name in RUNS}
    ledger = [json.loads(line) for line in LEDGER.read_text().splitlines() if line.strip()]
    for name, (_, label) in RUNS.items():
        rows = [r["summary"]["final_subset_val_loss"] for r in ledger if r["label"] == label]
        got[name]["ledger"] = rows[-1] if rows else None
        got[name]["matches_ledger"] = bool(rows) and abs(rows[-1] - got[name]["final_subset_val_loss"]) < 1e-6
    fp32, sl = got["fp32"]["records"], got["sparseloco3"]["records"]
    out = {
        "setting": "nano, k = 4, H = 50, 20 rounds, warm start of seed 0, chunks of 4,096 values",
        "fp32": {
            **{k: got["fp32"][k] for k in ("final_subset_val_loss", "ledger", "matches_ledger")},
            "top_share": {str(p): per_round(fp32, str(p)) for p in SHARES},
            "top_share_mean": {str(p): mean_of(fp32, str(p)) for p in SHARES},
            "cos": per_round(fp32, "cos"),
            "cos_mean": mean_of(fp32, "cos"),
        },
        "sparseloco3": {
            **{k: got["sparseloco3"][k] for k in ("final_subset_val_loss", "ledger", "matches_ledger")},
            "sent_share": per_round(sl, "sent_share"),
            "acc_vs_delta": per_round(sl, "acc_vs_delta"),
            "sent_share_mean": mean_of(sl, "sent_share"),
            "overlap": per_round(sl, "overlap"),
            "overlap_mean": mean_of(sl, "overlap"),
        },
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
