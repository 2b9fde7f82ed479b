import pytest
import torch

from diloco.config import MODEL_PRESETS
from diloco.model.gpt import GPT


@pytest.mark.parametrize(
    "name,low,high", [("nano", 0.4e6, 0.6e6), ("micro", 2.5e6, 3.5e6), ("20m", 19e6, 23e6)]
)
def test_presets_have_their_advertised_size(name, low, high):
    assert low <= GPT(MODEL_PRESETS[name]).num_params() <= high


@pytest.mark.parametrize("name,millions,blocks", [("60m", 86.5, 3), ("150m", 173.3, 12)])
def test_the_papers_60m_and_150m_shapes(name, millions, blocks):
    """Counted on the meta device (nothing allocated): 896 wide, 16 heads, 32k vocabulary with an
    untied head; without that head and the positions, about the names' 60M and 150M."""
    with torch.device("meta"):
        model = GPT(MODEL_PRESETS[name])
    assert round(model.num_params() / 1e6, 1) == millions and len(model.blocks) == blocks
    untied = model.head.weight.numel() + model.pos_emb.weight.numel()
    assert abs((model.num_params() - untied) / 1e6 - int(name[:-1])) < 0.05 * int(name[:-1])


def test_20m_builds_and_takes_a_step():
    torch.manual_seed(0)
    model = GPT(MODEL_PRESETS["20m"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (1, 257))
    before = model(x[:, :-1], x[:, 1:])
    before.backward()
    opt.step()
    assert torch.isfinite(before)
    assert model(x[:, :-1], x[:, 1:]) < before


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(MODEL_PRESETS["nano"]).eval()
    x = torch.randint(0, 256, (1, 16))
    emb = model.tok_emb(x) + model.pos_emb(torch.arange(16))
    y = emb.clone()
    y[:, 10:] += 1.0  # change the future
    a, b = emb, y
    for block in model.blocks:
        a, b = block(a), block(b)
    torch.testing.assert_close(a[:, :10], b[:, :10])


@pytest.mark.timeout(30)
def test_evaluation_batches_keep_logits_bounded_and_give_the_same_loss(monkeypatch):
    """64 windows of the 20m preset's logits were 2.1 GB (twice that with cross-entropy's copy):
    the 32k-vocabulary presets evaluate 8 windows at a time, the byte-level ones 64 as before; a
    smaller budget changes batches, not the loss (beyond float rounding)."""
    from diloco.model import evaluate as ev

    with torch.device("meta"):
        big = GPT(MODEL_PRESETS["150m"])
    assert ev.eval_batch(big, 256) == 8 and ev.eval_batch(GPT(MODEL_PRESETS["nano"]), 128) == 64
    assert 4 * 8 * 256 * 32_000 <= ev.EVAL_LOGITS_BYTES
    model = GPT(MODEL_PRESETS["nano"])
    windows = torch.randint(0, 256, (70, 129), generator=torch.Generator().manual_seed(0))
    whole = ev.evaluate(model, windows)
    monkeypatch.setattr(ev, "EVAL_LOGITS_BYTES", 3 * 4 * 128 * 256)  # 3 windows a batch
    assert ev.eval_batch(model, 128) == 3
    assert ev.evaluate(model, windows) == pytest.approx(whole, rel=1e-6)
