"""The collective runtime in real processes: torchrun, gloo on CPU, the tiny model.

Each test launches `torchrun --standalone` with real ranks and compares with the simulator run
in this process on the same config and seed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import user_files
from safetensors.torch import load_file

from diloco.config import OuterConfig
from diloco.run.train import train

TINY = ["--model", "nano", "--seq-len", "32", "--batch-size", "4", "--inner-steps", "4", "--rounds", "3"]


def _torchrun(
    tmp_path, nproc, *flags, env=None, max_restarts=0, timeout=60, entry=("-m", "diloco"), gpt_sizes=True
):
    # A config file shrinks the model further than the flags can (diloco's GPT only).
    cfg = tmp_path / "tiny.toml"
    sizes = "[model]\nn_layer = 2\nn_head = 2\nd_model = 32\n" if gpt_sizes else ""
    cfg.write_text(sizes + "[inner]\nwarmup_steps = 2\n")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        *entry,
        "train",
        "--runtime",
        "collective",
        "--config",
        str(cfg),
        *TINY,
        *flags,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env={**os.environ, **(env or {})}
    )


def _sim(tiny, tmp_path, name, **kw):
    import dataclasses

    from diloco.config import SimConfig

    base = tiny(rounds=3, out=str(tmp_path / name), sim=SimConfig(procs=1))
    cfg = dataclasses.replace(base, **kw)
    train(cfg, progress=False)
    return load_file(str(tmp_path / name / "model.safetensors"))


def _max_rel(a, b):
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5
    den = sum(float(b[k].pow(2).sum()) for k in b) ** 0.5
    return num / den


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: the suite's 10 minutes
def test_collective_equals_the_simulator(tiny, tmp_path, nproc):
    proc = _torchrun(tmp_path, nproc, "--out", str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = load_file(str(tmp_path / "c" / "model.safetensors"))
    sim = _sim(tiny, tmp_path, "s", num_workers=nproc)
    if nproc == 2:  # a + b is the same in any order: bitwise
        assert all(real[k].equal(sim[k]) for k in sim)
    else:  # gloo's all-reduce sums four terms in its own order
        assert _max_rel(real, sim) < 1e-6
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert summary["num_workers"] == nproc and summary["outer_updates"] == 3
    assert 0 < summary["compute_utilisation"] <= 1
    lines = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    outer = [x for x in lines if x["kind"] == "outer"]
    assert len(outer) == 3 and all("comm_s" in x and "sim_time_s" not in x for x in outer)
    assert summary["bytes_sent_per_worker"] == 3 * summary["params"] * 4


@pytest.mark.timeout(90)
def test_two_workers_of_two_ranks_equal_two_simulated_workers_at_double_batch(tiny, tmp_path):
    import dataclasses

    proc = _torchrun(tmp_path, 4, "--procs-per-worker", "2", "--out", str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    size = summary["params"] * 4 * 3  # 3 rounds of one model-sized message
    # leaders all-reduce (send and receive) and broadcast (send); the others only receive
    assert summary["bytes_per_rank"] == [[2 * size, size], [0, size], [2 * size, size], [0, size]]
    assert summary["tokens"] == 3 * 4 * 2 * (2 * 4) * 32  # rounds × H × workers × (M × batch) × seq
    real = load_file(str(tmp_path / "c" / "model.safetensors"))
    base = tiny()
    sim = _sim(tiny, tmp_path, "s", num_workers=2, data=dataclasses.replace(base.data, batch_size=8))
    # DDP averages two half-batch gradients; the simulator takes one full-batch gradient:
    # the same up to float rounding, which AdamW can amplify a little over 12 steps.
    assert _max_rel(real, sim) < 1e-4


@pytest.mark.slow  # long; in `make test-all` (pytest -m slow)
@pytest.mark.timeout(120)
def test_a_rank_killed_mid_round_restarts_and_resumes_from_the_checkpoint(tiny, tmp_path):
    out = tmp_path / "c"
    proc = _torchrun(
        tmp_path,
        2,
        "--rounds",
        "4",
        "--checkpoint-every",
        "2",
        "--out",
        str(out),
        env={"DILOCO_FAULT": "kill:1:10"},
        max_restarts=1,
        timeout=110,
    )
    assert proc.returncode == 0, "\n".join(x for x in proc.stderr.splitlines() if not x.startswith("W"))[
        :6000
    ]
    assert "SIGKILL" in proc.stderr or "Signal 9" in proc.stderr or "exitcode: -9" in proc.stderr
    straight = tmp_path / "straight"
    proc = _torchrun(tmp_path, 2, "--rounds", "4", "--out", str(straight))
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = load_file(str(out / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    assert all(a[k].equal(b[k]) for k in a)  # lost only round 3, redone identically
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines if x["kind"] == "outer"] == [1, 2, 3, 4]


@pytest.mark.timeout(90)
def test_a_perturbed_rank_is_caught_by_the_hash_check(tmp_path):
    proc = _torchrun(tmp_path, 2, "--out", str(tmp_path / "c"), env={"DILOCO_FAULT": "perturb:1:2"})
    assert proc.returncode != 0
    assert "global parameters of rank 1 differ from rank 0's after round 2" in proc.stderr


@pytest.mark.timeout(60)
def test_collective_outside_torchrun_and_wrong_worker_count_are_clear_errors(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "train", "--runtime", "collective"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "runs under torchrun" in proc.stderr
    proc = _torchrun(tmp_path, 2, "--workers", "3", "--out", str(tmp_path / "c"))
    assert proc.returncode != 0 and "--workers 3 does not match 2 ranks" in proc.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("after_drop", [pytest.param("own", marks=pytest.mark.slow), "global"])
def test_drop_prob_and_workers_schedule_match_the_simulator(tiny, tmp_path, after_drop):
    faults = ["--drop-prob", "0.5", "--workers-schedule", "0:1,0.5:2", "--after-drop", after_drop]
    proc = _torchrun(tmp_path, 2, *faults, "--out", str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = load_file(str(tmp_path / "c" / "model.safetensors"))
    kw = dict(num_workers=2, drop_prob=0.5, workers_schedule="0:1,0.5:2")
    sim = _sim(tiny, tmp_path, "s", after_drop=after_drop, **kw)
    assert all(real[k].equal(sim[k]) for k in sim)
    if after_drop == "global":  # a drop these 3 rounds draw changes where its worker goes on from
        own = _sim(tiny, tmp_path, "own", after_drop="own", **kw)
        assert not all(own[k].equal(sim[k]) for k in sim)


@pytest.mark.slow  # the suite's 10 minutes: test_init_from.py starts every method from a file
@pytest.mark.timeout(90)
def test_init_from_starts_every_rank_from_the_given_parameters(tiny, tmp_path):
    train(tiny(method="single", rounds=2, out=str(tmp_path / "pre")), progress=False)
    proc = _torchrun(tmp_path, 2, "--init-from", str(tmp_path / "pre"), "--out", str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = load_file(str(tmp_path / "c" / "model.safetensors"))
    sim = _sim(tiny, tmp_path, "s", num_workers=2, init_from=str(tmp_path / "pre"))
    assert all(real[k].equal(sim[k]) for k in sim)
    scratch = _sim(tiny, tmp_path, "scratch", num_workers=2)
    assert not all(scratch[k].equal(sim[k]) for k in sim)


@pytest.mark.timeout(120)
def test_a_restart_before_any_checkpoint_starts_over_in_the_same_directory(tmp_path):
    out = tmp_path / "c"
    proc = _torchrun(
        tmp_path, 2, "--out", str(out), env={"DILOCO_FAULT": "kill:0:5"}, max_restarts=1, timeout=110
    )
    assert proc.returncode == 0, "\n".join(x for x in proc.stderr.splitlines() if not x.startswith("W"))[
        :6000
    ]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines if x["kind"] == "outer"] == [
        1,
        2,
        3,
    ]  # the lost attempt's lines are gone
    assert json.loads((out / "summary.json").read_text())["outer_updates"] == 3


GATHERED = """
import sys

from diloco.core.codec import Fp32Codec

Fp32Codec.summable = False  # as a codec whose messages cannot be summed: all-gathered as bytes
from diloco.cli.main import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # the suite's 10 minutes: topk in test_every_codec... is gathered too, by 2 ranks
@pytest.mark.timeout(120)
def test_messages_that_cannot_be_summed_are_gathered_and_reduced_like_the_simulator(tiny, tmp_path):
    script = tmp_path / "gathered.py"
    script.write_text(GATHERED)
    proc = _torchrun(tmp_path, 4, "--out", str(tmp_path / "c"), timeout=110, entry=(str(script),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = load_file(str(tmp_path / "c" / "model.safetensors"))
    sim = _sim(tiny, tmp_path, "s", num_workers=4)
    # gathered messages are reduced in worker order on every rank: bitwise, whatever the rank count
    assert all(real[k].equal(sim[k]) for k in sim)
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    blob = summary["params"] * 4  # each message's payload, plus its safetensors header
    sent, received = summary["bytes_per_rank"][0]
    assert 3 * blob < sent < 3 * blob * 1.1 and 4 * sent - 100 < received < 4 * sent + 100


CODED = [
    ["--codec", "bf16"],
    pytest.param(  # slow: the suite's 10 minutes (fp4 + error feedback and the server's download codec stay)
        ["--codec", "int8", "--error-feedback", "--download-codec", "bf16"], marks=pytest.mark.slow
    ),
    # SparseLoCo: top-k per chunk, 2-bit values, decayed error feedback, the plain averaged step
    ["--outer-opt", "sparseloco", "--topk-fraction", "0.1", "--topk-chunk", "64", "--outer-lr", "1.0"],
    ["--fragments", "2", "--overlap-steps", "1", "--codec", "fp4", "--error-feedback"],
    ["--fragments", "2", "--overlap-steps", "1", "--mix-alpha", "0.3", "--codec", "bf16"],
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", CODED, ids=lambda f: "-".join(x.strip("-") for x in f))
def test_every_codec_and_streaming_equal_the_simulator_bit_for_bit(tiny, tmp_path, flags):
    """Summable codecs are all-reduced, the others all-gathered; fragments are exchanged with
    asynchronous collectives under the overlapped steps: with 2 ranks, the simulator's numbers."""
    proc = _torchrun(tmp_path, 2, *flags, "--out", str(tmp_path / "c"), timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = load_file(str(tmp_path / "c" / "model.safetensors"))
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    implied = "topk" if "sparseloco" in flags else "fp32"  # --outer-opt sparseloco sends top-k
    assert cfg["codec"] == (flags[flags.index("--codec") + 1] if "--codec" in flags else implied)
    keys = (
        "codec",
        "error_feedback",
        "topk_fraction",
        "topk_chunk",
        "topk_bits",
        "ef_decay",
        "download_codec",
        "fragments",
        "overlap_steps",
        "mix_alpha",
    )
    outer = OuterConfig(**cfg["outer"])
    sim = _sim(tiny, tmp_path, "s", num_workers=2, outer=outer, **{k: cfg[k] for k in keys})
    assert all(real[k].equal(sim[k]) for k in sim)
    a = json.loads((tmp_path / "c" / "summary.json").read_text())
    b = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert a["bytes_sent_per_worker"] == b["bytes_sent_per_worker"] and a["val_loss"] == b["val_loss"]


@pytest.mark.slow  # the suite's 10 minutes: streaming and 2-rank workers are each covered alone
@pytest.mark.timeout(120)
def test_streaming_with_workers_of_two_ranks_matches_the_simulator_at_double_batch(tiny, tmp_path):
    import dataclasses

    flags = ["--procs-per-worker", "2", "--fragments", "2", "--overlap-steps", "1", "--codec", "fp4"]
    proc = _torchrun(tmp_path, 4, *flags, "--error-feedback", "--out", str(tmp_path / "c"), timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = load_file(str(tmp_path / "c" / "model.safetensors"))
    base = tiny()
    sim = _sim(
        tiny,
        tmp_path,
        "s",
        num_workers=2,
        data=dataclasses.replace(base.data, batch_size=8),
        codec="fp4",
        error_feedback=True,
        fragments=2,
        overlap_steps=1,
    )
    assert _max_rel(real, sim) < 1e-3  # DDP's half-batch gradients, then 4-bit messages


@pytest.mark.timeout(120)
def test_a_nan_after_the_last_send_of_a_round_stops_streaming_before_its_checkpoint(tmp_path):
    """H = 4, 2 fragments, τ = 1: the round's last inner step sends nothing. A NaN there is in no
    exchange, yet every rank stops before the round is checkpointed."""
    from diloco.rundir import checkpoint

    out = tmp_path / "c"
    flags = ["--fragments", "2", "--overlap-steps", "1", "--checkpoint-every", "1", "--out", str(out)]
    proc = _torchrun(tmp_path, 2, *flags, env={"DILOCO_FAULT": "nan:1:7"}, timeout=110)  # round 2's last
    assert proc.returncode != 0
    assert "worker 1 produced a non-finite (NaN or Inf) training loss or outer_grad in round 2" in proc.stderr
    path, state = checkpoint.latest_valid(out / "checkpoints")
    assert path.name == "round-000001" and state["round"] == 1


@pytest.mark.slow  # the suite's 10 minutes: the server's test of the same runs by default
@pytest.mark.timeout(120)
def test_user_data_bpe_and_a_hugging_face_model_equal_the_simulator(tmp_path, monkeypatch):
    """Both ranks read the same files, share one tokenisation through the cache, and train a
    tiny Llama built by transformers: bit for bit the simulator's run."""
    from diloco.cli.main import main

    data, llama = user_files(tmp_path)
    flags = ["--data", data, "--tokenizer", "bpe:280", "--model-config", llama]
    proc = _torchrun(tmp_path, 2, *flags, "--out", str(tmp_path / "c"), timeout=110, gpt_sizes=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.chdir(tmp_path)
    sim = ["train", "--config", "tiny.toml", *TINY, *flags, "--workers", "2", "--procs", "1", "--out", "s"]
    assert main(sim) == 0
    real, ref = (
        load_file(str(tmp_path / "c" / "model.safetensors")),
        load_file(str(tmp_path / "s" / "model.safetensors")),
    )
    assert real.keys() == ref.keys() and all(real[k].equal(ref[k]) for k in ref)
    assert (tmp_path / "c" / "tokenizer.json").read_text() == (tmp_path / "s" / "tokenizer.json").read_text()


@pytest.mark.slow  # the suite's 10 minutes; tests/unit/test_shard_plan.py covers the plan itself
@pytest.mark.timeout(90)
def test_every_rank_trains_on_rank_0s_shard_plan(tiny, tmp_path):
    """Rank 1 on "another machine", whose own k-means would come out otherwise (tests/
    other_machine, for RANK=1 only), cuts its shards by rank 0's plan, which shards.json records:
    the run equals the simulator bit for bit."""
    import dataclasses

    other = os.pathsep.join(
        p for p in (str(Path(__file__).parents[1] / "other_machine"), os.environ.get("PYTHONPATH")) if p
    )
    proc = _torchrun(
        tmp_path, 2, "--shards", "kmeans", "--out", str(tmp_path / "c"), env={"PYTHONPATH": other}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = load_file(str(tmp_path / "c" / "model.safetensors"))
    sim = _sim(tiny, tmp_path, "s", num_workers=2, data=dataclasses.replace(tiny().data, shards="kmeans"))
    assert all(real[k].equal(sim[k]) for k in sim)
    assert (tmp_path / "c" / "shards.json").read_text() == (tmp_path / "s" / "shards.json").read_text()
