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

from diloco import SGD, DiLoCo, DistributedDiLoCo
from diloco.errors import NonFinite

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


def user_loop(model, opt, data, outer, steps):  # each inner step, then outer.step(): did it sync?
    synced = []
    for _ in range(steps):
        loss = loss_fn(model, next(data))
        opt.zero_grad()
        loss.backward()
        opt.step()
        synced.append(outer.step())
    return synced
"""

# A process of a torchrun job; the job's script goes on from here and saves `saved`.
JOB = (
    SETUP
    + """
import copy
import os
import sys
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from diloco import DistributedDiLoCo
from diloco.runtime.distributed import _digest

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
saved = {}


def told(error):  # every process's message
    said = [None] * dist.get_world_size()
    dist.all_gather_object(said, str(error))
    return said
"""
)
# ... and ends: rank 0 saves `saved`, every process leaves as README's example does.
END = """
if rank == 0:
    torch.save(saved, sys.argv[1])
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""

SCRIPT = (
    JOB
    + """
# fp32 in buckets of 50 values (the model has 129: three all-reduces), SparseLoCo over a group
settings = {"fp32": {"bucket_mb": 0.0002}, "sparseloco": {"group": dist.new_group(backend="gloo")}}
for name, (codec, outer_opt) in CODECS.items():  # one job, each codec a run of its own
    torch.manual_seed(rank)  # different seeds: DistributedDiLoCo starts every rank from rank 0's model
    model = make_model()
    opt = inner_opt(model.parameters())
    outer = DistributedDiLoCo(model, inner_steps=H, outer_opt=outer_opt(), codec=codec(), **settings[name])
    data = batches(rank)
    synced = user_loop(model, opt, data, outer, 2 * H)
    earlier = copy.deepcopy(outer.state_dict())  # after round 2 (its tensors change in place)
    synced += user_loop(model, opt, data, outer, (ROUNDS - 2) * H)
    assert synced == [(step + 1) % H == 0 for step in range(H * ROUNDS)]
    assert all(p.equal(g) for p, g in zip(model.parameters(), outer.global_params))
    saved[name] = {"params": outer.global_params, "version": outer.version, "bytes": outer.bytes_sent}
# Streaming DiLoCo: 2 fragments sent at steps 1 and 4 of each round of 5, merged a step later
for name, (codec, outer_opt) in CODECS.items():
    torch.manual_seed(rank)
    model = make_model()
    opt = inner_opt(model.parameters())
    streaming = DistributedDiLoCo(
        model, inner_steps=H, outer_opt=outer_opt(), codec=codec(), fragments=2, overlap_steps=1
    )
    data = batches(rank)
    synced = user_loop(model, opt, data, streaming, H + 1)  # fragment 0's exchange in flight
    for call in (streaming.state_dict, streaming.sync):
        try:
            call()
        except RuntimeError as e:
            saved[f"streaming refuses {call.__name__}"] = str(e)
    synced += user_loop(model, opt, data, streaming, (ROUNDS - 1) * H - 1)
    assert synced == [(step + 1) % H == 0 for step in range(H * ROUNDS)]
    saved[f"streaming {name}"] = {
        "params": streaming.global_params, "model": [p.detach().clone() for p in model.parameters()],
        "version": streaming.version, "bytes": streaming.bytes_sent,
    }  # fmt: skip
# DyLU: rank 1's steps take twice rank 0's time (a scripted timer), so from round 2 on it
# takes ⌊H / 2⌋ steps a round; the loop runs until the rounds are done, each step's schedule
# position read from schedule_step
torch.manual_seed(rank)
model = make_model()
opt = inner_opt(model.parameters())
clock = [0.0]
dylu = DistributedDiLoCo(
    model, inner_steps=H, outer_opt=Nesterov(lr=0.7, momentum=0.9), dylu=True, timer=lambda: clock[0]
)
data, positions = batches(rank), []
while dylu.version < ROUNDS:
    positions.append(dylu.schedule_step)
    loss = loss_fn(model, next(data))
    opt.zero_grad()
    loss.backward()
    opt.step()
    clock[0] += 1.0 + rank
    dylu.step()
    if dylu.version == 2 and dylu.steps_in_round == 2 - rank:  # mid-round 3, at unequal counts
        again = DistributedDiLoCo(make_model(), inner_steps=H, dylu=True, timer=lambda: clock[0])
        again.load_state_dict(dylu.state_dict())  # what a resumed worker knows: plan and place
        resumed = [(dylu.round_steps, dylu.schedule_step), (again.round_steps, again.schedule_step)]
both = [None, None]
dist.all_gather_object(both, positions)
saved["dylu"] = {"params": dylu.global_params, "version": dylu.version, "positions": both}
saved["dylu resumed"] = [None, None]
dist.all_gather_object(saved["dylu resumed"], resumed)
if rank == 1:
    outer.step()  # one inner step more than rank 0
try:
    outer.sync()
except RuntimeError as e:
    saved["unequal"] = str(e)
try:  # rank 1 loads its checkpoint of round 2, rank 0 its state now
    outer.load_state_dict(earlier if rank == 1 else outer.state_dict())
except ValueError as e:
    saved["mismatch"] = str(e)
box = [outer.state_dict()]
dist.broadcast_object_list(box, src=0)  # both load rank 0's
try:
    outer.load_state_dict(box[0])
except ValueError as e:
    saved["swapped"] = told(e)
# θ_global changed on one process (as a flipped bit would): named at the next sync
torch.manual_seed(0)
model = make_model()
outer = DistributedDiLoCo(model, inner_steps=1)
if rank == 1:
    with torch.no_grad():
        outer.side.params[0].add_(1e-3)
try:
    user_loop(model, inner_opt(model.parameters()), batches(rank), outer, 1)
except RuntimeError as e:
    saved["diverged"] = told(e)
    saved["diverged_version"] = outer.version
# check_global=False skips the comparison (CPUs of different kinds): the outer step runs on
# θ_globals that differ; off on one process only, every process is told to agree
for checks in ((False, False), (True, False)):
    torch.manual_seed(0)
    model = make_model()
    outer = DistributedDiLoCo(model, inner_steps=1, check_global=checks[rank])
    if rank == 1:
        with torch.no_grad():
            outer.side.params[0].add_(1e-3)
    try:
        user_loop(model, inner_opt(model.parameters()), batches(rank), outer, 1)
        if not any(checks):  # θ_globals apart: each process's checkpoint still loads, unchecked
            outer.load_state_dict(outer.state_dict())
        thetas = [None] * 2
        dist.all_gather_object(thetas, outer.global_params[0].clone())
        saved[f"unchecked {checks}"] = (outer.version, thetas)
    except RuntimeError as e:
        saved[f"unchecked {checks}"] = told(e)
"""
    + END
)


ISLANDS = (
    JOB
    + """
for name, (codec, outer_opt) in CODECS.items():
    torch.manual_seed(rank)
    model = make_model()
    outer = DistributedDiLoCo(
        model, inner_steps=H, outer_opt=outer_opt(), codec=codec(), procs_per_worker=2, bucket_mb=0.0002
    )
    mine = [rank - rank % 2, rank - rank % 2 + 1]
    assert dist.get_process_group_ranks(outer.worker_group) == outer.worker_ranks == mine
    ddp = DistributedDataParallel(model, process_group=outer.worker_group)  # data parallel inside a worker
    opt = inner_opt(model.parameters())
    user_loop(ddp, opt, batches(rank), outer, H * ROUNDS)  # each process half of its worker's batch
    fingerprints = [None] * 4  # θ_global and the model, on every process
    dist.all_gather_object(fingerprints, (_digest(outer.global_params), _digest(list(model.parameters()))))
    saved[name] = {"params": outer.global_params, "bytes": outer.bytes_sent, "version": outer.version}
    saved[name]["fingerprints"] = fingerprints
# Streaming DiLoCo (2 fragments, overlap 1) in workers of two: the leaders exchange
for name, (codec, outer_opt) in CODECS.items():
    torch.manual_seed(rank)
    model = make_model()
    outer = DistributedDiLoCo(
        model, inner_steps=H, outer_opt=outer_opt(), codec=codec(), procs_per_worker=2, fragments=2,
        overlap_steps=1,
    )  # fmt: skip
    ddp = DistributedDataParallel(model, process_group=outer.worker_group)
    user_loop(ddp, inner_opt(model.parameters()), batches(rank), outer, H * ROUNDS)
    fingerprints = [None] * 4
    dist.all_gather_object(fingerprints, (_digest(outer.global_params), _digest(list(model.parameters()))))
    streaming = {"params": outer.global_params, "bytes": outer.bytes_sent, "version": outer.version}
    saved[f"streaming {name}"] = {**streaming, "fingerprints": fingerprints}
# without DDP a worker's two processes drift apart: every process is told at the sync
torch.manual_seed(rank)
model = make_model()
outer = DistributedDiLoCo(model, inner_steps=H, procs_per_worker=2)
try:
    user_loop(model, inner_opt(model.parameters()), batches(rank), outer, H)
except RuntimeError as e:
    saved["no_ddp"] = told(e)
"""
    + END
)


def _torchrun(tmp_path, script: str, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    path = tmp_path / "user_train.py"
    path.write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return subprocess.run(
        [*cmd, str(path), *args], capture_output=True, text=True, timeout=100, cwd=tmp_path, env=ENV
    )


def _simulated(scope: dict, codec: str, batches: list, **streaming) -> DiLoCo:
    """The same run in the simulator: rank 0's model (seed 0), a worker for each of `batches`."""
    make_codec, make_outer = scope["CODECS"][codec]
    torch.manual_seed(0)
    sim = DiLoCo(
        scope["make_model"],
        scope["inner_opt"],
        batches,
        inner_steps=scope["H"],
        loss_fn=scope["loss_fn"],
        outer_opt=make_outer(),
        codec=make_codec(),
        **streaming,
    )
    for _ in range(scope["ROUNDS"]):
        sim.round()
    return sim


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict:
    """Every codec's run by two processes under torchrun: one launch for the module."""
    tmp_path = tmp_path_factory.mktemp("torchrun")
    proc = _torchrun(tmp_path, SCRIPT, str(tmp_path / "global.pt"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp_path / "global.pt")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["fp32", "sparseloco"])
def test_two_processes_equal_the_simulator_bit_for_bit(two_processes, codec):
    real = two_processes[codec]
    scope = _setup()
    sim = _simulated(scope, codec, [scope["batches"](r) for r in range(scope["K"])])
    assert real["version"] == sim.side.version == scope["ROUNDS"]
    assert real["bytes"] == sim.side.bytes_sent[0] > 0
    torch.manual_seed(0)  # the model both began from, as rank 0 built it
    start = [p.detach().clone() for p in scope["make_model"]().parameters()]
    moved = [not r.equal(s) for r, s in zip(real["params"], start)]
    assert all(moved), "the outer steps left a parameter where it started"
    assert all(r.equal(s) for r, s in zip(real["params"], sim.side.params, strict=True))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["fp32", "sparseloco"])
def test_streaming_diloco_in_two_processes_equals_the_simulators_bit_for_bit(two_processes, codec):
    """2 fragments, overlap 1 (each merge mixes half the local parameters in): θ_global, the
    rank's model (its worker 0's) and the bytes equal the simulator's Streaming DiLoCo."""
    real = two_processes[f"streaming {codec}"]
    scope = _setup()
    batches = [scope["batches"](r) for r in range(scope["K"])]
    sim = _simulated(scope, codec, batches, fragments=2, overlap_steps=1)
    assert real["version"] == sim.side.version == scope["ROUNDS"]
    assert real["bytes"] == sim.side.bytes_sent[0] > 0
    assert all(r.equal(s) for r, s in zip(real["params"], sim.side.params, strict=True))
    worker_0 = list(sim.pool.workers[0].model.parameters())
    assert all(r.equal(s) for r, s in zip(real["model"], worker_0, strict=True))
    plain = two_processes[codec]["params"]  # not plain DiLoCo's numbers
    assert not all(r.equal(p) for r, p in zip(real["params"], plain, strict=True))


def test_streaming_diloco_refuses_a_checkpoint_in_flight_and_sync(two_processes):
    assert "fragment 0's exchange is in flight at step 1" in two_processes["streaming refuses state_dict"]
    assert "call step() after every inner step" in two_processes["streaming refuses sync"]


@pytest.mark.timeout(120)
def test_dylu_in_two_processes_equals_the_simulators_dylu_bit_for_bit(two_processes):
    """Worker 1 twice as slow: both take H = 5 in round 1, then 5 and 2; the schedule positions
    are the simulator's (each worker crosses the round's stretch, lr_step + ⌊j · stride⌋), and so
    is θ_global after 4 rounds, weighted by the steps taken."""
    from diloco.core.dylu import RoundPlanner
    from diloco.core.outer_side import OuterSide
    from diloco.runtime.clock import Clock
    from diloco.runtime.distributed_dylu import UNBOUNDED
    from diloco.runtime.pool import InlinePool
    from diloco.runtime.sim import make_worker

    real, scope = two_processes["dylu"], _setup()
    H, K = scope["H"], scope["K"]
    fast, slow = real["positions"]
    assert len(fast) == 4 * H and len(slow) == H + 3 * 2  # 5, 5, 5, 5 and 5, 2, 2, 2 steps
    # round 2 starts at schedule step 10 / 2 = 5 and advances (5 + 2) / 2 = 3.5: strides 0.7, 1.75
    assert fast[H : 2 * H] == [5, 5, 6, 7, 7] and slow[H : H + 2] == [5, 6]
    assert fast[:H] == slow[:H] == [0, 1, 2, 3, 4]
    torch.manual_seed(0)
    side = OuterSide(scope["make_model"](), K, update=scope["Nesterov"](lr=0.7, momentum=0.9))
    workers = [
        make_worker(scope["make_model"], scope["inner_opt"], scope["batches"](w), loss_fn=scope["loss_fn"])
        for w in range(K)
    ]
    planner = RoundPlanner(K, H, UNBOUNDED)
    sim = DiLoCo.from_side(
        side, InlinePool(workers, threads=1), Clock([1.0, 2.0]), inner_steps=H, planner=planner
    )
    took = [sim.round().steps for _ in range(scope["ROUNDS"])]
    assert took == [[5, 5], [5, 2], [5, 2], [5, 2]] and real["version"] == sim.side.version == 4
    # a checkpoint of round 3 with worker 0 at step 2 and worker 1 at step 1 loads (each its own
    # count), and the loaded planner plans the same steps and schedule positions
    (fast_was, fast_now), (slow_was, slow_now) = two_processes["dylu resumed"]
    assert fast_was == fast_now == (5, fast[2 * H + 2]) and slow_was == slow_now == (2, slow[H + 2 + 1])
    assert all(r.equal(s) for r, s in zip(real["params"], sim.side.params, strict=True))


def test_processes_that_reach_the_sync_after_unequal_steps_are_told_so(two_processes):
    assert "different numbers of inner steps (0, 1 by rank)" in two_processes["unequal"]


def test_processes_whose_global_parameters_diverged_are_told_so_before_an_outer_step(two_processes):
    said = "θ_global on rank 1 differs from rank 0's at outer sync 1 (1 of 2 processes differ"
    assert all(said in told and "the processes diverged" in told for told in two_processes["diverged"])
    assert two_processes["diverged_version"] == 0
    version, (theta_0, theta_1) = two_processes["unchecked (False, False)"]
    assert version == 1 and not theta_0.equal(theta_1)  # stepped, and still apart
    told = two_processes["unchecked (True, False)"]
    assert all("check_global is off on some processes" in said for said in told)


def test_processes_given_checkpoints_of_another_round_or_process_are_told_so(two_processes):
    assert "given checkpoints of different rounds or θ_global" in two_processes["mismatch"]
    zero, one = two_processes["swapped"]
    assert "another process was given a checkpoint of another process" in zero
    assert (
        "this checkpoint is process 0 of worker 0 (of 2 workers of 1), this process is process 0 of worker 1"
        in one
    )


@pytest.mark.timeout(150)
def test_workers_of_two_processes_equal_two_simulated_workers_at_double_batch(tmp_path):
    """4 processes as 2 workers of 2 (DDP inside each): every process ends with the same θ_global
    and model; with fp32 it is the simulator with each worker's two half-batches as one batch, up
    to the rounding of DDP's averaged gradients, and so is Streaming DiLoCo's (2 fragments,
    overlap 1; SparseLoCo's too, whose non-leaders send placeholders of the message's size);
    without DDP every process is told at the sync."""
    proc = _torchrun(tmp_path, ISLANDS, str(tmp_path / "global.pt"), nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = torch.load(tmp_path / "global.pt")
    scope = _setup()

    def double(w):
        halves = scope["batches"](2 * w), scope["batches"](2 * w + 1)
        while True:
            (x0, y0), (x1, y1) = next(halves[0]), next(halves[1])
            yield torch.cat([x0, x1]), torch.cat([y0, y1])

    streaming = {"fragments": 2, "overlap_steps": 1}
    for name in [*scope["CODECS"], *(f"streaming {c}" for c in scope["CODECS"])]:
        real = saved[name]
        assert len({global_ for global_, _ in real["fingerprints"]}) == 1, name
        models = [model for _, model in real["fingerprints"]]
        assert models[0] == models[1] and models[2] == models[3], name  # a worker's processes agree
        if "streaming" not in name:  # (a streaming model is its own mixed with θ_global: apart from it)
            assert set(models) == {real["fingerprints"][0][0]}, name
        codec = name.split()[-1]
        sim = _simulated(scope, codec, [double(w) for w in range(2)], **(streaming if codec != name else {}))
        assert real["version"] == sim.side.version and real["bytes"] == sim.side.bytes_sent[0] > 0
        if codec == "fp32":  # (top-k's choices can flip on a rounding: compared across processes above)
            simulated = [p.detach() for p in sim.side.params]
            num = sum(
                float((a.detach() - b).pow(2).sum()) for a, b in zip(real["params"], simulated, strict=True)
            )
            den = sum(float(b.pow(2).sum()) for b in simulated)
            assert (num / den) ** 0.5 < 1e-5, (num / den) ** 0.5  # 8e-8 when written
    assert all("the processes of worker 0 hold different parameters" in said for said in saved["no_ddp"])


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


@pytest.fixture
def one_process(tmp_path):
    """A real gloo group of one process (this one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def _setup() -> dict:
    scope: dict = {}
    exec(SETUP, scope)
    return scope


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "streaming",
    [{}, {"fragments": 2, "overlap_steps": 1}, {"dylu": True}],
    ids=["plain", "streaming", "dylu"],
)
def test_a_run_checkpointed_mid_round_and_resumed_equals_one_that_never_stopped(
    tmp_path, one_process, streaming
):
    """state_dict() with the user's model and optimizer, mid-round and with SparseLoCo's error
    feedback, resumes to the same bits (one process: a gloo group of one); in Streaming DiLoCo
    too, between one fragment's merge and the next one's send."""
    scope = _setup()
    make_codec, make_outer = scope["CODECS"]["sparseloco"]
    H, steps = scope["H"], 4 * scope["H"]

    def train(from_step, until, saved=None):
        torch.manual_seed(0)
        model = scope["make_model"]()
        opt = scope["inner_opt"](model.parameters())
        outer = DistributedDiLoCo(
            model, inner_steps=H, outer_opt=make_outer(), codec=make_codec(), **streaming
        )
        data = scope["batches"](0)
        if saved is not None:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            outer.load_state_dict(saved["outer"])
        for _ in range(from_step):  # the data iterator where the checkpoint left it
            next(data)
        scope["user_loop"](model, opt, data, outer, until - from_step)
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "outer": outer.state_dict()}
        torch.save(state, tmp_path / "ckpt.pt")  # as a user would: to disk and back
        return torch.load(tmp_path / "ckpt.pt", weights_only=False), outer

    _, whole = train(0, steps)
    mid = H + 3  # inside the second round (streaming: fragment 0 merged at 2, fragment 1 sent at 4)
    saved, _ = train(0, mid)
    _, resumed = train(mid, steps, saved)
    if not streaming.get("fragments"):
        resumed.sync()  # right after a round's sync: nothing to send, θ_global stays where it is
    assert resumed.version == whole.version == 4
    assert resumed.bytes_sent == whole.bytes_sent
    assert all(a.equal(b) for a, b in zip(resumed.global_params, whole.global_params, strict=True))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fragments, overlap", [(2, 0), (1, 1)])
def test_streaming_without_overlap_or_fragments_equals_the_simulator(one_process, fragments, overlap):
    """τ = 0 (each fragment replaced, sent and merged at one step) and one fragment overlapped:
    one process against the simulator's one worker, bit for bit."""
    scope = _setup()
    make_codec, make_outer = scope["CODECS"]["fp32"]
    H = scope["H"]
    torch.manual_seed(0)
    model = scope["make_model"]()
    outer = DistributedDiLoCo(
        model, inner_steps=H, outer_opt=make_outer(), fragments=fragments, overlap_steps=overlap
    )
    synced = scope["user_loop"](
        model, scope["inner_opt"](model.parameters()), scope["batches"](0), outer, 3 * H
    )
    sim = _simulated(
        {**scope, "ROUNDS": 3}, "fp32", [scope["batches"](0)], fragments=fragments, overlap_steps=overlap
    )
    assert synced == [(step + 1) % H == 0 for step in range(3 * H)] and outer.version == sim.side.version == 3
    assert all(a.equal(b) for a, b in zip(outer.global_params, sim.side.params, strict=True))
    worker = list(sim.pool.workers[0].model.parameters())
    assert all(a.equal(b) for a, b in zip(model.parameters(), worker, strict=True))


@pytest.mark.timeout(60)
def test_streaming_refuses_another_schedules_checkpoint_and_a_load_in_flight_and_stops_on_a_nan(
    one_process,
):
    scope = _setup()
    model = scope["make_model"]()
    outer = DistributedDiLoCo(model, inner_steps=10, fragments=2)
    saved = outer.state_dict()
    other = DistributedDiLoCo(scope["make_model"](), inner_steps=10, fragments=2, overlap_steps=3)
    with pytest.raises(ValueError, match=r"checkpoint is of fragments=2, overlap_steps=0, α=0.0, this "
                       r"DistributedDiLoCo of fragments=2, overlap_steps=3, α=0.5"):  # fmt: skip
        other.load_state_dict(saved)
    plain = DistributedDiLoCo(scope["make_model"](), inner_steps=10).state_dict()
    with pytest.raises(ValueError, match="checkpoint is of plain DiLoCo"):
        other.load_state_dict(plain)
    with pytest.raises(ValueError, match="plain DiLoCo, this DistributedDiLoCo of plain DiLoCo with DyLU"):
        DistributedDiLoCo(scope["make_model"](), inner_steps=10, dylu=True).load_state_dict(plain)
    for _ in range(2):  # fragment 0 sent at step 2, merged at 5
        other.step()
    with pytest.raises(RuntimeError, match="fragment 0's exchange is in flight at step 2.*load_state_dict"):
        other.load_state_dict(saved)
    for _ in range(9):  # fragment 0 sent and merged at step 5; fragment 1 at step 10
        outer.step()
    with torch.no_grad():
        model[0].bias[0] = float("nan")  # fragment 0's, after its merge: in no exchange this round
    with pytest.raises(NonFinite, match="model of rank 0 holds a NaN or Inf at the end of round 1"):
        outer.step()


@pytest.mark.timeout(60)
def test_a_partial_round_syncs_and_a_nonfinite_outer_grad_stops_or_is_dropped(one_process):
    scope = _setup()
    model = scope["make_model"]()
    outer = DistributedDiLoCo(model, inner_steps=5, outer_opt=scope["SGD"](lr=1.0))
    outer.step()
    outer.step()
    with torch.no_grad():
        model[0].bias.add_(1.0)  # what two of the round's five steps did
    local = [p.detach().clone() for p in model.parameters()]
    outer.sync()  # at once: SGD at lr 1 with one worker makes θ_global the worker's parameters
    assert outer.version == 1 and outer.side.inner_step == 2
    assert all(torch.allclose(g, w, rtol=0, atol=1e-6) for g, w in zip(outer.global_params, local))

    before = [g.clone() for g in outer.global_params]
    with torch.no_grad():
        model[0].bias[0] = float("nan")
    outer.step()
    with pytest.raises(NonFinite, match="worker 0's outer_grad holds a NaN.*on_nonfinite='drop'"):
        outer.sync()
    assert all(a.equal(b) for a, b in zip(outer.global_params, before))

    model = scope["make_model"]()
    dropping = DistributedDiLoCo(model, inner_steps=1, on_nonfinite="drop")
    with torch.no_grad():
        model[0].bias[0] = float("nan")
    assert dropping.step() and dropping.dropped and dropping.version == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())  # θ_global back in the model


@pytest.mark.timeout(10)
def test_the_fingerprint_sees_every_bit_of_any_tensor():
    from diloco.runtime.distributed import _digest

    x = torch.arange(6.0).reshape(2, 3)
    assert _digest([x.t()]) == _digest([x.t().contiguous()])  # the values, not the memory layout
    assert _digest([torch.tensor(1.0)]) != _digest([torch.tensor(1.0).nextafter(torch.tensor(2.0))])
    bf16 = torch.ones(4, dtype=torch.bfloat16)
    assert _digest([bf16]) != _digest([bf16.clone().index_fill_(0, torch.tensor([3]), 0.5)])
    assert _digest([x, bf16]) == _digest([x, bf16.clone()])


@pytest.mark.timeout(30)
def test_a_model_with_a_scalar_parameter_syncs(one_process):
    model = torch.nn.Linear(2, 1)
    model.scale = torch.nn.Parameter(torch.tensor(2.0))  # 0-dimensional: fingerprinted too
    outer = DistributedDiLoCo(model, inner_steps=1, outer_opt=SGD(lr=1.0))
    with torch.no_grad():
        model.scale.add_(0.5)
    assert outer.step() and outer.version == 1
    assert outer.global_params[-1].item() == 2.5 == model.scale.item()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "wrong, says",
    [
        ({"inner_steps": 0}, "inner_steps must be at least 1"),
        ({"outer_opt": torch.optim.SGD}, "outer_opt must be an OuterOpt"),
        ({"bucket_mb": 0}, "bucket_mb must be positive"),
        ({"on_nonfinite": "skip"}, "on_nonfinite must be one of"),
        ({"procs_per_worker": 2}, "procs_per_worker must divide the group's 1 processes"),
        ({"procs_per_worker": 0}, "procs_per_worker must divide"),
        ({"ddp": True}, "not wrapped in DistributedDataParallel"),
        ({"fragments": 2, "on_nonfinite": "drop"}, "stops on a NaN: leave on_nonfinite at 'stop'"),
        ({"fragments": 6}, "fragments 6 is more than inner_steps 5.*use fragments=5 or fewer"),
        ({"fragments": 2, "overlap_steps": 2}, "overlap_steps 2 must be below inner_steps / fragments = 2"),
        ({"overlap_steps": 1, "mix_alpha": 1.0}, r"mix_alpha must lie in \[0, 1\), got 1.0: the weight"),
        ({"fragments": 0}, "fragments must be at least 1 and overlap_steps at least 0, got 0 and 0"),
        ({"fragments": 2}, "2 fragments need at least as many numbered blocks, the model has 0"),
        ({"fragments": 2, "dylu": True}, "dylu and Streaming DiLoCo"),
    ],
)
def test_wrong_arguments_are_named(one_process, wrong, says):
    model = torch.nn.Linear(2, 1)
    if wrong.pop("ddp", False):
        model = torch.nn.parallel.DistributedDataParallel(model)
    with pytest.raises(ValueError, match=says):
        DistributedDiLoCo(model, **{"inner_steps": 5, **wrong})
