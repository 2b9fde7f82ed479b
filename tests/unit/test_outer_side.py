"""The outer side against trusted references: outer.py's weighted average and Nesterov step,
byte counts by hand, drops and non-finite outer_grads, its state, and codec messages."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.core.codec import Encoded, Fp32Codec
from diloco.core.outer import Nesterov, kept_weights, weighted_average
from diloco.core.outer_side import OuterSide
from diloco.errors import NonFinite


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _grads(side, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in side.params]


class GatheredFp32(Fp32Codec):
    """fp32 values, but declared not summable: the outer side must decode then weight."""

    summable = False


@pytest.mark.timeout(10)
def test_equal_weights_give_outer_py_bit_for_bit():
    side = OuterSide(_model(), 4)
    ref_model, ref_opt = _model(), Nesterov()
    ref = list(ref_model.parameters())
    grads = [_grads(side, w) for w in range(4)]
    _round(side, grads)
    ref_opt.step(ref, weighted_average(grads, [0.25] * 4))
    assert all(torch.equal(a, b) for a, b in zip(side.params, ref))


def _round(side, grads, finite=None, active=None):
    starts = side.begin_round(active)
    messages = []
    for w in range(len(starts)):
        message = side.codec.encode(grads[w])
        ok = side.report(w, message.nbytes, True if finite is None else finite[w])
        messages.append(message if ok else None)
    side.end_round(side.reduce(messages), inner_steps=5)
    return starts


@pytest.mark.timeout(10)
@pytest.mark.parametrize("codec", [Fp32Codec(), GatheredFp32()])
def test_a_round_is_the_nesterov_step_on_the_weighted_average(codec):
    weights = [0.5, 0.3, 0.2]
    side = OuterSide(_model(), 3, update=Nesterov(0.7, 0.9), codec=codec, weights=weights)
    ref_model, ref_opt = _model(), Nesterov(0.7, 0.9)
    ref = [p for p in ref_model.parameters()]
    for r in range(3):
        grads = [_grads(side, 10 * r + w) for w in range(3)]
        _round(side, grads)
        ref_opt.step(ref, weighted_average(grads, weights))
        # outer.py may fuse w·g into the sum; the outer side rounds w·g first, as an all-reduce
        # of weighted contributions does: equal up to one rounding per term
        for a, b in zip(side.params, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    size = sum(p.numel() for p in side.params) * 4
    assert side.version == 3 and side.rounds_done == 3 and side.inner_step == 15 and side.total_steps == 45
    assert side.bytes_sent == [3 * size] * 3 and side.bytes_received == [3 * size] * 3


@pytest.mark.timeout(10)
def test_dropped_and_inactive_workers_rescale_the_kept_weights():
    side = OuterSide(_model(), 3, weights=[0.5, 0.3, 0.2], drop_prob=0.5, seed=1)
    from diloco.core.membership import outer_grad_dropped

    ref_model, ref_opt = _model(), Nesterov()
    ref = list(ref_model.parameters())
    for r in range(6):
        grads = [_grads(side, 10 * r + w) for w in range(2)]
        dropped = [outer_grad_dropped(1, r, w, 0.5) for w in range(2)]
        version = side.version
        _round(side, grads, active=2)
        kept = [not d for d in dropped]
        if any(kept):
            kept_grads = [g for g, k in zip(grads, kept) if k]
            ref_opt.step(ref, weighted_average(kept_grads, kept_weights(side.weights, kept)))
            assert side.version == version + 1
        assert side.own_start == dropped + [False]
        for a, b in zip(side.params, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("after_drop", ["own", "global"])
def test_after_a_drop_the_worker_goes_on_from_its_own_or_the_global_parameters(after_drop):
    from diloco.core.membership import outer_grad_dropped

    side = OuterSide(_model(), 2, drop_prob=0.5, seed=1, after_drop=after_drop)
    size = sum(p.numel() for p in side.params) * 4
    dropped_before = [False, False]
    for r in range(6):
        received = list(side.bytes_received)
        starts = _round(side, [_grads(side, 10 * r + w) for w in range(2)])
        # "own": a worker whose last outer_grad was dropped neither pulls nor starts from θ
        own = [d and after_drop == "own" for d in dropped_before]
        assert starts == [not o for o in own]
        assert [b - a for a, b in zip(received, side.bytes_received)] == [0 if o else size for o in own]
        dropped_before = [outer_grad_dropped(1, r, w, 0.5) for w in range(2)]
        assert side.own_start == [d and after_drop == "own" for d in dropped_before]
    with pytest.raises(ValueError, match="after_drop must be one of"):
        OuterSide(_model(), 2, after_drop="mine")


@pytest.mark.timeout(10)
def test_a_non_finite_outer_grad_stops_the_run_or_is_dropped():
    side = OuterSide(_model(), 2)
    before = [p.detach().clone() for p in side.params]
    with pytest.raises(NonFinite, match="worker 1 produced a non-finite .* in round 1"):
        _round(side, [_grads(side, 0), _grads(side, 1)], finite=[True, False])
    assert all(torch.equal(a, b) for a, b in zip(side.params, before)) and side.version == 0
    side = OuterSide(_model(), 2, on_nonfinite="drop")
    grads = [_grads(side, 0), [torch.full_like(p, float("nan")) for p in side.params]]
    _round(side, grads, finite=[True, False])
    assert side.nonfinite_dropped == 1 and side.own_start == [False, False]  # it restarts from θ
    assert all(torch.isfinite(p).all() for p in side.params) and side.version == 1


@pytest.mark.timeout(10)
def test_state_round_trips_and_counts_the_same():
    a = OuterSide(_model(), 2, drop_prob=0.3, seed=4)
    for r in range(3):
        _round(a, [_grads(a, r), _grads(a, r + 100)])
    b = OuterSide(_model(seed=9), 2, drop_prob=0.3, seed=4)
    b.load_state_dict(a.state_dict())
    for r in range(3, 5):
        _round(a, [_grads(a, r), _grads(a, r + 100)])
        _round(b, [_grads(b, r), _grads(b, r + 100)])
    assert all(torch.equal(x, y) for x, y in zip(a.params, b.params))
    assert a.state_dict()["bytes_sent"] == b.state_dict()["bytes_sent"] and a.own_start == b.own_start


@pytest.mark.timeout(10)
def test_a_message_becomes_bytes_and_back_exactly():
    tensors = [torch.randn(3, 4), torch.randn(5)]
    message = Fp32Codec().encode(tensors)
    back = Encoded.from_bytes(message.to_bytes())
    assert back.codec == "fp32" and back.nbytes == 17 * 4
    assert all(torch.equal(x, y) for x, y in zip(back.payload, tensors))
    from diloco.errors import UserError

    with pytest.raises(UserError, match="not a valid encoded message"):
        Encoded.from_bytes(b"\x05\x00garbage")
    with pytest.raises(UserError, match="encoded with codec 'int8'"):
        Fp32Codec().decode(Encoded("int8", tensors, 1))


def _added_peak_mb(*runs: tuple, tmp: Path | None = None) -> list[float]:
    """The peak MB each of `runs` ((what, k) or (what,)) adds, each in a fresh process of its
    own, all started at once (each measures only itself)."""
    script = Path(__file__).with_name("_outer_memory.py")
    # every allocation of 1 MB or more its own mapping, returned when freed: the peak counts what
    # the code holds at once, not what glibc's heap kept from earlier frees
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), what, str(k), str(tmp)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for what, k in ((run[0], run[1] if len(run) > 1 else 2) for run in runs)
    ]
    outs = [proc.communicate() for proc in procs]
    for proc, (_, err) in zip(procs, outs):
        assert proc.returncode == 0, err
    return [float(out.split()[-1]) for out, _ in outs]


@pytest.mark.timeout(60)
def test_a_round_and_an_async_apply_hold_one_decoded_tensor_not_whole_messages():
    # a 64 MB model (8 tensors of 8 MB): the server's memory at 150m x 16 depends on this
    one, eight, parts, whole = _added_peak_mb(("reduce", 1), ("reduce", 8), ("parts",), ("whole",))
    assert eight < one + 24, (one, eight)  # k decoded contributions at once would add 7 x 64 MB
    assert parts < 40 < 56 < whole, (parts, whole)  # decoded whole: the 64 MB model in float32


@pytest.mark.timeout(60)
def test_an_async_apply_lets_go_of_a_mapped_push_files_pages_as_it_goes(tmp_path):
    # the server reads an fp32 push in place from its file: each part's pages go once applied
    released, kept = _added_peak_mb(("mapped",), ("mapped_kept",), tmp=tmp_path)
    assert released < 32 < 56 < kept, (released, kept)
