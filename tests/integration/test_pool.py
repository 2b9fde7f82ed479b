"""A real ProcessPool whose worker process dies or whose worker raises: a WorkerDied that names
the process and the worker, within seconds, never a hang or a bare EOFError."""

import os
import signal
import time
from functools import partial

import pytest
import torch

from diloco.data.recipe import prepare_data
from diloco.errors import RESUME_OR, WorkerDied
from diloco.run.assemble import build_worker
from diloco.runtime.pool import ProcessPool

RESUME = RESUME_OR + "start the run again"  # run/loop.py names the run's command in it


@pytest.fixture
def cfg(tiny):
    return tiny(num_workers=4)


@pytest.fixture
def factory(cfg):
    return partial(build_worker, cfg=cfg, shards=prepare_data(cfg).shards)


def _close_quickly(pool):
    t = time.monotonic()
    pool.close()  # never hangs or raises, dead processes included
    assert time.monotonic() - t < 15


@pytest.mark.timeout(120)
def test_a_killed_worker_process_is_a_worker_died_naming_it(factory):
    pool = ProcessPool(factory, 4, 2)  # process 0: workers 0, 2; process 1: workers 1, 3
    try:
        for w in range(4):
            pool.submit(w, None, 2)
        results = [pool.result(w) for w in range(4)]
        assert all(r.steps == 2 and r.finite for r in results)
        pool.load_state_dict(pool.state_dict())

        pool.submit(1, None, 100_000)  # long enough to be killed in the middle
        pool.submit(3, None, 2)
        time.sleep(0.5)
        os.kill(pool._procs[1].pid, signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(WorkerDied) as e:
            pool.result(3)
        assert time.monotonic() - t < 5
        assert str(e.value) == (
            "worker process 1 (workers 1, 3) died with exit code -9 (SIGKILL) while computing worker 1; "
            + RESUME
        )
        with pytest.raises(WorkerDied, match="worker process 1 "):
            pool.submit(3, None, 2)
        with pytest.raises(WorkerDied, match="worker process 1 "):
            pool.state_dict()
        pool.submit(0, None, 1)  # the other process still works
        assert pool.result(0).steps == 1
    finally:
        _close_quickly(pool)


@pytest.mark.timeout(120)
def test_a_process_killed_while_idle_is_noticed_by_state_dict(factory):
    pool = ProcessPool(factory, 4, 2)
    try:
        pool.submit(0, None, 1)
        pool.result(0)  # process 0 is up and idle
        os.kill(pool._procs[0].pid, signal.SIGKILL)
        pool._procs[0].join(10)
        with pytest.raises(
            WorkerDied, match=r"^worker process 0 \(workers 0, 2\) died with exit code -9 \(SIGKILL\)"
        ):
            pool.state_dict()
    finally:
        _close_quickly(pool)


@pytest.mark.timeout(120)
def test_a_worker_that_raises_is_a_worker_died_naming_the_exception(cfg):
    pool = ProcessPool(partial(build_worker, cfg=cfg, shards=[]), 4, 2)  # builds, but has no batches
    try:
        pool.submit(2, None, 1)
        pool.submit(0, None, 1)
        with pytest.raises(WorkerDied) as e:
            pool.result(0)
        assert str(e.value).startswith(
            "worker process 0 (workers 0, 2) failed: computing worker 2 raised IndexError("
        )
        assert str(e.value).endswith(RESUME)
        start = [torch.zeros(1)]  # not the model's shapes
        pool.submit(1, start, 1)
        with pytest.raises(
            WorkerDied, match=r"worker process 1 \(workers 1, 3\) failed: computing worker 1 raised"
        ):
            pool.result(1)
    finally:
        _close_quickly(pool)


@pytest.mark.timeout(120)
def test_a_factory_that_raises_is_a_worker_died_naming_the_worker(cfg):
    tiny_shards = [torch.zeros(3, dtype=torch.long)] * 4  # too small for one batch
    pool = ProcessPool(partial(build_worker, cfg=cfg, shards=tiny_shards), 4, 2)
    try:
        pool.submit(1, None, 1)
        with pytest.raises(
            WorkerDied, match=r"^worker process 1 \(workers 1, 3\) failed: building worker 1 raised"
        ):
            pool.result(1)
    finally:
        _close_quickly(pool)
