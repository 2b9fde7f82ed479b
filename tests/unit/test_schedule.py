import math

import pytest

from diloco.core.lr import warmup_cosine


def lr(step):
    return warmup_cosine(step, lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)


def test_warmup_is_linear_from_the_first_step():
    assert lr(0) == pytest.approx(0.1)
    assert lr(4) == pytest.approx(0.5)
    assert lr(9) == pytest.approx(1.0)


def test_cosine_midpoint_and_floor():
    assert lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.1 + 0.5 * 0.9 * (1 + math.cos(math.pi * 0.5)))
    assert lr(110) == pytest.approx(0.1)
    assert lr(500) == pytest.approx(0.1)  # past the plan the floor holds, never zero


def test_worker_lr_follows_a_given_shard_step():
    import torch

    from diloco.core.inner import Worker

    w = torch.nn.Linear(2, 1)
    seen = []

    def schedule(step):
        seen.append(step)
        return 0.1

    worker = Worker(
        w,
        torch.optim.SGD(w.parameters(), lr=1.0),
        iter([None] * 10),
        loss_fn=lambda m, _: m.weight.sum(),
        lr_schedule=schedule,
    )
    worker.run([p.detach() for p in w.parameters()], 3, lr_step=40)
    worker.run([p.detach() for p in w.parameters()], 2)
    assert seen == [40, 41, 42, 3, 4]  # the shard's count when given, else the worker's own
