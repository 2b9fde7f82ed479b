"""The assembler (run/assemble.py): one TrainConfig gives every runtime the same initial global
parameters, the outer side it builds once (codecs, outer optimizer or async rule, weights), and
the pool, clock and schedule its settings say."""

import dataclasses
import socket

import pytest
import torch
from conftest import tiny_config

from diloco.config import AsyncConfig, SimConfig
from diloco.core.async_rules import DelayedNesterov
from diloco.core.codec import Bf16Codec, Int8Codec
from diloco.core.outer import Fragmented, Nesterov
from diloco.core.streaming import Schedule
from diloco.data.recipe import prepare_data
from diloco.model.init import fit_model, initial_model
from diloco.run import assemble
from diloco.runtime.clock import HETEROGENEITY, profile
from diloco.runtime.data_parallel import DataParallel
from diloco.runtime.pool import InlinePool
from diloco.runtime.sim import DiLoCo


def _built(cfg, init=None, **kwargs):
    """The runtime `train()` builds for `cfg` (its model fitted to the tokenizer), and its data."""
    data = prepare_data(cfg, progress=False)
    cfg = fit_model(cfg, data.tokenizer)
    return cfg, data, assemble.build_trainer(cfg, data, init, **kwargs)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "overrides",
    [
        {"method": "diloco"},
        {"method": "diloco", "fragments": 2},
        {"method": "async"},
        {"method": "dp"},
        {"method": "single", "num_workers": 1},
    ],
    ids=["diloco", "streaming", "async", "dp", "single"],
)
def test_every_method_starts_from_the_global_parameters_of_its_seed(tmp_path, overrides):
    cfg, _, trainer = _built(tiny_config(tmp_path, seed=3, **overrides))
    assert _same(_state(trainer.side.model), _state(initial_model(cfg, None)))
    other = _state(initial_model(dataclasses.replace(cfg, seed=4), None))
    assert not _same(_state(trainer.side.model), other)


def test_the_server_runtime_starts_from_the_seed_and_from_init_as_the_simulator_does(tmp_path):
    sim_cfg, data, sim = _built(tiny_config(tmp_path, seed=5))
    theta = _state(sim.side.model)
    run_dir = tmp_path / "served"
    run_dir.mkdir()
    cfg = dataclasses.replace(sim_cfg, runtime="server", sim=SimConfig(), checkpoint_every=1)
    server = assemble.build_trainer(cfg, data, run_dir=run_dir)
    try:
        assert _same(_state(server.side.model), theta)
        assert server.side.weights == sim.side.weights == data.weights
    finally:
        server.close(clean=False)
    init = {k: torch.full_like(v, 0.25) for k, v in theta.items()}  # what --init-from loads
    started = assemble.build_trainer(sim_cfg, data, init)
    assert _same(_state(started.side.model), init)


def _recorded(monkeypatch, name: str) -> list:
    """Every object assemble.`name` returns from now on."""
    made, build = [], getattr(assemble, name)

    def record(cfg):
        made.append(build(cfg))
        return made[-1]

    monkeypatch.setattr(assemble, name, record)
    return made


def test_the_codecs_are_built_once_per_holder_and_are_the_objects_the_runtime_uses(tmp_path, monkeypatch):
    uploads, downloads = _recorded(monkeypatch, "upload_codec"), _recorded(monkeypatch, "download_codec")
    cfg = tiny_config(tmp_path, num_workers=3, codec="int8", error_feedback=True, download_codec="bf16")
    _, _, trainer = _built(cfg)
    side = trainer.side
    # one download codec (the outer side's); one outer_grad codec for the side, one per worker
    assert downloads == [side.download] and isinstance(side.download, Bf16Codec)
    assert len(uploads) == 1 + 3 and side.codec is uploads[0] and isinstance(side.codec, Int8Codec)
    assert [w.codec for w in trainer.workers] == uploads[1:]
    assert len({id(c) for c in uploads}) == 4  # error feedback: no worker shares another's codec


def test_the_pool_and_the_clock_follow_the_config(tmp_path):
    sim = SimConfig(procs=1, heterogeneity="very", speed_jitter=0.1, bandwidth_mbps=100.0, latency_ms=20.0)
    cfg, _, trainer = _built(tiny_config(tmp_path, num_workers=3, seed=7, sim=sim))
    assert isinstance(trainer, DiLoCo) and isinstance(trainer.pool, InlinePool)
    assert len(trainer.pool) == trainer.num_workers == 3
    clock = trainer.clock
    assert clock.step_s == profile("very", 3) and clock.step_s[-1] == HETEROGENEITY["very"]
    assert (clock.jitter, clock.bandwidth_mbps, clock.latency_ms, clock.seed) == (0.1, 100.0, 20.0, 7)
    assert trainer.inner_steps == cfg.inner_steps
    # the baselines compute on the first k speeds of the same clock, messages priced alike
    _, _, dp = _built(
        tiny_config(tmp_path, method="dp", num_workers=3, sim=SimConfig(speeds=(1.0, 2.0, 3.0)))
    )
    assert isinstance(dp, DataParallel) and dp.clock.step_s == [1.0, 2.0, 3.0]


def test_streaming_gets_one_outer_optimizer_per_fragment_and_the_schedule(tmp_path):
    cfg, _, trainer = _built(tiny_config(tmp_path, fragments=2, overlap_steps=1, mix_alpha=0.25))
    update = trainer.side.update
    assert isinstance(update, Fragmented) and len(update.parts) == 2
    assert update.parts[0] is not update.parts[1] and all(isinstance(p, Nesterov) for p in update.parts)
    assert trainer.schedule == Schedule(cfg.inner_steps, 2, 1, 0.25)
    _, _, plain = _built(tiny_config(tmp_path))
    assert plain.schedule is None and isinstance(plain.side.update, Nesterov)


def test_async_gets_its_rule_and_uniform_weights(tmp_path):
    cfg = tiny_config(tmp_path, method="async", async_=AsyncConfig(rule="dn"), num_workers=3)
    _, data, trainer = _built(cfg)
    assert isinstance(trainer.side.update, DelayedNesterov) and trainer.side.update is trainer.rule
    assert trainer.side.weights == [1 / 3] * 3
    assert trainer.step_budget == 3 * cfg.total_inner_steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_the_collective_runtime_takes_the_outer_side_the_assembler_built(tmp_path, monkeypatch):
    """A torchrun job of one rank, in this process: the side the collective runtime trains is the
    one build_side made (same θ as the simulator's), and it builds no codec of its own."""
    import torch.distributed as dist

    from diloco.runtime import torchrun

    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    sides, build_side = [], assemble.build_side

    def record_side(*args, **kwargs):
        sides.append(build_side(*args, **kwargs))
        return sides[-1]

    monkeypatch.setattr(assemble, "build_side", record_side)
    downloads = _recorded(monkeypatch, "download_codec")
    cfg = tiny_config(tmp_path, runtime="collective", num_workers=1, seed=2, timeout_s=30.0, sim=SimConfig())
    data = prepare_data(cfg, progress=False)
    cfg = fit_model(cfg, data.tokenizer)
    torchrun.init(cfg)
    try:
        trainer = assemble.build_trainer(cfg, data)
        assert sides == [trainer.side] and downloads == [trainer.side.download]
        assert _same(_state(trainer.side.model), _state(initial_model(cfg, None)))
        assert trainer.schedule is None and trainer.worker_id == 0
        trainer.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
