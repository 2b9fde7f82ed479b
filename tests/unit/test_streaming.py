"""Streaming DiLoCo against trusted references: its schedule by hand, one fragment and no overlap
equal to plain DiLoCo bit for bit, fragments with overlap equal to a hand-written loop of the
algorithm on torch.optim, and the simulated clock hiding communication by hand."""

import itertools

import pytest
import torch
import torch.nn as nn

from diloco.config import TrainConfig
from diloco.core.codec import build_codec
from diloco.core.outer import Fragmented, Nesterov
from diloco.core.outer_side import OuterSide
from diloco.core.streaming import Schedule, Segment, fragment_groups
from diloco.model.gpt import GPT
from diloco.runtime.clock import Clock
from diloco.runtime.pool import InlinePool
from diloco.runtime.sim import DiLoCo, make_worker

H, K = 6, 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))


def _loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _batches(w):
    g = torch.Generator().manual_seed(100 + w)
    while True:
        yield torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)


def _opt(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


@pytest.mark.timeout(10)
def test_segments_by_hand():
    assert Schedule(50, 1, 0).segments() == [Segment(None, 50, 0), Segment(0, 0, None)]
    # P = 2, τ = 5: fragment 0 leaves at 20 and merges at 25, fragment 1 leaves at 45 and merges at 50
    assert Schedule(50, 2, 5).segments() == [
        Segment(None, 20, 0),
        Segment(None, 5, None),
        Segment(0, 20, 1),
        Segment(None, 5, None),
        Segment(1, 0, None),
    ]
    assert Schedule(50, 2, 0).segments() == [Segment(None, 25, 0), Segment(0, 25, 1), Segment(1, 0, None)]
    for H_, P, tau in itertools.product((7, 10, 50), (1, 2, 3, 4), (0, 1, 2)):
        if H_ // P - tau < 1:
            with pytest.raises(ValueError):
                Schedule(H_, P, tau)
            continue
        segs = Schedule(H_, P, tau).segments()
        assert sum(s.steps for s in segs) == H_
        assert sorted(s.send for s in segs if s.send is not None) == list(range(P))
        assert sorted(s.merge for s in segs if s.merge is not None) == list(range(P))
        step, sent = 0, {}
        for s in segs:  # a fragment merges τ inner steps after it was sent
            if s.merge is not None:
                assert step - sent[s.merge] == tau
            step += s.steps
            if s.send is not None:
                sent[s.send] = step


@pytest.mark.timeout(10)
def test_fragments_are_strided_blocks_with_embeddings_first_and_the_final_norm_last():
    model = GPT(TrainConfig().model)
    names = [n for n, p in model.named_parameters()]
    groups = fragment_groups(model, 2)
    assert sorted(i for g in groups for i in g) == list(range(len(names)))
    first = {names[i] for i in groups[0]}
    assert {"tok_emb.weight", "pos_emb.weight"} <= first and "ln_f.weight" not in first
    blocks = [{n.split(".")[1] for n in (names[i] for i in g) if n.startswith("blocks.")} for g in groups]
    assert blocks == [{"0", "2"}, {"1", "3"}]
    assert "ln_f.bias" in {names[i] for i in groups[1]}
    with pytest.raises(ValueError, match="numbered blocks"):
        fragment_groups(model, 5)


def _trainer(schedule, codec=None, clock=None, download=None):
    model = _model()
    P = schedule.fragments if schedule else 1
    pool = InlinePool(
        [make_worker(_model, _opt, _batches(w), loss_fn=_loss, codec=codec) for w in range(K)], threads=1
    )
    update = Fragmented([Nesterov() for _ in range(P)]) if schedule else Nesterov()
    side = OuterSide(model, K, update=update, codec=codec, download=download)
    return DiLoCo.from_side(side, pool, clock or Clock([1.0] * K), inner_steps=H, schedule=schedule)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("codec", ["fp32", "fp4"])
def test_one_fragment_without_overlap_is_plain_diloco_bit_for_bit(codec):
    plain = _trainer(None, build_codec(codec, error_feedback=codec != "fp32"))
    streaming = _trainer(Schedule(H, 1, 0), build_codec(codec, error_feedback=codec != "fp32"))
    for _ in range(3):
        a, b = plain.round(), streaming.round()
        assert a.losses == b.losses
    assert all(torch.equal(x, y) for x, y in zip(plain.params, streaming.params, strict=True))
    assert plain.bytes_sent == streaming.bytes_sent
    # plain DiLoCo pulls θ at the start of each round; streaming merges each fragment as it lands,
    # so it has also received the last round's result (what plain would pull next)
    pull = plain.side.pull_bytes
    assert [b + pull for b in plain.bytes_received] == streaming.bytes_received
    assert plain.version == streaming.version == 3 and plain.sim_time_s == streaming.sim_time_s


def _reference(P, tau, alpha, rounds):
    """Streaming DiLoCo written out step by step: K replicas on torch.optim.AdamW, outer Nesterov
    per fragment as in torch.optim.SGD(nesterov=True, momentum=0.9, lr=0.7)."""
    glob = _model()
    groups = fragment_groups(glob, P)
    params = list(glob.parameters())
    outer = [torch.optim.SGD([params[i] for i in g], lr=0.7, momentum=0.9, nesterov=True) for g in groups]
    replicas = [_model() for _ in range(K)]
    for r in replicas:
        r.load_state_dict(glob.state_dict())
    opts = [_opt(list(r.parameters())) for r in replicas]
    data = [_batches(w) for w in range(K)]
    anchor = [p.detach().clone() for p in params]
    sends = {(p + 1) * H // P - tau: p for p in range(P)}
    merges = {(p + 1) * H // P: p for p in range(P)}
    for _ in range(rounds):
        for step in range(1, H + 1):
            for r, opt, it in zip(replicas, opts, data, strict=True):
                opt.zero_grad()
                _loss(r, next(it)).backward()
                opt.step()
            if step in sends:
                g = groups[sends[step]]
                with torch.no_grad():
                    for i in g:
                        delta = sum(anchor[i] - list(r.parameters())[i] for r in replicas) / K
                        params[i].grad = delta
                outer[sends[step]].step()
            if step in merges:
                with torch.no_grad():
                    for i in groups[merges[step]]:
                        anchor[i] = params[i].detach().clone()
                        for r in replicas:
                            q = list(r.parameters())[i]
                            q.copy_(alpha * q + (1 - alpha) * params[i] if tau else params[i])
    return params


@pytest.mark.timeout(30)
@pytest.mark.parametrize("P,tau", [(2, 0), (2, 2), (3, 1)])
def test_fragments_with_overlap_follow_the_algorithm_written_out(P, tau):
    streaming = _trainer(Schedule(H, P, tau, 0.5))
    for _ in range(3):
        streaming.round()
    ref = _reference(P, tau, 0.5, rounds=3)
    for a, b in zip(streaming.params, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # each fragment sent once a round: the whole model's bytes, in P messages
    assert streaming.bytes_sent == [3 * streaming.side.param_bytes] * K


@pytest.mark.timeout(30)
def test_the_clock_charges_only_communication_the_overlap_does_not_hide():
    # 1 s a step, 3 s a message (latency only): H = 6, P = 2
    def run(tau, latency_ms):
        trainer = _trainer(Schedule(H, 2, tau), clock=Clock([1.0] * K, latency_ms=latency_ms))
        trainer.round()
        return trainer.sim_time_s

    # no overlap: pull 3, then per fragment 3 steps + push 3 + download 3: 3 + 2 × 9
    assert run(0, 3000) == pytest.approx(21.0)
    # τ = 2: fragment 0 leaves at step 1 (t = 4) and lands at 10; the worker reaches step 3 at
    # t = 6 and waits to 10; fragment 1 leaves at step 4 (t = 11), lands at 17; step 6 at t = 13
    assert run(2, 3000) == pytest.approx(17.0)
    # 1 s messages are hidden under 2 steps: only the first pull shows
    assert run(2, 1000) == pytest.approx(1.0 + H)


@pytest.mark.timeout(30)
def test_a_bf16_download_starts_every_fragment_from_bf16_parameters():
    trainer = _trainer(Schedule(H, 2, 1), download=build_codec("bf16"))
    trainer.round()
    worker = trainer.workers[0]
    assert all(torch.equal(a, p.to(torch.bfloat16).float()) for a, p in zip(worker.anchor, trainer.params))
    # the first pull and each fragment's download at 2 bytes a value
    assert trainer.bytes_received == [2 * 2 * trainer.side.param_bytes // 4] * K
