"""The simulator's DiLoCo against trusted references: plain AdamW, identical workers."""

from functools import partial

import pytest
import torch

from diloco.config import ModelConfig, TrainConfig
from diloco.core.outer import SGD
from diloco.data.batches import ShardSampler
from diloco.data.recipe import prepare_data
from diloco.model.gpt import GPT
from diloco.runtime.data_parallel import DataParallel
from diloco.runtime.sim import DiLoCo

TINY = ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=32)


def _tokens():
    return prepare_data(TrainConfig(method="single")).shards[0]


def _sampler(seed=1):
    return ShardSampler(_tokens(), batch_size=4, seq_len=32, seed=seed)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_one_worker_one_step_outer_sgd_lr1_is_plain_adamw(dtype, atol):
    # θ − (θ − θ_local) equals θ_local only up to one rounding, and AdamW's normalisation turns
    # such a rounding in a near-zero gradient into an lr-sized step; so the strict check runs in
    # float64 (1e-9, far inside the 1e-6) and float32 gets a looser bound.
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        trainer = DiLoCo(partial(GPT, TINY), _adamw, [_sampler()], inner_steps=1, outer_opt=SGD(lr=1.0))
        torch.manual_seed(0)
        plain = GPT(TINY)
    finally:
        torch.set_default_dtype(torch.float32)
    opt = _adamw(list(plain.parameters()))
    batches = _sampler()
    for _ in range(10):
        trainer.round()
        loss = plain(*next(batches))
        opt.zero_grad()
        loss.backward()
        opt.step()
        for ours, ref in zip(trainer.params, plain.parameters()):
            torch.testing.assert_close(ours, ref.detach(), rtol=0, atol=atol)


def test_identical_workers_give_identical_outer_grads_and_their_average():
    torch.manual_seed(0)
    k = 3
    trainer = DiLoCo(partial(GPT, TINY), _adamw, [_sampler(7) for _ in range(k)], inner_steps=3)
    start = [p.detach().clone() for p in trainer.params]
    grads = [w.run(start, 3).outer_grad for w in trainer.workers]
    for g in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], g))
    from diloco.core.outer import weighted_average

    avg = weighted_average(grads, trainer.weights)
    for a, b in zip(avg, grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    assert any(g.abs().max() > 0 for g in grads[0])


def test_identical_workers_through_round_step_like_one_worker():
    # k identical workers' round equals a one-worker round: the average of equal outer_grads
    # is that outer_grad, whatever passes through the codec and the averaging.
    torch.manual_seed(0)
    many = DiLoCo(partial(GPT, TINY), _adamw, [_sampler(7) for _ in range(4)], inner_steps=3)
    torch.manual_seed(0)
    one = DiLoCo(partial(GPT, TINY), _adamw, [_sampler(7)], inner_steps=3)
    for _ in range(2):
        many.round(), one.round()
    for a, b in zip(many.params, one.params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_data_parallel_equals_mean_gradient_step():
    torch.manual_seed(0)
    dp = DataParallel(partial(GPT, TINY), _adamw, [_sampler(1), _sampler(2)], inner_steps=1)
    torch.manual_seed(0)
    ref = GPT(TINY)
    opt = _adamw(list(ref.parameters()))
    b1, b2 = _sampler(1), _sampler(2)
    dp.round()
    loss = (ref(*next(b1)) + ref(*next(b2))) / 2
    loss.backward()
    opt.step()
    for ours, theirs in zip(dp.params, ref.parameters()):
        torch.testing.assert_close(ours, theirs.detach(), rtol=0, atol=1e-7)
    assert dp.version == 0
    assert dp.bytes_sent == [sum(p.numel() * 4 for p in ref.parameters())] * 2


def test_bytes_are_message_sizes():
    torch.manual_seed(0)
    trainer = DiLoCo(partial(GPT, TINY), _adamw, [_sampler(1), _sampler(2)], inner_steps=2)
    size = sum(p.numel() for p in trainer.params) * 4
    trainer.round()
    trainer.round()
    assert trainer.bytes_sent == [2 * size, 2 * size]
    assert trainer.bytes_received == [2 * size, 2 * size]


def test_dropped_outer_grads_leave_the_worker_on_its_own_parameters():
    from diloco.core.membership import outer_grad_dropped

    torch.manual_seed(0)
    trainer = DiLoCo(
        partial(GPT, TINY), _adamw, [_sampler(1), _sampler(2)], inner_steps=2, drop_prob=0.5, seed=1
    )
    drops = [[outer_grad_dropped(1, r, w, 0.5) for w in range(2)] for r in range(6)]
    # seed 1 draws: round 2 keeps both, round 4 loses both, round 5 loses worker 1's
    assert drops[2] == [False, False] and drops[4] == [True, True] and drops[5] == [False, True]
    for r in range(6):
        before = [p.detach().clone() for p in trainer.params]
        version = trainer.version
        trainer.round()
        assert trainer.own_start == drops[r]
        if all(drops[r]):  # every outer_grad lost: no update
            assert trainer.version == version and all(
                torch.equal(a, b) for a, b in zip(before, trainer.params)
            )
        else:
            assert trainer.version == version + 1
    # worker 1 keeps its own parameters, not the new global ones, and starts from them next
    own = [p.detach().clone() for p in trainer.workers[1].params]
    assert not all(torch.equal(a, b) for a, b in zip(own, trainer.params))
    trainer.drop_prob = 0.0
    received = trainer.bytes_received[1]
    result_start = [p.detach().clone() for p in trainer.workers[1].params]
    trainer.round()
    assert trainer.bytes_received[1] == received  # it did not pull the global parameters
    assert not all(torch.equal(a, b) for a, b in zip(result_start, trainer.workers[1].params))


def test_inactive_workers_neither_train_nor_count():
    torch.manual_seed(0)
    trainer = DiLoCo(partial(GPT, TINY), _adamw, [_sampler(1), _sampler(2)], inner_steps=2)
    torch.manual_seed(0)
    alone = DiLoCo(partial(GPT, TINY), _adamw, [_sampler(1)], inner_steps=2)
    trainer.round(active=1)
    alone.round()
    assert all(torch.equal(a, b) for a, b in zip(trainer.params, alone.params))  # weight renormalised to 1
    assert trainer.workers[1].step == 0 and trainer.total_steps == 2 and trainer.bytes_sent[1] == 0


def test_a_worker_joining_mid_run_takes_the_runs_lr_not_a_fresh_warm_up():
    # The round drives every worker's lr schedule: a worker that first trains in round 3 runs
    # its steps at the run's steps 4 and 5 (warm-up over, cosine half way), as worker 0 does.
    from diloco.core.lr import warmup_cosine

    schedule = partial(warmup_cosine, lr=1e-3, warmup_steps=2, total_steps=8, min_lr_ratio=0.1)
    torch.manual_seed(0)
    trainer = DiLoCo(
        partial(GPT, TINY), _adamw, [_sampler(1), _sampler(2)], inner_steps=2, lr_schedule=schedule
    )
    trainer.round(active=1)
    trainer.round(active=1)
    assert trainer.workers[1].step == 0
    trainer.round()
    lrs = [w.optimizer.param_groups[0]["lr"] for w in trainer.workers]
    assert lrs == [schedule(5), schedule(5)]  # its own step count would give schedule(1) = 1e-3
    assert schedule(5) < schedule(1)
    assert trainer.workers[1].step == 2


def test_a_worker_rejoining_after_inactivity_starts_from_the_global_parameters():
    torch.manual_seed(0)
    trainer = DiLoCo(partial(GPT, TINY), _adamw, [_sampler(1), _sampler(2)], inner_steps=2)
    trainer.own_start[1] = True  # as if its last outer_grad had been dropped
    trainer.round(active=1)
    assert trainer.own_start == [False, False]
