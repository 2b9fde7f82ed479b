import pytest
import torch

from diloco.core.async_rules import Buffer, DelayComp, DelayedNesterov, Naive, Poly, build_async_rule
from diloco.core.outer import Nesterov


def _t(seed, shape=(4, 3)):
    return [torch.randn(shape, generator=torch.Generator().manual_seed(seed))]


def test_dn_with_c0_and_n_equal_arrivals_is_one_sync_nesterov_step():
    n = 4
    for rounds in range(1, 4):  # also with momentum built up by earlier rounds
        theta, ref = _t(0), _t(0)
        dn, sync = DelayedNesterov(0.7, 0.9, size=n), Nesterov(0.7, 0.9)
        for r in range(rounds):
            g = _t(10 + r)
            for w in range(n):
                dn.apply(theta, g, worker=w, staleness=w)
            sync.step(ref, g)
        torch.testing.assert_close(theta[0], ref[0], rtol=1e-6, atol=1e-6)


def test_naive_async_amplifies_as_the_formula_says():
    # k arrivals of the same g from m = 0: θ moves by ε (k + kβ + (k−1)β² + … + β^k) g and
    # m becomes (1 + β + … + β^(k−1)) g.
    eps, beta, k = 0.7, 0.9, 5
    theta, g = [torch.zeros(3)], [torch.tensor([1.0, -2.0, 0.5])]
    rule = Naive(eps, beta)
    for w in range(k):
        rule.apply(theta, g, worker=w, staleness=w)
    factor = k + sum((k + 1 - j) * beta**j for j in range(1, k + 1))
    torch.testing.assert_close(theta[0], -eps * factor * g[0], rtol=1e-6, atol=1e-6)
    momentum = sum(beta**j for j in range(k))
    torch.testing.assert_close(rule.opt.buf[0], momentum * g[0], rtol=1e-6, atol=1e-6)
    assert factor > k * (1 + beta) * 0.99  # more than k sync steps' worth: amplified


def test_dn_non_momentum_arrivals_are_plain_sgd_steps_and_c_adds_momentum():
    theta = [torch.zeros(2)]
    dn = DelayedNesterov(1.0, 0.5, size=2, c=0.5)
    g = [torch.ones(2)]
    dn.apply(theta, g, worker=0, staleness=0)  # t=0: θ −= [c β m + g/N], m = 0
    torch.testing.assert_close(theta[0], torch.full((2,), -0.5))
    dn.apply(theta, g, worker=1, staleness=0)  # t=1: m = Δ/N = 1; θ −= (1 − cN + c) β m + g/N
    torch.testing.assert_close(theta[0], torch.full((2,), -0.5 - (0.5 * 0.5 * 1 + 0.5)))
    dn.apply(theta, g, worker=0, staleness=1)  # t=2: θ −= c β m + g/N = 0.25 + 0.5
    torch.testing.assert_close(theta[0], torch.full((2,), -1.25 - 0.75))
    with pytest.raises(ValueError):
        DelayedNesterov(1.0, 0.9, size=4, c=0.5)


def test_dn_at_group_end_steps_its_momentum_at_the_groups_last_arrival():
    # N = 2, ε = 1, β = 0.5, c = 0. Arrivals g = 1 (alone), then a group of 2 and 3.
    # The paper's rule steps at the 2nd arrival, inside the group: θ = −0.5, m = (1 + 2)/2 = 1.5,
    # θ −= 0.5·1.5 + 1 → −2.25, then θ −= 3/2 → −3.75. At the group's end: θ = −0.5, −1.5, then
    # m = (1 + 2 + 3)/3 = 2 (three arrivals in Δ) and θ −= 0.5·2 + 1.5 → −4.0.
    arrivals = [(1.0, True), (2.0, False), (3.0, True)]
    for at_group_end, want in ((False, -3.75), (True, -4.0)):
        theta, dn = [torch.zeros(1)], DelayedNesterov(1.0, 0.5, size=2, at_group_end=at_group_end)
        for g, end in arrivals:
            dn.apply(theta, [torch.tensor([g])], worker=0, staleness=0, group_end=end)
        torch.testing.assert_close(theta[0], torch.tensor([want]))
    # every arrival on its own (no grace period): the paper's rule, bit for bit
    a, b = _t(0), _t(0)
    paper, grouped = DelayedNesterov(0.7, 0.9, size=3), DelayedNesterov(0.7, 0.9, size=3, at_group_end=True)
    for i in range(8):
        paper.apply(a, _t(i + 1), worker=i % 3, staleness=1)
        grouped.apply(b, _t(i + 1), worker=i % 3, staleness=1, group_end=True)
    assert torch.equal(a[0], b[0])


def test_buffer_with_n_equal_k_is_the_sync_update():
    theta, ref = _t(0), _t(0)
    rule, sync = Buffer(0.7, 0.9, size=3), Nesterov(0.7, 0.9)
    grads = [_t(1), _t(2), _t(3)]
    for w in (2, 0, 1):  # arrival order does not matter: summed in worker order
        changed = rule.apply(theta, grads[w], worker=w, staleness=0)
    assert changed
    from diloco.core.outer import weighted_average

    sync.step(ref, weighted_average(grads, [1 / 3] * 3))
    assert torch.equal(theta[0], ref[0])


def test_poly_scales_and_polythres_drops():
    theta, ref = [torch.zeros(2)], [torch.zeros(2)]
    Poly(1.0, 0.0).apply(theta, [torch.ones(2)], worker=0, staleness=3)
    torch.testing.assert_close(theta[0], torch.full((2,), -0.5))
    assert not Poly(1.0, 0.9, threshold=10).apply(ref, [torch.ones(2)], worker=0, staleness=11)
    assert torch.equal(ref[0], torch.zeros(2))


def test_delay_compensation_term():
    theta = [torch.tensor([1.0, 2.0])]
    pulled = [torch.tensor([0.0, 0.0])]
    DelayComp(1.0, 0.0, lam=0.5).apply(
        theta, [torch.tensor([2.0, 1.0])], worker=0, staleness=1, pulled=pulled
    )
    # g + λ g² (θ − θ_pulled) = [2 + 0.5·4·1, 1 + 0.5·1·2] = [4, 2]
    torch.testing.assert_close(theta[0], torch.tensor([1.0 - 4.0, 2.0 - 2.0]))


@pytest.mark.parametrize("name", ["dn", "naive", "buffer", "poly", "polythres", "delaycomp", "dn-grouped"])
def test_every_rule_state_round_trips(name):
    grouped = name == "dn-grouped"
    make = lambda: build_async_rule(  # noqa: E731
        name.removesuffix("-grouped"), lr=0.7, momentum=0.9, num_workers=3, at_group_end=grouped
    )
    a, b = make(), make()
    pa, pb = _t(0), _t(0)
    for i in range(3):  # groups of 2: grouped DN holds 3 arrivals in Δ when the state is saved
        a.apply(pa, _t(i + 1), worker=i % 3, staleness=i, pulled=_t(0), group_end=i % 2 == 1)
    b.load_state_dict(a.state_dict())
    pb = [p.clone() for p in pa]
    for i in range(3, 7):
        a.apply(pa, _t(i + 1), worker=i % 3, staleness=1, pulled=_t(0), group_end=i % 2 == 1)
        b.apply(pb, _t(i + 1), worker=i % 3, staleness=1, pulled=_t(0), group_end=i % 2 == 1)
    assert torch.equal(pa[0], pb[0])


def test_buffer_flush_applies_the_last_few_arrivals():
    theta, ref = _t(0), _t(0)
    rule, sync = Buffer(0.7, 0.9, size=4), Nesterov(0.7, 0.9)
    for w in (1, 0):
        assert not rule.apply(theta, _t(w + 1), worker=w, staleness=0)
    assert rule.flush(theta) and not rule.flush(theta)
    from diloco.core.outer import weighted_average

    sync.step(ref, weighted_average([_t(1), _t(2)], [0.5, 0.5]))
    assert torch.equal(theta[0], ref[0])


@pytest.mark.parametrize("at_group_end", [False, True])
def test_dn_applied_group_by_group_is_apply_bit_for_bit(at_group_end):
    # the server decodes a large push a group of tensors at a time (OuterSide.apply_async)
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2), (7,)]
    whole = [torch.randn(s, generator=g) for s in shapes]
    parts = [t.clone() for t in whole]
    rules = [DelayedNesterov(0.7, 0.9, size=3, c=0.2, at_group_end=at_group_end) for _ in range(2)]
    for i in range(9):
        grad = [torch.randn(s, generator=g) for s in shapes]
        end = i % 4 != 1
        rules[0].apply(whole, grad, worker=i % 3, staleness=1, group_end=end)
        rules[1].apply_parts(parts, [grad[:2], grad[2:3], grad[3:]], worker=i % 3, staleness=1, group_end=end)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(rules[0].m, rules[1].m, strict=True))
    with pytest.raises(ValueError, match="3 tensors for 4 parameters"):
        rules[1].apply_parts(parts, [grad[:3]], worker=0, staleness=0)
