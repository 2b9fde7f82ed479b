"""`DistributedDiLoCo` in a user's own loop, in real processes (torchrun, gloo): README.md's
example runs and learns, and the global parameters equal the simulator's `DiLoCo` on the same
model, data and seed, bit for bit with two processes, for a summable codec (fp32: the bucketed
all-reduce) and one that is not (SparseLoCo's top-k with error feedback: every message gathered)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco import DiLoCo, DistributedDiLoCo

README = Path(__file__).resolve().parents[2] / "README.md"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # two ranks on two cores: one thread each

# The user's side: a two-layer MLP, its own loop, each rank its own data. `codec` and `outer`
# below are evaluated in both this script and the test, so both sides build the same.
SETUP = """
import torch
from diloco import SGD, Nesterov, build_codec

K, H, ROUNDS = 2, 5, 4
CODECS = {
    "fp32": (lambda: None, lambda: Nesterov(lr=0.7, momentum=0.9)),
    "sparseloco": (
        lambda: build_codec(
            "topk", error_feedback=True, ef_decay=0.9, topk_fraction=0.1, topk_chunk=16, topk_bits=2
        ),
        lambda: SGD(lr=2.0),
    ),
}


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def inner_opt(params):
    return torch.optim.AdamW(params, lr=0.01)


def batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    while True:
        x = torch.randn(8, 6, generator=g)
        yield x, x.sum(dim=1, keepdim=True).sin()


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)
"""

SCRIPT = (
    SETUP
    + """
import sys
import torch.distributed as dist
from diloco import DistributedDiLoCo

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)  # different seeds: DistributedDiLoCo starts every rank from rank 0's model
model = make_model()
opt = inner_opt(model.parameters())
codec, outer_opt = CODECS[sys.argv[1]]
outer = DistributedDiLoCo(model, inner_steps=H, outer_opt=outer_opt(), codec=codec())
data = batches(rank)
for step in range(H * ROUNDS):
    loss = loss_fn(model, next(data))
    opt.zero_grad()
    loss.backward()
    opt.step()
    synced = outer.step()
    assert synced == ((step + 1) % H == 0)
assert all(p.equal(g) for p, g in zip(model.parameters(), outer.global_params))
if rank == 0:
    saved = {"params": outer.global_params, "version": outer.version, "bytes": outer.bytes_sent}
    torch.save(saved, sys.argv[2])
dist.destroy_process_group()
"""
)


def _torchrun(tmp_path, script: str, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    path = tmp_path / "user_train.py"
    path.write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return subprocess.run(
        [*cmd, str(path), *args], capture_output=True, text=True, timeout=100, cwd=tmp_path, env=ENV
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["fp32", "sparseloco"])
def test_two_processes_equal_the_simulator_bit_for_bit(tmp_path, codec):
    out = tmp_path / "global.pt"
    proc = _torchrun(tmp_path, SCRIPT, codec, str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = torch.load(out)
    scope: dict = {}
    exec(SETUP, scope)
    make_codec, make_outer = scope["CODECS"][codec]
    torch.manual_seed(0)
    sim = DiLoCo(
        scope["make_model"],
        scope["inner_opt"],
        [scope["batches"](r) for r in range(scope["K"])],
        inner_steps=scope["H"],
        loss_fn=scope["loss_fn"],
        outer_opt=make_outer(),
        codec=make_codec(),
    )
    for _ in range(scope["ROUNDS"]):
        sim.round()
    assert real["version"] == sim.side.version == scope["ROUNDS"]
    assert real["bytes"] == sim.side.bytes_sent[0] > 0
    torch.manual_seed(0)  # the model both began from, as rank 0 built it
    start = [p.detach().clone() for p in scope["make_model"]().parameters()]
    moved = [not r.equal(s) for r, s in zip(real["params"], start)]
    assert all(moved), "the outer steps left a parameter where it started"
    assert all(r.equal(s) for r, s in zip(real["params"], sim.side.params, strict=True))


def _readme_example() -> str:
    section = README.read_text().split("### Across processes, in your own loop", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.timeout(120)
def test_the_readme_example_runs_under_torchrun_and_learns(tmp_path):
    proc = _torchrun(tmp_path, _readme_example())
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = re.search(r"max weight error ([\d.]+) after 50 outer updates; ([\d,]+) bytes", proc.stdout)
    assert match, proc.stdout
    assert float(match.group(1)) < 0.01
    assert int(match.group(2).replace(",", "")) == 50 * 8 * 4  # 50 rounds of 8 fp32 values


@pytest.mark.timeout(30)
def test_outside_a_torch_distributed_job_it_says_what_to_call():
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDiLoCo(torch.nn.Linear(2, 1), inner_steps=5)


@pytest.mark.timeout(60)
def test_a_run_checkpointed_mid_round_and_resumed_equals_one_that_never_stopped(tmp_path):
    """One process (a real gloo group of one): state_dict() with the user's model and optimizer,
    mid-round and with SparseLoCo's error feedback, resumes to the same bits."""
    import torch.distributed as dist

    scope: dict = {}
    exec(SETUP, scope)
    make_codec, make_outer = scope["CODECS"]["sparseloco"]
    H, steps = scope["H"], 4 * scope["H"]

    def train(from_step, until, saved=None):
        torch.manual_seed(0)
        model = scope["make_model"]()
        opt = scope["inner_opt"](model.parameters())
        outer = DistributedDiLoCo(model, inner_steps=H, outer_opt=make_outer(), codec=make_codec())
        data = scope["batches"](0)
        if saved is not None:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            outer.load_state_dict(saved["outer"])
        for _ in range(from_step):  # the data iterator where the checkpoint left it
            next(data)
        for _ in range(from_step, until):
            loss = scope["loss_fn"](model, next(data))
            opt.zero_grad()
            loss.backward()
            opt.step()
            outer.step()
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "outer": outer.state_dict()}
        torch.save(state, tmp_path / "ckpt.pt")  # as a user would: to disk and back
        return torch.load(tmp_path / "ckpt.pt", weights_only=False), outer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        _, whole = train(0, steps)
        mid = H + 2  # inside the second round: the round's first steps are in the checkpoint
        saved, _ = train(0, mid)
        _, resumed = train(mid, steps, saved)
        resumed.sync()  # right after a round's sync: nothing to send, θ_global stays where it is
    finally:
        dist.destroy_process_group()
    assert resumed.version == whole.version == 4
    assert resumed.bytes_sent == whole.bytes_sent
    assert all(a.equal(b) for a, b in zip(resumed.global_params, whole.global_params, strict=True))
