import pytest
import torch

from diloco.core.inner import Worker
from diloco.core.outer import SGD, Adam, Nesterov, weighted_average


def _grads(seed, shapes=((3, 4), (5,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def test_outer_grad_sign_and_value_by_hand():
    # One parameter w = 1, loss (w - 3)^2, inner SGD lr 0.1: gradient 2(1 - 3) = -4,
    # w_local = 1 - 0.1 * -4 = 1.4, so outer_grad = θ_start − θ_local = 1 - 1.4 = -0.4.
    w = torch.nn.Parameter(torch.tensor([1.0]))
    model = torch.nn.Module()
    model.w = w
    worker = Worker(
        model, torch.optim.SGD([w], lr=0.1), iter([None] * 3), loss_fn=lambda m, _: ((m.w - 3) ** 2).sum()
    )
    result = worker.run([torch.tensor([1.0])], steps=1)
    assert result.outer_grad[0].item() == pytest.approx(-0.4, abs=1e-6)
    # A second step: w = 1.4, gradient -3.2, w = 1.72; outer_grad from start 1.0 is -0.72.
    result = worker.run([torch.tensor([1.0])], steps=2)
    assert result.outer_grad[0].item() == pytest.approx(1.0 - 1.72, abs=1e-6)


@pytest.mark.parametrize(
    "ours,theirs",
    [
        (
            lambda: Nesterov(lr=0.7, momentum=0.9),
            lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True),
        ),
        (lambda: SGD(lr=0.5, momentum=0.8), lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.8)),
        (lambda: SGD(lr=1.0), lambda p: torch.optim.SGD(p, lr=1.0)),
        (lambda: Adam(lr=0.1, eps=0.1), lambda p: torch.optim.Adam(p, lr=0.1, eps=0.1)),
    ],
)
def test_outer_optimizers_match_torch_optim(ours, theirs):
    params = _grads(0)
    reference = [torch.nn.Parameter(p.clone()) for p in params]
    opt, ref_opt = ours(), theirs(reference)
    for step in range(5):
        grads = _grads(100 + step)
        opt.step(params, grads)
        for r, g in zip(reference, grads):
            r.grad = g.clone()
        ref_opt.step()
        for p, r in zip(params, reference):
            torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-7)


def test_nesterov_state_round_trips():
    params, twin = _grads(0), _grads(0)
    a, b = Nesterov(), Nesterov()
    a.step(params, _grads(1))
    b.step(twin, _grads(1))
    c = Nesterov()
    c.load_state_dict(a.state_dict())
    a.step(params, _grads(2))
    c.step(twin, _grads(2))
    assert all(torch.equal(p, t) for p, t in zip(params, twin))


def test_weighted_average_is_the_weighted_sum():
    g1, g2 = _grads(1), _grads(2)
    avg = weighted_average([g1, g2], [0.25, 0.75])
    for a, x, y in zip(avg, g1, g2):
        torch.testing.assert_close(a, 0.25 * x + 0.75 * y)
    with pytest.raises(ValueError):
        weighted_average([g1, g2], [1.0])


def test_kept_weights_rescale_only_when_something_is_missing():
    from diloco.core.outer import kept_weights

    weights = [0.2, 0.3, 0.5]
    assert kept_weights(weights, [True, True, True]) == weights
    assert kept_weights(weights, [True, False, True]) == pytest.approx([0.2 / 0.7, 0.5 / 0.7])
    assert kept_weights(weights, [True, True]) == pytest.approx([0.4, 0.6])  # third worker inactive


@pytest.mark.timeout(10)
def test_sparselocos_outer_step_is_the_plain_averaged_step():
    """θ ← θ − α · mean(m): torch's SGD without momentum, step after step (no state)."""
    from diloco.core.outer import build_outer_opt

    theta, ref = [torch.ones(3)], torch.ones(3, requires_grad=True)
    opt, torch_opt = build_outer_opt("sparseloco", lr=0.8, momentum=0.9), torch.optim.SGD([ref], lr=0.8)
    for g in (torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.5, 0.5, 0.0])):
        opt.step(theta, [g])
        ref.grad = g.clone()
        torch_opt.step()
        torch.testing.assert_close(theta[0], ref.detach(), rtol=0, atol=0)
    assert opt.state_dict() == {}
