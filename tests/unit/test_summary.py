"""summary.json and the lines `diloco train` prints (diloco.rundir.summary), against values
worked out by hand: a real DiLoCo run of a 4-parameter model, and hand-written summary files."""

import json
import math

import torch
import torch.nn as nn

from diloco.config import TrainConfig
from diloco.core.codec import build_codec
from diloco.rundir.summary import format_summary, summarize
from diloco.runtime.sim import DiLoCo

K, H, ROUNDS = 2, 3, 2


def _batches(seed):
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(8, 4, generator=g)
        yield x, x.sum(dim=1, keepdim=True)


def _mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


class _Finished:
    """What summarize reads of a finished run (run/loop.py's Run): its runtime, data and tallies."""

    def __init__(self, trainer, *, timing=(0.0, 0.0), target=None):
        self.trainer = trainer
        shards = [torch.zeros(300), torch.zeros(100)]  # 300 and 100 training tokens
        self.data = type("Data", (), {"shards": shards, "weights": [0.75, 0.25]})
        self.tokens = K * H * ROUNDS * 8
        self.val_loss = 2.5  # the last periodic (subset) evaluation
        self.target = target
        self.eval_time_s = 0.25
        self.timing_total = {"compute_s": timing[0], "comm_s": timing[1]}

    def wall_time_s(self):
        return 12.3456


def _trained(cls=DiLoCo):
    torch.manual_seed(0)
    trainer = cls(
        lambda: nn.Linear(4, 1, bias=False),
        lambda params: torch.optim.AdamW(params, lr=0.01),
        [_batches(i) for i in range(K)],
        inner_steps=H,
        loss_fn=_mse,
        weights=[0.75, 0.25],
        codec=build_codec("int8"),
    )
    for _ in range(ROUNDS):
        trainer.round()
    return trainer


def test_summary_counts_what_happened_and_the_saving_against_data_parallel(tmp_path):
    cfg = TrainConfig(num_workers=K, inner_steps=H, rounds=ROUNDS, out=str(tmp_path / "run"))
    s = summarize(cfg, _Finished(_trained()), 2.0, step=H * ROUNDS)
    # 4 float32 parameters: 16 bytes; an int8 message of them: 4 one-byte values + one float32 scale
    param_bytes, message_bytes = 16, 8
    steps = K * H * ROUNDS  # 12 inner steps whose outer_grad arrived
    dp_per_worker = steps * param_bytes / K  # data parallel: a gradient per inner step: 96 bytes
    want = {
        "run_dir": str(tmp_path / "run"),
        "method": "diloco",
        "num_workers": K,
        "params": 4,
        "val_loss": 2.0,
        "val_ppl": math.exp(2.0),
        "final_subset_val_loss": 2.5,
        "tokens": 96,
        "inner_steps": steps,
        "inner_steps_per_worker": [H * ROUNDS] * K,
        "shards": [{"tokens": 300, "weight": 0.75}, {"tokens": 100, "weight": 0.25}],
        "outer_updates": ROUNDS,
        "nonfinite_dropped": 0,
        "bytes_sent": K * ROUNDS * message_bytes,
        "bytes_received": K * ROUNDS * param_bytes,  # θ downloaded as fp32 every round
        "bytes_sent_per_worker": ROUNDS * message_bytes,
        "dp_bytes_sent_per_worker": 96,
        "dp_bytes_ratio": dp_per_worker / (ROUNDS * message_bytes),  # 6.0
        "target_loss": None,
        "time_to_target_s": None,
        "steps_to_target": None,
        "wall_time_s": 12.346,
        "eval_time_s": 0.25,
        "sim_time_s": float(H * ROUNDS),  # 1 s per inner step, messages free: H s a round
        "runtime": "sim",
    }
    assert s == want
    (tmp_path / "summary.json").write_text(json.dumps(s))
    assert format_summary(json.loads((tmp_path / "summary.json").read_text())).splitlines() == [
        f"done in 12.3 s (6.0 s simulated): {tmp_path / 'run'}",
        "  val_loss 2.0000   val_ppl 7.389   (whole validation split)",
        "  tokens 96   inner steps 12 (6 per worker)   outer updates 2",
        "  bytes sent per worker 0.00 MB (mean of 2): 6.0x fewer than data parallel (0.00 MB) for the same "
        "inner steps",
    ]


def test_measured_time_gives_the_compute_utilisation_and_a_target_is_reported():
    cfg = TrainConfig(num_workers=K, inner_steps=H, rounds=ROUNDS, target_loss=2.2)
    run = _Finished(_trained(), timing=(3.0, 1.0), target={"sim_time_s": 3.0, "inner_step": 3})
    s = summarize(cfg, run, 2.0, step=H * ROUNDS)
    assert (s["compute_s"], s["comm_s"], s["compute_utilisation"]) == (3.0, 1.0, 0.75)
    assert (s["target_loss"], s["time_to_target_s"], s["steps_to_target"]) == (2.2, 3.0, 3)
    lines = format_summary(s).splitlines()
    assert lines[0].startswith("done in 12.3 s (6.0 s simulated), compute utilisation 75.0%: ")
    assert lines[-1] == "  target val_loss 2.2: reached at 3.0 s simulated (step 3)"


def test_sync_rounds_give_the_utilisation_and_without_rounds_the_servers_rows_do():
    """One definition in every real runtime: compute ÷ wall time of the training part. Sync rounds
    measure it (torchrun and the server); the async server has no rounds, and its per-worker rows
    give compute over training time (not the time registered, which has the start-up in it)."""
    rows = [
        {"compute_s": 6.0, "present_s": 20.0, "train_s": 8.0},
        {"compute_s": 2.0, "present_s": 20.0, "train_s": 8.0},
    ]

    class Served(DiLoCo):  # a runtime whose summary has per-worker rows, as the server's does
        def summary_extras(self):
            return {"workers": rows}

    cfg = TrainConfig(num_workers=K, inner_steps=H, rounds=ROUNDS)
    s = summarize(cfg, _Finished(_trained(Served), timing=(3.0, 1.0)), 2.0, step=H * ROUNDS)
    assert (s["compute_s"], s["comm_s"], s["compute_utilisation"]) == (3.0, 1.0, 0.75)  # the rounds'
    s = summarize(cfg, _Finished(_trained(Served), timing=(0.0, 0.0)), 2.0, step=H * ROUNDS)
    # compute (6 + 2) / 2 = 4 s a worker; training 16 / 2 = 8 s, so 4 s not computing; 50%
    assert (s["compute_s"], s["comm_s"], s["compute_utilisation"]) == (4.0, 4.0, 0.5)
    assert s["workers"] == rows


def _summary(**changes):
    """The README's example summary (defaults: 4 workers, H = 50, 6 rounds, 484,416 parameters)."""
    params, k, steps = 484_416, 4, 300
    s = {
        "run_dir": "runs/diloco-k4-H50-s0",
        "method": "diloco",
        "num_workers": k,
        "val_loss": 2.4902,
        "val_ppl": math.exp(2.4902),
        "tokens": 2_457_600,
        "inner_steps": k * steps,
        "inner_steps_per_worker": [steps] * k,
        "outer_updates": 6,
        "bytes_sent_per_worker": 6 * 4 * params,
        "dp_bytes_sent_per_worker": steps * 4 * params,
        "dp_bytes_ratio": 50.0,
        "target_loss": None,
        "time_to_target_s": None,
        "steps_to_target": None,
        "wall_time_s": 66.91,
        "sim_time_s": 300.0,
    }
    return {**s, **changes}


def test_the_readme_example_is_what_format_summary_prints(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(_summary()))
    assert format_summary(json.loads((tmp_path / "summary.json").read_text())) == (
        "done in 66.9 s (300.0 s simulated): runs/diloco-k4-H50-s0\n"
        "  val_loss 2.4902   val_ppl 12.064   (whole validation split)\n"
        "  tokens 2,457,600   inner steps 1,200 (300 per worker)   outer updates 6\n"
        "  bytes sent per worker 11.63 MB (mean of 4): 50.0x fewer than data parallel (581.30 MB) for the "
        "same inner steps"
    )


def test_format_summary_of_real_runtimes_baselines_and_uneven_workers():
    lines = format_summary(_summary(sim_time_s=None, val_ppl=None)).splitlines()
    assert lines[0] == "done in 66.9 s: runs/diloco-k4-H50-s0"  # a real runtime: no simulated time
    assert lines[1] == "  val_loss 2.4902   val_ppl overflow   (whole validation split)"
    dp = format_summary(_summary(method="dp", bytes_sent_per_worker=5_000_000)).splitlines()
    assert dp[-1] == "  bytes sent per worker 5.00 MB (a gradient every step)"
    single = format_summary(_summary(method="single", bytes_sent_per_worker=0, dp_bytes_ratio=None))
    assert single.splitlines()[-1] == (
        "  bytes sent per worker 0.00 MB (one worker: data parallel would send nothing)"
    )
    uneven = format_summary(_summary(inner_steps_per_worker=[400, 300, 300, 200])).splitlines()[2]
    assert "inner steps 1,200 (400/300/300/200 per worker)" in uneven
    many = format_summary(_summary(inner_steps_per_worker=list(range(1_000, 1_010)))).splitlines()[2]
    assert "(1,000–1,009 per worker)" in many
    # one number, as summaries of older runs hold it
    older = format_summary(_summary(inner_steps_per_worker=300)).splitlines()[2]
    assert "(300 per worker)" in older
    missed = format_summary(_summary(target_loss=1.5)).splitlines()[-1]
    assert missed == "  target val_loss 1.5: not reached"
