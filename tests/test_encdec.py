"""The encoder-decoder (models/encdec.py): decoder causality, step-by-step decoding against full recomputation, the
bounded STLT decoding state, padding masks, Transformer-base's parameter count, and a tiny model that learns to
reverse sequences."""

import pytest
import torch

from models import ConfigError, build_model, count_parameters
from models.encdec import EncDecConfig, EncoderDecoder, sinusoidal_positions
from tests.stlt_fixtures import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

PAD, BOS, EOS = 0, 1, 2
V = 13

# Decoders with Laplacian heads wherever there is attention: all attention (1 of 4 heads Laplacian everywhere),
# all STLT (Laplacian heads in cross-attention only), and attention and STLT alternating in both stacks.
KINDS = {
    "attention": dict(mixer="attention", decoder_mixer="attention", k=1),
    "stlt": dict(mixer="stlt", decoder_mixer="stlt", k=1, laplacian_sites="cross"),
    "mixed": dict(mixer="attention,stlt", decoder_mixer="attention,stlt", laplacian_schedule="explicit",
                  k_per_layer=[1, 0]),
}


def make_model(kind: str, seed: int = 0, **overrides) -> EncoderDecoder:
    torch.manual_seed(seed)
    options = {"stlt_nodes": 4} if kind != "attention" else {}
    config = EncDecConfig(**{**dict(dim=16, depth=2, num_heads=4, vocab_size=V, context_length=64),
                             **KINDS[kind], **overrides}, mixer_options=options)
    model = EncoderDecoder(config).double().eval()
    # Open the STLT gates half-way, so the hard masks differ between nodes and positions (a test of the gate too).
    with torch.no_grad():
        for block in model.blocks:
            if hasattr(block.mixer, "gate_bias"):
                block.mixer.gate_bias.copy_(torch.randn_like(block.mixer.gate_bias) * 0.1)
                block.mixer.gate_weight.copy_(torch.randn_like(block.mixer.gate_weight))
    return model


def tokens(*shape) -> torch.Tensor:
    return torch.randint(3, V, shape)


@pytest.mark.parametrize("kind, encoder, decoder, cross", [
    ("attention", [1, 1], [1, 1], [1, 1]),
    ("stlt", [None, None], [None, None], [1, 1]),  # None: an STLT layer, no heads
    ("mixed", [1, None], [1, None], [1, 0]),
])
def test_laplacian_heads_are_where_the_config_puts_them(kind, encoder, decoder, cross):
    model = make_model(kind)
    heads = lambda layers: [getattr(layer.mixer, "laplacian_heads", None) for layer in layers]  # noqa: E731
    assert heads(model.encoder_layers) == encoder and heads(model.decoder_layers) == decoder
    assert [layer.cross.laplacian_heads for layer in model.decoder_layers] == cross


@pytest.mark.parametrize("kind", KINDS)
def test_decoder_never_sees_future_target_tokens(kind):
    """Changing target tokens after position t leaves the logits at positions <= t unchanged (to the last bit), and
    changes later ones."""
    model = make_model(kind)
    src, tgt = tokens(3, 7), tokens(3, 12)
    t = 5
    changed = tgt.clone()
    changed[:, t + 1:] = (tgt[:, t + 1:] - 3 + 1) % (V - 3) + 3  # every later token different
    with torch.no_grad():
        before, after = model(src, tgt), model(src, changed)
    torch.testing.assert_close(before[:, : t + 1], after[:, : t + 1], rtol=0, atol=1e-12)
    assert (before[:, t + 1:] - after[:, t + 1:]).abs().amax() > 1e-3


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("kind", KINDS)
def test_step_by_step_decoding_equals_full_recomputation(kind, dtype, atol):
    """Feeding the target one token at a time through decode_step gives the teacher-forced logits, with padded
    sources (the cached cross-attention keys and values and their mask)."""
    model = make_model(kind).to(dtype)
    src, tgt = tokens(3, 9), tokens(3, 11)
    src[0, 6:] = PAD
    src[1, 4:] = PAD
    with torch.no_grad():
        full = model(src, tgt)
        state = model.init_decoder_state(model.encode(src))
        steps = []
        for t in range(tgt.shape[1]):
            logits, state = model.decode_step(tgt[:, t], state)
            steps.append(logits)
    torch.testing.assert_close(torch.stack(steps, dim=1), full, rtol=0, atol=atol)


def test_stlt_decoding_state_does_not_grow():
    """The causal STLT's state after 1 step and after 50 has the same shapes: (B, S, D) complex transform, gate
    sums (B, S), counts (B, 1); an attention cache grows by one position per step."""
    B, S, D = 2, 4, 16
    shapes = {}
    for kind in ("stlt", "attention"):
        model = make_model(kind)
        state = model.init_decoder_state(model.encode(tokens(B, 5)))
        with torch.no_grad():
            for step in range(1, 51):
                _, state = model.decode_step(tokens(B), state)
                if step in (1, 50):
                    shapes[kind, step] = [{k: tuple(v.shape) for k, v in layer.items()} for layer in state.layers]
    assert shapes["stlt", 1] == shapes["stlt", 50] == [{"L": (B, S, D), "gate_sum": (B, S), "count": (B, 1)}] * 2
    assert shapes["attention", 50][0]["k"] == (B, 4, 50, 4) and shapes["attention", 1][0]["k"] == (B, 4, 1, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_padding_does_not_change_the_outputs_of_tokens(kind):
    """Each pair decoded alone, unpadded, gives the logits it gets in a batch where sources and targets are padded
    to different lengths (right padding) - and ignoring the masks would change them."""
    model = make_model(kind)
    src_lens, tgt_lens = [4, 9, 6], [5, 3, 8]
    srcs = [tokens(1, n) for n in src_lens]
    tgts = [tokens(1, n) for n in tgt_lens]
    src = torch.full((3, 11), PAD)
    tgt = torch.full((3, 10), PAD)
    for i, (s, t) in enumerate(zip(srcs, tgts)):
        src[i, : s.shape[1]], tgt[i, : t.shape[1]] = s[0], t[0]
    with torch.no_grad():
        batch = model(src, tgt)
        alone = [model(s, t)[0] for s, t in zip(srcs, tgts)]
        unmasked = model(src, tgt, torch.zeros_like(src, dtype=torch.bool), torch.zeros_like(tgt, dtype=torch.bool))
    for i, n in enumerate(tgt_lens):
        torch.testing.assert_close(batch[i, :n], alone[i], rtol=0, atol=1e-10)
    assert (unmasked[0, : tgt_lens[0]] - alone[0]).abs().amax() > 1e-4  # the masks are what keeps them equal


@pytest.mark.parametrize("kind", ["attention", "mixed"])
def test_attention_fast_path_matches_the_written_out_definition(kind):
    """SDPA with masks and Laplacian heads against softmax(QK^T/sqrt(d)) with -inf at masked keys, written here:
    self-attention (I - P) V, cross-attention W_v y - P W_v e (the decoder token's own value minus the average)."""
    model = make_model(kind)
    layer = model.decoder_layers[0]
    y, memory = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    src_pad = torch.zeros(2, 7, dtype=torch.bool)
    src_pad[0, 3:] = True
    cross = layer.cross
    W, b = cross.qkv.weight, cross.qkv.bias
    q, k, v, own = (y @ W[:16].T + b[:16]), memory @ W[16:32].T + b[16:32], memory @ W[32:].T + b[32:], \
        y @ W[32:].T + b[32:]
    heads = lambda t: t.view(t.shape[0], t.shape[1], 4, 4).transpose(1, 2)  # noqa: E731
    scores = heads(q) @ heads(k).transpose(-1, -2) / 2.0
    P = scores.masked_fill(src_pad[:, None, None, :], float("-inf")).softmax(-1)
    o = P @ heads(v)
    o[:, :1] = heads(own)[:, :1] - o[:, :1]
    expected = cross.proj(o.transpose(1, 2).reshape(2, 5, 16))
    got = cross(y, cross.memory_kv(memory), src_pad)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(cross(y, cross.memory_kv(memory), src_pad, reference=True), expected)
    tgt_pad = torch.zeros(2, 5, dtype=torch.bool)
    tgt_pad[1, 3:] = True
    torch.testing.assert_close(layer.mixer(y, tgt_pad), layer.mixer(y, tgt_pad, reference=True))


def test_sinusoidal_positions_are_vaswani_et_al():
    pe = sinusoidal_positions(50, 8)
    pos, i = 37, 2  # channels 2i and 2i + 1
    assert pe[pos, 2 * i].item() == pytest.approx(torch.sin(torch.tensor(pos / 10000 ** (2 * i / 8))).item(), abs=1e-6)
    assert pe[pos, 2 * i + 1].item() == pytest.approx(torch.cos(torch.tensor(pos / 10000 ** (2 * i / 8))).item(),
                                                      abs=1e-6)
    torch.testing.assert_close(sinusoidal_positions(3, 8, offset=37), pe[37:40])


def test_transformer_base_parameter_count():
    """Transformer-base from its shapes, d = 512, f = 2048, 6 + 6 layers, V = 37000 shared three ways, biases on
    every projection, post-norm (no final norms):
        attention (self or cross)  4 (d^2 + d)         = 1,050,624
        FFN                        2 d f + f + d       = 2,099,712
        LayerNorm                  2 d                 = 1,024
        encoder layer  attention + FFN + 2 LN          = 3,152,384      x 6 = 18,914,304
        decoder layer  2 attention + FFN + 3 LN        = 4,204,032      x 6 = 25,224,192
        embedding      V d                             = 18,944,000
        total                                            63,082,496
    The STLT variant swaps each self-attention for an STLT mixer with S = 32 nodes: value and output projections
    2 (d^2 + d), sigma, omega S each, T 1, readout 2 S d, gate S d + S = 574,561."""
    d, f, V, L, S = 512, 2048, 37000, 6, 32
    attention, ffn, norm = 4 * (d * d + d), 2 * d * f + f + d, 2 * d
    encoder_layer, decoder_layer = attention + ffn + 2 * norm, 2 * attention + ffn + 3 * norm
    expected = L * encoder_layer + L * decoder_layer + V * d
    assert expected == 63_082_496
    model = build_model({"preset": "transformer_base"}, device="meta")
    assert count_parameters(model) == expected
    stlt = 2 * (d * d + d) + 2 * S + 1 + 2 * S * d + S * d + S
    expected_stlt = expected - 2 * L * attention + 2 * L * stlt
    assert count_parameters(build_model({"preset": "transformer_base_stlt"}, device="meta")) == expected_stlt
    # Laplacian heads add nothing; separate embeddings add a source table and an output matrix.
    assert count_parameters(build_model({"preset": "transformer_base", "k": 3}, device="meta")) == expected
    separate = build_model({"preset": "transformer_base", "embeddings": "separate"}, device="meta")
    assert count_parameters(separate) == expected + 2 * V * d


def test_pre_norm_adds_the_final_norms_only():
    post = count_parameters(make_model("attention"))
    assert count_parameters(make_model("attention", norm_position="pre")) == post + 2 * 2 * 16


@pytest.mark.parametrize("flat, key", [
    ({"model": "encdec", "laplacian_sites": "encoder,middle"}, "laplacian_sites"),
    ({"model": "encdec", "decoder_mixer": ["attention"] * 3}, "decoder_mixer"),
    ({"model": "encdec", "embeddings": "shared", "src_vocab_size": 40}, "src_vocab_size"),
    ({"model": "encdec", "mixer": "stlt", "k": 1}, "mixer"),  # STLT layers have no heads
    ({"model": "encdec", "laplacian_sites": "none", "k": 1}, "laplacian_sites"),
    ({"model": "encdec", "stlt_nodes": 8}, "stlt_nodes"),  # no STLT layer in either stack
    ({"model": "encdec", "norm_position": "sandwich"}, "norm_position"),
])
def test_bad_configs_name_their_key(flat, key):
    with pytest.raises(ConfigError) as error:
        build_model(flat)
    assert error.value.field == key


def test_stlt_options_reach_decoder_only_stlt():
    model = build_model({"model": "encdec", "decoder_mixer": "stlt", "stlt_nodes": 8, "laplacian_sites": "encoder"})
    assert model.decoder_layers[0].mixer.num_nodes == 8 and model.decoder_layers[0].mixer.causal
    assert model.encoder_layers[0].mixer.laplacian_heads == 0  # k defaults to 0


@pytest.mark.parametrize("kind", ["attention", "stlt"])
def test_a_tiny_model_learns_to_reverse(kind):
    """Sources of 3-6 random tokens; targets the same reversed, then EOS. A 2+2-layer model with a Laplacian head
    in every attention (all attention; or STLT self-mixing, bilateral in the encoder and causal in the decoder,
    with cross-attention) trains for 200 Adam steps on CPU (warm-up, cosine decay), then greedy decoding reverses
    at least 95% of 200 held-out sources exactly (1.0 measured on seeds 0-2, both kinds)."""
    import math

    from models.beam_search import greedy_search

    torch.manual_seed(0)
    stlt = dict(mixer="stlt", decoder_mixer="stlt", laplacian_sites="cross") if kind == "stlt" else {}
    model = EncoderDecoder(EncDecConfig(dim=64, depth=2, num_heads=4, vocab_size=V, k=1, context_length=16, **stlt))
    steps, peak = 200, 3e-3
    opt = torch.optim.Adam(model.parameters(), lr=peak, betas=(0.9, 0.98))

    def batch(n):
        lengths = torch.randint(3, 7, (n,))
        src = torch.full((n, 6), PAD)
        out = torch.full((n, 7), PAD)
        for i, m in enumerate(lengths.tolist()):
            seq = torch.randint(3, V, (m,))
            src[i, :m] = seq
            out[i, :m], out[i, m] = seq.flip(0), EOS
        tgt_in = torch.cat((torch.full((n, 1), BOS), out[:, :-1]), dim=1)
        return src, tgt_in, out

    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = peak * min((step + 1) / 30, 0.5 * (1 + math.cos(math.pi * step / steps)))
        src, tgt_in, out = batch(64)
        logits = model(src, tgt_in)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), out.flatten(), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    src, _, out = batch(200)
    decoded = greedy_search(model, src, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=7).tokens
    exact = (decoded == out).all(dim=1).float().mean().item()
    assert exact >= 0.95, (exact, loss.item())
