"""The `gpt_d20` preset is karpathy/nanochat's d20 GPT (nanochat at commit e1770a3, docs/nanochat.md).

Each truth is written out here from nanochat's source, not read back from models/: its parameter shapes, its
soft-cap formula, its init, its optimiser groups and learning rates, its Muon step and its schedules. Decoding with
the cache is checked against a full forward over the whole sequence at every step.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from models import build_model, count_parameters
from models.attention import RotaryQKNormAttention
from models.nanochat_optim import (
    build_nanochat_optimizers,
    nanochat_lr_multiplier,
    nanochat_muon_momentum,
    nanochat_param_groups,
    set_nanochat_schedule,
)

TINY = {"preset": "gpt_tiny", "vocab_size": 37, "context_length": 32, "dim": 32, "depth": 3, "num_heads": 4}


def nanochat_d20_shapes(depth: int = 20, vocab_size: int = 2**16) -> dict:
    """nanochat's d20 from scripts/base_train.py: model_dim = depth * 64, num_heads = ceil(model_dim / 128),
    num_kv_heads = num_heads; the tokenizer's vocabulary 2**16 (scripts/tok_train.py), sequence 2048."""
    dim = depth * 64
    heads = max(1, (dim + 127) // 128)
    return dict(depth=depth, dim=dim, heads=heads, kv_heads=heads, head_dim=dim // heads, vocab=vocab_size)


def nanochat_param_count(depth, dim, heads, kv_heads, head_dim, vocab) -> int:
    """Parameters of nanochat/gpt.py's GPT, shape by shape (vocab padded to a multiple of 64: 2**16 already is)."""
    padded = (vocab + 63) // 64 * 64
    wte = padded * dim  # transformer.wte
    lm_head = dim * padded  # lm_head, untied
    c_q = dim * heads * head_dim
    c_k = c_v = dim * kv_heads * head_dim
    c_proj = dim * dim
    c_fc, mlp_proj = dim * 4 * dim, 4 * dim * dim
    return wte + lm_head + depth * (c_q + c_k + c_v + c_proj + c_fc + mlp_proj)  # rmsnorm and RoPE: no parameters


def test_d20_preset_has_nanochats_shapes_and_parameter_count():
    s = nanochat_d20_shapes()
    expected = nanochat_param_count(**s)
    assert expected == 560_988_160  # the "561M" of the paper and of nanochat's d20 report
    ramp = {"laplacian_schedule": "ramp", "start_layer": 4, "increment": 1, "max_count": 5}
    for variant in ({}, {"k": 3}, {"k": 10}, ramp):
        model = build_model({"preset": "gpt_d20", **variant}, device="meta")
        assert count_parameters(model) == expected, variant
    attn = model.blocks[0].mixer
    assert isinstance(attn, RotaryQKNormAttention)
    assert (model.config.dim, model.config.depth, attn.num_heads, attn.num_kv_heads, attn.head_dim) == (
        s["dim"], s["depth"], s["heads"], s["kv_heads"], s["head_dim"])
    assert model.wte.weight.shape == (s["vocab"], s["dim"]) and model.config.context_length == 2048
    assert model.lm_head.weight is not model.wte.weight
    # Grouped key/value heads shrink k and v exactly as nanochat's c_k, c_v.
    gqa = build_model({"preset": "gpt_d20", "num_kv_heads": 5}, device="meta")
    assert count_parameters(gqa) == nanochat_param_count(**{**s, "kv_heads": 5})


def nanochat_model(**overrides):
    torch.manual_seed(0)
    return build_model({**TINY, "block_style": "nanochat", **overrides}).double().eval()


def test_logits_are_softcapped_at_15():
    model = nanochat_model()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1e3)  # raw logits in the thousands
    idx = torch.randint(0, 37, (2, 9))
    out = model(idx, return_features=True)
    raw = out.tokens @ model.lm_head.weight.T
    assert raw.abs().max() > 1e3
    torch.testing.assert_close(out.logits, 15.0 * torch.tanh(raw / 15.0))  # nanochat: softcap * tanh(x / softcap)
    assert out.logits.abs().max() <= 15.0
    assert out.logits.abs().max() > 14.9


def test_norms_have_no_parameters_and_give_unit_rms():
    model = nanochat_model()
    # Every parameter is a linear weight or the embedding: no norm weights, no biases.
    assert all(name.endswith("weight") for name, _ in model.named_parameters())
    assert sum(p.numel() for p in model.parameters()) == model.wte.weight.numel() + sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    norms = [model.embed_norm, model.norm] + [n for b in model.blocks for n in (b.norm1, b.norm2)]
    assert all(not list(n.parameters()) for n in norms)
    x = 7.0 * torch.randn(3, 5, 32, dtype=torch.float64) + 2.0
    for norm in norms:
        rms = norm(x).pow(2).mean(-1).sqrt()
        torch.testing.assert_close(rms, torch.ones_like(rms))
        torch.testing.assert_close(norm(x), x / x.pow(2).mean(-1, keepdim=True).sqrt())


def test_norm_right_after_the_embedding():
    model = nanochat_model()
    with torch.no_grad():
        model.wte.weight.mul_(50.0)
    seen = {}
    model.blocks[0].register_forward_pre_hook(lambda module, args: seen.update(x=args[0]))
    idx = torch.randint(0, 37, (2, 6))
    model(idx)
    emb = model.wte.weight[idx]
    torch.testing.assert_close(seen["x"], emb / emb.pow(2).mean(-1, keepdim=True).sqrt())


def rotate_clockwise(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """nanochat's apply_rotary_emb: halves (x1, x2), y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos,
    angle m base^(-2i/d)."""
    n, d = x.shape[-2:]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos + x2 * sin, -x1 * sin + x2 * cos), dim=-1)


def test_queries_and_keys_are_rotated_then_rms_normalised_per_head():
    model = nanochat_model(num_kv_heads=2)
    attn = model.blocks[0].mixer
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    q, k, v = attn.project(x)
    B, N, H, Hkv, d = 2, 11, 4, 2, 8
    q_hand = rotate_clockwise((x @ attn.q_proj.weight.T).view(B, N, H, d).transpose(1, 2))
    k_hand = rotate_clockwise((x @ attn.k_proj.weight.T).view(B, N, Hkv, d).transpose(1, 2))
    rms = lambda t: t / t.pow(2).mean(-1, keepdim=True).sqrt()  # noqa: E731
    torch.testing.assert_close(q, rms(q_hand))
    torch.testing.assert_close(k, rms(k_hand))
    torch.testing.assert_close(v, (x @ attn.v_proj.weight.T).view(B, N, Hkv, d).transpose(1, 2))
    for t in (q, k):
        head_rms = t.pow(2).mean(-1).sqrt()
        torch.testing.assert_close(head_rms, torch.ones_like(head_rms))


def test_grouped_heads_with_laplacian_heads_by_hand():
    """Query head h reads key/value head h // (H / H_kv), as nanochat's SDPA with enable_gqa; the first k heads
    output V - PV with that same V. Fast path and reference path both."""
    model = randomised(nanochat_model(num_kv_heads=2, k=3))
    attn = model.blocks[0].mixer
    B, N, H, d = 2, 9, 4, 8
    x = torch.randn(B, N, 32, dtype=torch.float64)
    q, k, v = attn.project(x)  # checked above
    heads = []
    for h in range(H):
        g = h // 2
        scores = q[:, h] @ k[:, g].transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
        pv = scores.softmax(-1) @ v[:, g]
        heads.append(v[:, g] - pv if h < 3 else pv)
    expected = torch.cat(heads, dim=-1) @ attn.proj.weight.T
    torch.testing.assert_close(attn(x), expected)
    torch.testing.assert_close(attn(x, reference=True), expected)


def test_nanochat_init():
    """nanochat's init_weights: zero head and zero residual projections; embedding N(0, 1); each other linear
    N(0, min(1, sqrt(fan_out / fan_in)) / sqrt(fan_in))."""
    torch.manual_seed(0)
    model = build_model({"preset": "gpt_tiny", "block_style": "nanochat", "dim": 256, "num_heads": 4,
                         "num_kv_heads": 1, "depth": 2, "vocab_size": 4096})
    assert torch.count_nonzero(model.lm_head.weight) == 0
    for block in model.blocks:
        assert torch.count_nonzero(block.mixer.proj.weight) == 0
        assert torch.count_nonzero(block.mlp.fc2.weight) == 0
        expected = {
            block.mixer.q_proj: 256**-0.5,  # square
            block.mixer.k_proj: 256**-0.5 * math.sqrt(64 / 256),  # (64, 256): one kv head of 64
            block.mixer.v_proj: 256**-0.5 * math.sqrt(64 / 256),
            block.mlp.fc1: 256**-0.5,  # (1024, 256): min(1, 2) = 1
        }
        for linear, std in expected.items():
            assert abs(linear.weight.std().item() / std - 1) < 0.03, (linear, linear.weight.std().item(), std)
            assert abs(linear.weight.mean().item()) < 0.03 * std
    assert abs(model.wte.weight.std().item() - 1.0) < 0.01


def test_relu_squared_mlp_without_biases():
    model = nanochat_model()
    mlp = model.blocks[1].mlp
    x = torch.randn(4, 32, dtype=torch.float64)
    with torch.no_grad():
        mlp.fc2.weight.normal_()
    hidden = x @ mlp.fc1.weight.T
    expected = torch.where(hidden > 0, hidden * hidden, torch.zeros_like(hidden)) @ mlp.fc2.weight.T
    torch.testing.assert_close(mlp(x), expected)
    assert mlp.fc1.weight.shape == (128, 32) and mlp.fc1.bias is None and mlp.fc2.bias is None


# Decoding with the cache against full recomputation.


def randomised(model):
    """Non-zero everywhere (nanochat's head and projections start at zero, which would make every logit 0)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def generate_by_recomputation(model, idx, steps, temperature, top_k, generator):
    """Each token from a forward over the whole sequence so far, sampled as nanochat's sample_next_token."""
    seq = idx
    for _ in range(steps):
        logits = model(seq)[:, -1]
        if top_k is not None:
            kth = torch.topk(logits, top_k).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1, generator=generator)
        seq = torch.cat((seq, nxt), dim=1)
    return seq


DECODERS = {
    "gpt2": {"block_style": "gpt2"},
    # Causal STLT layers decode through their own init_state / decode_step (models/stlt/mixer.py).
    "nanochat_stlt": {"block_style": "nanochat", "mixer": "stlt,attention,stlt", "laplacian_schedule": "explicit",
                      "k_per_layer": [0, 2, 0], "stlt_nodes": 4},
    "gpt2_laplacian": {"block_style": "gpt2", "k": 2},
    "nanochat": {"block_style": "nanochat"},
    "nanochat_laplacian": {"block_style": "nanochat", "k": 2},
    "nanochat_gqa_ramp": {"block_style": "nanochat", "num_kv_heads": 2, "laplacian_schedule": "ramp", "start_layer": 1,
                          "increment": 2, "max_count": 4},
}


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize(("temperature", "top_k"), [(0.0, None), (1.0, None), (0.8, 5)])
def test_cached_generation_equals_recomputation(name, temperature, top_k):
    model = randomised(build_model({**TINY, **DECODERS[name]}).double().eval())
    idx = torch.randint(0, 37, (3, 5), generator=torch.Generator().manual_seed(2))
    steps = 12
    cached = model.generate(idx, steps, temperature=temperature, top_k=top_k,
                            generator=torch.Generator().manual_seed(3))
    expected = generate_by_recomputation(model, idx, steps, temperature, top_k, torch.Generator().manual_seed(3))
    assert cached.shape == (3, 5 + steps)
    assert torch.equal(cached, expected)
    assert len(set(cached[:, 5:].flatten().tolist())) > 2  # the tokens vary: the comparison is not vacuous


@pytest.mark.parametrize("name", DECODERS)
def test_cached_forward_in_chunks_equals_full_forward(name):
    """Prompt, then a chunk of several tokens (a causal mask offset by the cache), then single tokens; the cache
    outgrows its initial capacity on the way."""
    model = randomised(build_model({**TINY, **DECODERS[name]}).double().eval())
    idx = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(4))
    full = model(idx)
    cache = model.new_cache(capacity=4)
    pieces = [model(idx[:, a:b], cache=cache) for a, b in [(0, 5), (5, 9), (9, 10), (10, 16)]]
    assert cache.length == 16
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-10)


def test_layers_without_a_decoding_state_are_refused():
    model = build_model({**TINY, "block_style": "nanochat"})
    model.blocks[1].mixer = torch.nn.Identity()
    with pytest.raises(NotImplementedError, match="layer 1's mixer \\('attention', Identity\\) has none"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2)


# The optimiser split and the schedules.


def test_optimiser_groups_are_nanochats():
    model = build_model({"preset": "gpt_d20"}, device="meta")
    adamw, muon = build_nanochat_optimizers(model)
    groups = {g["name"]: g for g in adamw.param_groups + muon.param_groups}
    assert set(groups) == {"lm_head", "embedding", "matrices"}
    everything = [id(p) for g in groups.values() for p in g["params"]]
    assert len(everything) == len(set(everything)) == len(list(model.parameters()))
    assert [id(p) for p in groups["lm_head"]["params"]] == [id(model.lm_head.weight)]
    assert [id(p) for p in groups["embedding"]["params"]] == [id(model.wte.weight)]
    assert {id(p) for p in groups["matrices"]["params"]} == {id(p) for p in model.blocks.parameters()}
    assert len(groups["matrices"]["params"]) == 20 * 6  # c_q, c_k, c_v, c_proj, c_fc, mlp c_proj per layer
    scale = (1280 / 768) ** -0.5  # nanochat: dmodel_lr_scale, the AdamW rates were tuned at width 768
    assert groups["lm_head"]["lr"] == pytest.approx(0.004 * scale) == pytest.approx(0.0030984, abs=1e-7)
    assert groups["embedding"]["lr"] == pytest.approx(0.2 * scale) == pytest.approx(0.1549193, abs=1e-7)
    assert groups["matrices"]["lr"] == 0.02
    for g in adamw.param_groups:
        assert (g["betas"], g["eps"], g["weight_decay"]) == ((0.8, 0.95), 1e-10, 0.0)
    g = muon.param_groups[0]
    assert (g["momentum"], g["nesterov"], g["ns_steps"], g["weight_decay"]) == (0.95, True, 5, 0.0)


def test_groups_cover_parameters_nanochat_does_not_have():
    model = build_model({**TINY, "mixer": "stlt,attention,stlt"})  # gpt2 style: LayerNorm weights; STLT's own
    adamw, muon = nanochat_param_groups(model)
    everything = [id(p) for g in adamw + muon for p in g["params"]]
    assert len(everything) == len(set(everything)) == len(list(model.parameters()))
    assert all(p.ndim == 2 and not p.is_complex() for g in muon for p in g["params"])


def nanochat_muon_step(p, grad, buf, lr, momentum):
    """nanochat/muon.py Muon.step for one parameter, written out (Nesterov, 5 quintic Newton-Schulz steps)."""
    buf.lerp_(grad, 1 - momentum)
    g = grad.lerp(buf, momentum)
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(5):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if tall:
        X = X.mT
    p.add_(X.to(p.dtype), alpha=-lr * max(1, p.size(-2) / p.size(-1)) ** 0.5)


def test_muon_steps_as_nanochats():
    """Each step's update of every matrix against nanochat's step from the same point. Both orthogonalise in
    bfloat16 in a different operation order: the updates differ by ~5% (Frobenius) from that alone, while a constant
    momentum of 0.95 instead of the warm-up differs by ~30% and a missing sqrt(max(1, rows / cols)) by ~100%."""
    torch.manual_seed(0)
    model = build_model({**TINY, "block_style": "nanochat", "num_kv_heads": 1})  # square, wide, tall matrices
    optimizers = build_nanochat_optimizers(model)
    matrices = optimizers[1].param_groups[0]["params"]
    assert {tuple(p.shape) for p in matrices} == {(32, 32), (8, 32), (128, 32), (32, 128)}
    bufs = [torch.zeros_like(p) for p in matrices]
    for step in range(3):
        start = [p.detach().clone() for p in matrices]
        grads = {id(p): torch.randn_like(p) for p in model.parameters()}
        for p in model.parameters():
            p.grad = grads[id(p)]
        lrm = set_nanochat_schedule(optimizers, step, 10)
        for opt in optimizers:
            opt.step()
        for p, before, buf in zip(matrices, start, bufs):
            ref = before.clone()
            nanochat_muon_step(ref, grads[id(p)], buf, 0.02 * lrm, nanochat_muon_momentum(step))
            mine, expected = p.detach() - before, ref - before
            assert (mine - expected).norm() < 0.1 * expected.norm(), (step, tuple(p.shape))


def test_lr_multiplier_is_nanochats():
    # base_train defaults: warmup_ratio 0, warmdown_ratio 0.2, final_lr_frac 0 (1000 steps: warm-down from 800).
    expected = {0: 1.0, 500: 1.0, 800: 1.0, 801: 199 / 200, 900: 0.5, 950: 0.25, 999: 1 / 200, 1000: 0.0}
    for step, value in expected.items():
        assert nanochat_lr_multiplier(step, 1000) == pytest.approx(value), step
    # With a warm-up and a floor: round(0.05 * 1000) = 50 warm-up steps, final fraction 0.1.
    assert nanochat_lr_multiplier(0, 1000, warmup_ratio=0.05, final_lr_frac=0.1) == pytest.approx(1 / 50)
    assert nanochat_lr_multiplier(49, 1000, warmup_ratio=0.05, final_lr_frac=0.1) == pytest.approx(1.0)
    assert nanochat_lr_multiplier(900, 1000, warmup_ratio=0.05, final_lr_frac=0.1) == pytest.approx(0.55)
    assert nanochat_lr_multiplier(1000, 1000, warmup_ratio=0.05, final_lr_frac=0.1) == pytest.approx(0.1)
    # Step counts are rounded: 1003 steps warm down over round(200.6) = 201 of them, from step 802.
    assert nanochat_lr_multiplier(802, 1003) == 1.0
    assert nanochat_lr_multiplier(900, 1003) == pytest.approx(103 / 201)
    # Muon's momentum: 0.85 -> 0.95 over 300 steps.
    for step, value in {0: 0.85, 150: 0.90, 300: 0.95, 5000: 0.95}.items():
        assert nanochat_muon_momentum(step) == pytest.approx(value)


def test_schedule_sets_every_group():
    model = build_model({**TINY, "block_style": "nanochat"})
    adamw, muon = build_nanochat_optimizers(model)
    set_nanochat_schedule((adamw, muon), 900, 1000)
    for g in adamw.param_groups + muon.param_groups:
        assert g["lr"] == pytest.approx(0.5 * g["initial_lr"])
    assert muon.param_groups[0]["momentum"] == pytest.approx(0.95)
    set_nanochat_schedule((adamw, muon), 30, 1000)
    assert muon.param_groups[0]["momentum"] == pytest.approx(0.86)


def test_the_paper_space_is_the_stages_space_with_the_papers_grid_and_evaluations():
    """search_spaces/gpt_d20_paper.yaml: the three stages as gpt_d20_stages.yaml runs them, k in {0, 5, 9} as the
    paper's GSM8K table, and the SFT model scored as the paper: GSM8K pass@10 nanochat's way, the other four."""
    from pathlib import Path

    import yaml

    from models import build_config
    from study.space import load_space

    spaces = Path(__file__).parent.parent / "search_spaces"
    stages = yaml.safe_load((spaces / "gpt_d20_stages.yaml").read_text())
    paper = yaml.safe_load((spaces / "gpt_d20_paper.yaml").read_text())
    differing = {"name", "description", "metric", "mode", "parameters"}
    assert {k: v for k, v in paper.items() if k not in differing | {"stages"}} == \
        {k: v for k, v in stages.items() if k not in differing | {"stages"}}
    assert [{k: v for k, v in s.items() if k != "evaluate"} for s in paper["stages"]] == \
        [{k: v for k, v in s.items() if k != "evaluate"} for s in stages["stages"]]
    assert paper["parameters"] == {"max_count": [0, 5, 9]}
    space = load_space(spaces / "gpt_d20_paper.yaml")
    assert (space.fixed["laplacian_schedule"], space.fixed["start_layer"], space.fixed["increment"]) == ("ramp", 4, 1)
    evaluations = {task: e for e in space.stages[-1].evaluate for task in e.tasks}
    assert set(evaluations) == {"arc_easy", "arc_challenge", "mmlu", "gsm8k_chat", "humaneval"}
    gsm = evaluations["gsm8k_chat"]
    assert (gsm.num_samples, gsm.temperature) == (10, 1.0)  # pass@10 as nanochat's chat_rl samples it
    assert space.metrics == ["sft/eval_gsm8k_chat_pass_at_10"] and space.modes == ["max"]
    counts = {k: build_config({"preset": "gpt_d20", "laplacian_schedule": "ramp", "start_layer": 4, "increment": 1,
                               "max_count": k}).laplacian_counts for k in (0, 5, 9)}
    assert counts[0] == [0] * 20 and counts[5][:9] == [0, 0, 0, 0, 1, 2, 3, 4, 5] and max(counts[9]) == 9


# ---- the paper's spaces train this model, for base_train's horizon, with each stage's clipping ----------------------

D20_SPACES = ("gpt_d20_stages.yaml", "gpt_d20_paper.yaml")
# nanochat's scripts at e1770a3, written out: base_train.py's horizon and clip; mid_train.py and chat_sft.py have no
# clip_grad_norm_ call and no grad_clip setting (None: never clipped)
BASE_TRAIN = {"target_param_data_ratio": 20, "total_batch_size": 524_288, "max_seq_len": 2048, "grad_clip": 1.0}
STAGE_GRAD_CLIP = {None: BASE_TRAIN["grad_clip"], "midtrain": None, "sft": None}


def _planned(space_file: str, **changes):
    """Every trial of a d20 space, stage by stage, as its trials resolve it (the space's own path, not the preset)."""
    from pathlib import Path

    import yaml

    from study.space import load_space

    path = Path(__file__).parent.parent / "search_spaces" / space_file
    if changes:  # the space with some top-level fields changed, written beside the original (its relative paths)
        document = {**yaml.safe_load(path.read_text()), **changes}
        path = path.with_name(f".test_{path.stem}_{os.getpid()}.yaml")
        path.write_text(yaml.safe_dump(document))
        try:
            space = load_space(path)
        finally:
            path.unlink()
    else:
        space = load_space(path)
    return space, [space.planned_stages(space.resolve({"max_count": k}))
                   for k in space.parameters["max_count"].choices]


def _num_params(stage) -> int:
    return count_parameters(build_model(stage.model_config_flat, device="meta"))


@pytest.mark.parametrize("space_file", D20_SPACES)
def test_the_paper_spaces_build_nanochats_d20_with_its_tokenizer(space_file):
    """Every stage of every trial: nanochat's tokenizer, its 65,536 tokens, 560,988,160 parameters (the count of
    nanochat's GPT written out above, and the number the issue quotes)."""
    _, trials = _planned(space_file)
    expected = nanochat_param_count(**nanochat_d20_shapes())
    assert expected == 560_988_160
    for stages in trials:
        assert [name for name, _ in stages] == [None, "midtrain", "sft"]
        for _, stage in stages:
            assert stage.dataset.tokenizer == "nanochat" and stage.hyperparameters["vocab_size"] == 2**16
            assert _num_params(stage) == expected


@pytest.mark.parametrize("space_file", D20_SPACES)
def test_the_pretraining_horizon_is_base_trains_for_the_model_built(space_file):
    """base_train.py: target_tokens = target_param_data_ratio * num_params, num_iterations = target_tokens //
    total_batch_size, with num_params the model's own count and total_batch_size 524,288 tokens (32 x 2048 x 8)."""
    space, trials = _planned(space_file)
    for stages in trials:
        _, pretraining = stages[0]
        hp = pretraining.hyperparameters
        assert hp["batch_size"] * hp["context_length"] == BASE_TRAIN["total_batch_size"]
        assert hp["context_length"] == BASE_TRAIN["max_seq_len"]
        num_iterations = BASE_TRAIN["target_param_data_ratio"] * _num_params(pretraining) // \
            BASE_TRAIN["total_batch_size"]
        assert hp["steps_per_epoch"] * pretraining.epochs == num_iterations == 21_400
        assert hp["steps_per_epoch"] * hp["batch_size"] * hp["context_length"] * pretraining.epochs / \
            _num_params(pretraining) == pytest.approx(20.0, abs=1e-3)


SMALLER_VOCABULARY = {"source": "fineweb_edu", "seq_len": 2048, "tokenizer": "nanochat", "bpe": {"vocab_size": 2**15},
                      "chat_tokens": True}


def test_the_horizon_follows_the_model_the_space_builds():
    """A 32,768-token BPE (nanochat's vocabulary from 2026) makes a smaller model and so fewer steps: nothing is
    fixed."""
    _, trials = _planned("gpt_d20_stages.yaml", dataset=SMALLER_VOCABULARY)
    _, pretraining = trials[0][0]
    assert _num_params(pretraining) == nanochat_param_count(**nanochat_d20_shapes(vocab_size=2**15)) == 477_102_080
    assert pretraining.hyperparameters["steps_per_epoch"] * 20 == 20 * 477_102_080 // 524_288 == 18_200


def test_a_horizon_the_epochs_do_not_split_or_a_contradicting_step_count_is_refused():
    from study.errors import UserError

    with pytest.raises(UserError, match=r"param_data_ratio: 20\.0 x 560,988,160 parameters // 524,288 tokens per step "
                                        r"= 21,400 steps, which 3 epochs do not split evenly"):
        _planned("gpt_d20_stages.yaml", epochs=3)
    fixed = {**_planned("gpt_d20_stages.yaml")[0].fixed, "steps_per_epoch": 1000}
    with pytest.raises(UserError, match=r"steps_per_epoch: param_data_ratio 20\.0 gives 1,070 steps per epoch "
                                        r"\(21,400 over 20 epochs\), got 1,000"):
        _planned("gpt_d20_stages.yaml", fixed=fixed)


@pytest.mark.parametrize("space_file", D20_SPACES)
def test_mid_training_and_sft_do_not_clip_as_nanochats_scripts(space_file):
    """base_train clips the global norm at 1.0; mid_train.py and chat_sft.py never clip (grad_clip 0: off); neither
    later stage keeps base_train's data:param horizon (their steps are their own)."""
    _, trials = _planned(space_file)
    for stages in trials:
        clips = {name: stage.hyperparameters["grad_clip"] for name, stage in stages}
        assert clips == {name: clip or 0.0 for name, clip in STAGE_GRAD_CLIP.items()}
        # an unset ratio is not recorded: nothing reads it
        assert [stage.hyperparameters.get("param_data_ratio") for _, stage in stages] == [20, None, None]
        assert [stage.hyperparameters["steps_per_epoch"] for _, stage in stages[1:]] == [495, 701]
