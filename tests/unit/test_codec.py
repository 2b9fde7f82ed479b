"""Codecs against encodings computed by hand: values, codes, scales and byte counts, for zeros,
negative values, tiny and huge magnitudes; NaN refused; damaged messages refused; error feedback
conserves the sum of what was meant to be sent."""

import math

import pytest
import torch

from diloco import config
from diloco.core.codec import BLOCK, CODECS, DOWNLOAD_CODECS, Encoded, build_codec
from diloco.errors import UserError

LOSSY = ("bf16", "int8", "fp4", "topk")
# top-k per chunk with its values in 2 and 3 bits (SparseLoCo's layout), by name in these tests
CHUNKED = {"topk-c64-b2": dict(topk_chunk=64, topk_bits=2), "topk-c100-b3": dict(topk_chunk=100, topk_bits=3)}


def _codec(name, **kw):
    return build_codec("topk", **CHUNKED[name], **kw) if name in CHUNKED else build_codec(name, **kw)


def _roundtrip(codec, tensors, state=None):
    message = codec.encode(tensors, state)
    again = Encoded.from_bytes(message.to_bytes())  # what a server receives
    decoded = codec.decode(again)
    for a, b in zip(decoded, codec.decode(message), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    return message, decoded


@pytest.mark.timeout(10)
def test_the_config_offers_exactly_the_codecs():
    assert config.CODECS == tuple(CODECS)
    assert config.DOWNLOAD_CODECS == DOWNLOAD_CODECS


@pytest.mark.timeout(10)
def test_fp32_is_the_identity_and_four_bytes_a_value():
    x = [torch.tensor([0.0, -1.5, 1e-38, 3e38, float("nan")]), torch.ones(2, 3)]
    message, decoded = _roundtrip(build_codec("fp32"), x)
    assert message.nbytes == 4 * 11
    assert torch.equal(decoded[1], x[1]) and torch.equal(decoded[0][:4], x[0][:4])
    assert math.isnan(decoded[0][4])  # lossless: it sends what it is given; the worker reports NaN


@pytest.mark.timeout(10)
def test_bf16_rounds_to_nearest_even_by_hand():
    # bfloat16 keeps 8 significant bits: next to 1 the step is 2^-7.
    x = torch.tensor([0.0, -0.5, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-7, -(2**-130), 3.0e38])
    message, (decoded,) = _roundtrip(build_codec("bf16"), [x])
    want = [0.0, -0.5, 1.0, 1 + 2**-6, 1 + 2**-7, -(2**-130), 1.765625 * 2.0**127]
    assert decoded.dtype == torch.float32 and message.nbytes == 2 * 7
    # ties to even: 1 + 2^-8 -> 1, 1 + 3·2^-8 -> 1 + 2^-6; 3e38 = 1.7632·2^127 -> 226/128·2^127
    assert decoded.tolist() == want


@pytest.mark.timeout(10)
def test_int8_scales_each_block_by_its_absmax_by_hand():
    first = torch.tensor([0.0, 1.0, -2.0, 0.5, 2.54, -2.54, 0.011, -0.009])
    x = torch.zeros(BLOCK + 4)
    x[:8] = first
    x[BLOCK:] = torch.tensor([1e-30, -1e-30, 0.5e-30, 0.0])  # a block of tiny values: its own scale
    message, (decoded,) = _roundtrip(build_codec("int8"), [x])
    q, scale = message.payload
    assert q.dtype == torch.int8 and q.shape == x.shape
    s = torch.tensor(2.54) / 127  # 0.02
    assert torch.equal(scale, torch.stack([s, torch.tensor(1e-30) / 127]))
    assert q[:8].tolist() == [0, 50, -100, 25, 127, -127, 1, 0]  # round(x / 0.02), ties to even
    assert q[BLOCK:].tolist() == [127, -127, 64, 0]
    assert torch.equal(decoded[:8], q[:8].float() * s)
    assert message.nbytes == (BLOCK + 4) + 4 * 2  # a byte per value and a float32 scale per block
    # huge magnitudes scale too, and an all-zero block decodes to zeros
    big = torch.tensor([3e38, -1.5e38, 0.0])
    assert torch.allclose(build_codec("int8").decode(build_codec("int8").encode([big]))[0], big, rtol=1e-2)
    assert torch.equal(
        build_codec("int8").decode(build_codec("int8").encode([torch.zeros(5)]))[0], torch.zeros(5)
    )


@pytest.mark.timeout(10)
def test_every_fp4_byte_decodes_to_its_two_values_by_hand():
    # any byte a message may hold (a sign on a zero too: -0.0), in a block whose absmax is 3
    codec, scale = build_codec("fp4"), 3.0

    def unit(code: int) -> float:
        m = code & 7
        magnitude = 0.0 if m == 0 else 2.0 ** (m - 7)
        return -magnitude if code >= 8 else magnitude

    packed = torch.arange(128, dtype=torch.uint8)  # one block: 256 values
    for half in (packed, packed + 128):
        message = Encoded("fp4", [half, torch.tensor([scale])], 128 + 4, {"shapes": [[256]]})
        (decoded,) = codec.decode(message)
        want = [
            unit(b & 15) * scale if i == 0 else unit(b >> 4) * scale for b in half.tolist() for i in (0, 1)
        ]
        assert [math.copysign(1, v) for v in decoded.tolist()] == [math.copysign(1, v) for v in want]
        assert decoded.tolist() == want


@pytest.mark.timeout(10)
def test_fp4_is_sign_and_three_exponent_bits_by_hand():
    x = torch.tensor([1.0, 0.5, 0.74, 0.76, 0.01, 0.005, -0.25, 0.0, -1e-3])
    for scale in (1.0, 2.0**-100, 2.0**100):  # tiny and huge blocks give the same codes
        message, (decoded,) = _roundtrip(build_codec("fp4"), [x * scale])
        packed, absmax = message.payload
        # codes: magnitude m (0: zero, m: 2^(m-7)) | sign << 3; nearest power of two in between
        codes = [7, 6, 6, 7, 1, 0, 8 | 5, 0, 0]
        want = [c0 | c1 << 4 for c0, c1 in zip(codes[0::2], codes[1::2] + [0], strict=True)]
        assert packed.tolist() == want and absmax.tolist() == [scale]
        expect = torch.tensor([1.0, 0.5, 0.5, 1.0, 2.0**-6, 0.0, -0.25, 0.0, 0.0]) * scale
        assert torch.equal(decoded, expect)
        assert message.nbytes == 5 + 4  # two codes a byte, one float32 absmax
    # one block per 256 values, each with its own absmax; shapes come back
    y = torch.randn(3, 200)
    message, (decoded,) = _roundtrip(build_codec("fp4"), [y])
    assert decoded.shape == y.shape and message.payload[1].numel() == math.ceil(600 / BLOCK)
    ratio = decoded.flatten()[y.flatten() != 0] / y.flatten()[y.flatten() != 0]
    assert bool((ratio >= 0).all())  # signs kept, zeros allowed
    nonzero = decoded != 0
    blocks = y.flatten().view(-1)[: 2 * BLOCK].view(2, BLOCK).abs().amax(dim=1)
    mags = (decoded.flatten()[: 2 * BLOCK].view(2, BLOCK).abs() / blocks[:, None]).flatten()
    assert set(torch.log2(mags[mags > 0]).tolist()) <= set(range(-6, 1)) and bool(nonzero.any())


@pytest.mark.timeout(10)
def test_topk_keeps_the_largest_magnitudes_with_their_indices():
    x = torch.tensor([[0.1, -3.0, 2.0], [0.0, -0.5, 1.0]])
    message, (decoded,) = _roundtrip(build_codec("topk", topk_fraction=0.3), [x])
    values, index = message.payload
    assert index.tolist() == [1, 2] and values.tolist() == [-3.0, 2.0]  # ceil(0.3 × 6) = 2
    assert torch.equal(decoded, torch.tensor([[0.0, -3.0, 2.0], [0.0, 0.0, 0.0]]))
    assert message.nbytes == 2 * (4 + 4)
    # at least one value per tensor, and a fraction of 1 is lossless
    tiny = build_codec("topk", topk_fraction=1e-6).encode([torch.tensor([0.0, -1e-30, 1e-31])])
    assert tiny.payload[1].tolist() == [1]
    _, (whole,) = _roundtrip(build_codec("topk", topk_fraction=1.0), [x])
    assert torch.equal(whole, x)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_lossy_codecs_refuse_nan_and_inf(name, bad):
    with pytest.raises(ValueError, match="NaN or Inf"):
        build_codec(name).encode([torch.tensor([1.0, bad])])


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", CODECS)
def test_message_bytes_are_the_payload_and_zeros_decode_to_zeros(name):
    x = [torch.zeros(7, 33), torch.zeros(5)]
    codec = build_codec(name)
    message, decoded = _roundtrip(codec, x)
    assert message.nbytes == sum(t.numel() * t.element_size() for t in message.payload)
    assert message.nbytes == codec.message_bytes(x)
    assert all(torch.equal(d, t) for d, t in zip(decoded, x, strict=True))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", [*CODECS, "topk0.5", "topk0.003"])
def test_message_bytes_from_shapes_alone_equal_the_encoded_size(name):
    """`message_bytes` counts from the shapes (diloco plan sizes a 10B model with it, on the meta
    device): it must equal the size of a real encoding for every shape, block edges included."""
    codec = build_codec("topk", topk_fraction=float(name[4:])) if name[4:] else build_codec(name)
    g = torch.Generator().manual_seed(0)
    shapes = [(1,), (2,), (255,), (256,), (257,), (511,), (7, 33), (3, 1000), (4, 4, 4), (12_345,)]
    tensors = [torch.randn(s, generator=g) for s in shapes]
    assert codec.message_bytes(tensors) == codec.encode(tensors).nbytes
    for t in tensors:
        assert codec.message_bytes([t.to("meta")]) == codec.encode([t]).nbytes, t.shape


@pytest.mark.timeout(10)
def test_bytes_per_value_of_a_large_tensor():
    x = [torch.randn(1 << 16)]
    per_value = {name: build_codec(name).encode(x).nbytes / x[0].numel() for name in CODECS}
    assert per_value["fp32"] == 4 and per_value["bf16"] == 2
    assert per_value["int8"] == 1 + 4 / BLOCK and per_value["fp4"] == 0.5 + 4 / BLOCK
    assert per_value["topk"] == pytest.approx(0.01 * 8, rel=1e-3)


@pytest.mark.timeout(10)
def test_damaged_messages_are_refused_with_a_sentence():
    x = [torch.randn(4, 5)]
    topk = build_codec("topk", topk_fraction=0.5)
    m = topk.encode(x)
    m.payload[1] = torch.tensor([3, 2, 40, 41, 42, 43, 44, 45, 46, 47], dtype=torch.int32)
    with pytest.raises(UserError, match="does not decode"):
        topk.decode(m)
    fp4 = build_codec("fp4")
    m = fp4.encode(x)
    m.payload[0] = m.payload[0][:-1]
    with pytest.raises(UserError, match="does not decode"):
        fp4.decode(m)
    m = fp4.encode(x)
    m.meta["shapes"] = [[5, 5]]
    with pytest.raises(UserError, match="does not decode"):
        fp4.decode(m)
    int8 = build_codec("int8")
    m = int8.encode(x)
    m.payload[1] = torch.ones(3)
    with pytest.raises(UserError, match="does not decode"):
        int8.decode(m)
    with pytest.raises(UserError, match="encoded with codec 'fp4'"):
        int8.decode(fp4.encode(x))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ("int8", "fp4", "topk"))
def test_decode_each_makes_one_tensor_at_a_time(name):
    """The server's checks hold one decoded tensor, not the message: the first tensor comes out
    before the second is decoded, so a damaged second tensor is refused only when reached."""
    codec = build_codec(name, topk_fraction=0.5)
    x = [torch.randn(300), torch.randn(40, 7)]
    m = codec.encode(x)
    whole = codec.decode(m)
    torch.testing.assert_close(list(codec.decode_each(m)), whole, rtol=0, atol=0)
    m.payload[3] = m.payload[3][:-1]  # the second tensor's scales (topk: indices) one short
    each = codec.decode_each(m)
    torch.testing.assert_close(next(each), whole[0], rtol=0, atol=0)
    with pytest.raises(UserError, match="does not decode"):
        next(each)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", [*LOSSY, *CHUNKED])
def test_error_feedback_conserves_the_sum_over_rounds(name):
    """Σ_t decode(message_t) + residual_T = Σ_t g_t: nothing is lost, only delayed."""
    gen = torch.Generator().manual_seed(0)
    rounds = [[torch.randn(40, 50, generator=gen) * 10.0 ** (-3 * i) for i in range(2)] for _ in range(12)]
    with_ef, without = _codec(name, error_feedback=True), _codec(name)
    state = {}
    sent = [torch.zeros(40, 50), torch.zeros(40, 50)]
    plain = [torch.zeros(40, 50), torch.zeros(40, 50)]
    meant = [torch.zeros(40, 50), torch.zeros(40, 50)]
    for grads in rounds:
        for acc, d in zip(sent, with_ef.decode(with_ef.encode(grads, state)), strict=True):
            acc += d
        for acc, d in zip(plain, without.decode(without.encode(grads, {})), strict=True):
            acc += d
        for acc, g in zip(meant, grads, strict=True):
            acc += g
    for s, r, m, p in zip(sent, state["residual"], meant, plain, strict=True):
        scale = m.abs().max()
        assert torch.allclose(s + r, m, atol=1e-5 * scale, rtol=1e-5)
        assert (s - m).norm() <= (p - m).norm()  # and what arrived is no further from the sum
    assert _codec(name).encode(rounds[0], state) is not None and "residual" in state


@pytest.mark.timeout(10)
def test_bits_pack_and_quantize_by_hand():
    from diloco.core.bits import dequantize, pack, quantize, unpack

    # 5, 0, 4095 in 12 bits, least significant first: 0x005 | 0x000 | 0xFFF over 36 bits
    packed = pack(torch.tensor([5, 0, 4095]), 12)
    assert packed.tolist() == [5, 0, 0, 255, 15]
    assert unpack(packed, 12, 3).tolist() == [5, 0, 4095]
    x = torch.randint(0, 8, (1001,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack(pack(x, 3), 3, 1001), x)
    # magnitudes 1, 0.5, 0.75, 0.25: levels from 0.25 to 1; 3 bits = 4 levels 0.25 apart, exact;
    # 2 bits = {0.25, 1}: 0.5 rounds down, 0.75 up; the sign is the top bit
    v = torch.tensor([[-1.0, 0.5, 0.75, 0.25]])
    codes, bounds = quantize(v, 3)
    assert codes.tolist() == [4 | 3, 1, 2, 0] and bounds.float().tolist() == [[0.25, 1.0]]
    assert dequantize(codes.view(1, 4), bounds, 3).tolist() == v.tolist()
    codes, bounds = quantize(v, 2)
    assert codes.tolist() == [2 | 1, 0, 1, 0]
    assert dequantize(codes.view(1, 4), bounds, 2).tolist() == [[-1.0, 0.25, 1.0, 0.25]]


@pytest.mark.timeout(10)
def test_chunked_topk_keeps_each_chunks_largest_against_a_loop():
    """Per chunk of 64 values (the last of 30), ⌈0.1 × its length⌉ of the largest |values|
    arrive exactly (float32) and the rest are zero; offsets take 6 bits each."""
    x = torch.randn(3, 98, generator=torch.Generator().manual_seed(1))  # 294 = 4 × 64 + 38
    codec = build_codec("topk", topk_fraction=0.1, topk_chunk=64)
    message, (decoded,) = _roundtrip(codec, [x])
    flat, want = x.reshape(-1), torch.zeros(294)
    for start in range(0, 294, 64):
        part = flat[start : start + 64]
        top = torch.topk(part.abs(), math.ceil(0.1 * part.numel())).indices + start
        want[top] = flat[top]
    assert torch.equal(decoded.reshape(-1), want)
    kept = 4 * 7 + 4
    assert message.nbytes == 4 * kept + math.ceil(kept * 6 / 8) == codec.message_bytes([x])


@pytest.mark.timeout(20)
@pytest.mark.parametrize("fraction", [0.01, 0.03, 0.5, 1.0])
@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
@pytest.mark.parametrize("bits", [2, 3, 32])
def test_chunked_message_bytes_from_shapes_alone_equal_the_encoded_size(fraction, chunk, bits):
    codec = build_codec("topk", topk_fraction=fraction, topk_chunk=chunk, topk_bits=bits)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) for s in [(1,), (7,), (8,), (63, 65), (5000,), (4096,), (2, 4097)]]
    message, decoded = _roundtrip(codec, tensors)
    assert (
        message.nbytes == codec.message_bytes(tensors) == codec.message_bytes([t.to("meta") for t in tensors])
    )
    for t, d in zip(tensors, decoded, strict=True):  # kept values keep their sign, the rest are 0
        assert d.shape == t.shape and bool(((d == 0) | (torch.sign(d) == torch.sign(t))).all())


@pytest.mark.timeout(10)
def test_damaged_chunked_messages_are_refused_with_a_sentence():
    x = [torch.randn(300)]
    codec = build_codec("topk", topk_fraction=0.1, topk_chunk=64, topk_bits=2)
    damage = {
        "values one byte short": lambda m: m.payload.__setitem__(0, m.payload[0][:-1]),
        "offsets repeated": lambda m: m.payload.__setitem__(1, torch.zeros_like(m.payload[1])),
        "bounds not bfloat16": lambda m: m.payload.__setitem__(2, m.payload[2].float()),
        "a negative bound": lambda m: m.payload.__setitem__(2, -m.payload[2].abs() - 1),
        "another chunk size": lambda m: m.meta.__setitem__("chunk", 128),
    }
    for harm in damage.values():
        m = codec.encode(x)
        harm(m)
        with pytest.raises(UserError, match="does not decode"):
            codec.decode(m)
    m = codec.encode(x)
    m.meta["chunk"] = 128
    with pytest.raises(UserError, match="--topk-chunk 128"):
        codec.decode(m)
    with pytest.raises(ValueError, match="bits one of"):
        build_codec("topk", topk_bits=4)


@pytest.mark.timeout(10)
def test_a_stateless_encode_leaves_no_residual():
    """state None: no error feedback, so every encode of the same input is the same message (with
    a state, the second one carries the first one's rounding error)."""
    codec = build_codec("fp4", error_feedback=True)
    assert codec.message_bytes([torch.ones(10)]) == 5 + 4
    x = [torch.tensor([0.3, -0.05, 0.11, 0.7])]  # values fp4 rounds

    def sent(state):
        return codec.decode(codec.encode(x, state))[0]

    plain = build_codec("fp4").decode(build_codec("fp4").encode(x))[0]
    assert torch.equal(sent(None), plain) and torch.equal(sent(None), plain)
    state: dict = {}
    first, second = sent(state), sent(state)
    assert "residual" in state and torch.equal(first, plain) and not torch.equal(second, plain)


@pytest.mark.timeout(30)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", CODECS)
def test_a_gpu_encodes_as_the_cpu_does(name):
    x = [torch.randn(300, 7), torch.randn(13)]
    codec = build_codec(name, topk_fraction=0.1)
    cpu = codec.encode(x)
    gpu = codec.encode([t.cuda() for t in x])
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu.payload, gpu.payload, strict=True))


@pytest.mark.timeout(10)
def test_decayed_error_feedback_is_sparselocos_accumulator_by_hand():
    """e ← β e + Δ, m = top-k(e), e ← e − m (β = 0.5, one of two values sent)."""
    codec = build_codec("topk", topk_fraction=0.5, error_feedback=True, ef_decay=0.5)
    state = {}
    (m,) = codec.decode(codec.encode([torch.tensor([3.0, 1.0])], state))
    assert m.tolist() == [3.0, 0.0] and state["residual"][0].tolist() == [0.0, 1.0]
    (m,) = codec.decode(codec.encode([torch.tensor([0.25, 0.0])], state))  # e = [0.25, 0.5]
    assert m.tolist() == [0.0, 0.5] and state["residual"][0].tolist() == [0.25, 0.0]
