"""STLTMixer: causality through the gate, constraints under abusive optimisation, the regulariser on a hand-computed
case, eval-mode node skipping, the tau schedule, and the model/config integration (keys, errors, hooks)."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from models import ConfigError, build_model
from models.stlt import STLTMixer, stlt_mix
from models.stlt import mixer as mixer_module
from tests.stlt_fixtures import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def make_mixer(causal, S=6, dim=12, seed=0, **kwargs):
    torch.manual_seed(seed)
    return STLTMixer(dim, S, causal=causal, seq_len=32, **kwargs).double()


@pytest.mark.parametrize("training", [True, False])
def test_causal_mixer_never_sees_the_future(training):
    """Changing tokens after t leaves outputs at <= t unchanged, gate included (prefix pooling), while a bilateral
    mixer and later positions do change."""
    B, N, t = 3, 20, 8
    mixers = {causal: make_mixer(causal).train(training) for causal in (True, False)}
    x = torch.randn(B, N, 12, dtype=torch.float64)
    x_changed = x.clone()
    x_changed[:, t + 1:] = torch.randn(B, N - t - 1, 12, dtype=torch.float64) * 5
    outputs = {}
    for causal, mixer in mixers.items():
        for name, inp in (("x", x), ("changed", x_changed)):
            torch.manual_seed(123)  # the same gate noise for both inputs
            outputs[causal, name] = mixer(inp)
    torch.testing.assert_close(outputs[True, "x"][:, : t + 1], outputs[True, "changed"][:, : t + 1], rtol=0, atol=1e-12)
    assert (outputs[True, "x"][:, t + 1:] - outputs[True, "changed"][:, t + 1:]).abs().max() > 1e-3
    assert (outputs[False, "x"][:, : t + 1] - outputs[False, "changed"][:, : t + 1]).abs().max() > 1e-3


def test_causal_gate_uses_prefix_means():
    mixer = make_mixer(True)
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    logits = mixer.gate_logits(x)
    for n in range(7):
        expected = x[:, : n + 1].mean(dim=1) @ mixer.gate_weight.T + mixer.gate_bias
        torch.testing.assert_close(logits[:, n], expected)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_constraints_hold_after_many_huge_steps(optimizer):
    """A loss pulling sigma and T down and |omega| up (then the other way), with absurd learning rates on the node
    parameters: the effective values stay in sigma >= 1e-3, |omega| <= pi/delta, T >= 4, and the output finite."""
    delta = 0.5
    mixer = make_mixer(True, delta=delta)
    x = torch.randn(2, 10, 12, dtype=torch.float64)
    nodes = [mixer.sigma_raw, mixer.omega_raw, mixer.T_raw]
    opt = torch.optim.SGD(nodes, lr=1e4) if optimizer == "sgd" else torch.optim.Adam(nodes, lr=50.0)
    for step in range(40):
        sign = -1.0 if step % 20 >= 15 else 1.0  # swing back now and then so raw values cross both ways
        loss = sign * (mixer.sigma.sum() + mixer.T - mixer.omega.abs().sum()) + mixer(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert mixer.sigma.min() >= 1e-3
        assert mixer.omega.abs().max() <= math.pi / delta
        assert mixer.T >= 4.0
    assert torch.isfinite(mixer(x)).all()
    # The push won: the parameters sit at their bounds, not stuck in the middle.
    assert mixer.sigma.min() < 2e-3 and mixer.T < 4.01 and mixer.omega.abs().max() > 0.99 * math.pi / delta


def test_initialisation_follows_the_design():
    torch.manual_seed(0)
    mixer = STLTMixer(16, 9, causal=False, seq_len=320, delta=0.5)
    expected_sigma = torch.logspace(-3, 1, 9, dtype=torch.float64)
    torch.testing.assert_close(mixer.sigma.double(), expected_sigma, rtol=1e-4, atol=2e-6)
    assert (mixer.omega >= 0).all() and (mixer.omega <= math.pi / 0.5).all()
    assert abs(mixer.T.item() - 320 / 16) < 1e-4
    assert abs(STLTMixer(16, 4, seq_len=32).T.item() - 4.0) < 2e-3  # max(4, 32/16)
    assert STLTMixer(16, 4, seq_len=32, T_init=10.0).T.item() == pytest.approx(10.0)


def test_regulariser_on_a_hand_computed_case():
    """Eval-mode hard masks from a gate that reads channel 0: m_bar = (3/4, 1/4, 1) over four sequences. Each of
    the write-up's sums is a mean over its terms: three nodes, two neighbour pairs."""
    mixer = make_mixer(False, S=3, lambda_omega=0.3, lambda_sigma=0.7, lambda_mask=0.11, reg_start_step=5,
                       eval_gate="hard")
    sigma = torch.tensor([0.1, 0.5, 2.0], dtype=torch.float64)
    omega = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64)
    with torch.no_grad():
        mixer.sigma_raw.copy_(torch.log(torch.expm1(sigma - 1e-3)))
        mixer.omega_raw.copy_(torch.atanh(omega / math.pi))
        mixer.gate_weight.zero_()
        mixer.gate_weight[0, 0], mixer.gate_weight[1, 0] = 1.0, -1.0
        mixer.gate_bias.copy_(torch.tensor([0.0, 0.0, 1.0]))
    x = torch.zeros(4, 5, 12, dtype=torch.float64)
    x[:, :, 0] = torch.tensor([1.0, 1.0, -1.0, 1.0])[:, None]
    mixer.eval()(x)
    m = [0.75, 0.25, 1.0]
    expected = (0.3 * (0.3 * m[0] + 1.0 * m[1] + 2.0 * m[2]) / 3
                + 0.7 * ((0.5 - 0.1) ** 2 * m[1] * m[0] + (2.0 - 0.5) ** 2 * m[2] * m[1]) / 2
                + 0.11 * sum(m) / 3)
    assert mixer.regularization_loss().item() == 0.0  # before reg_start_step
    mixer.set_training_step(5, 100)
    assert mixer.regularization_loss().item() == pytest.approx(expected, rel=1e-9)


def test_regulariser_trains_the_gate_and_the_nodes():
    mixer = make_mixer(True, reg_start_step=0).train()
    mixer(torch.randn(2, 9, 12, dtype=torch.float64))
    mixer.regularization_loss().backward()
    for p in (mixer.gate_bias, mixer.gate_weight, mixer.sigma_raw, mixer.omega_raw):
        assert p.grad is not None and p.grad.abs().sum() > 0


def _step_gradients(mixer, x, micro_batches: int, *, retain_graph: bool = False):
    """Gradients of one optimiser step on x (float64, training mode, the regulariser on from step 0): the loss is the
    mean over sequences, so each of `micro_batches` equal micro-batches' losses is scaled by 1 / micro_batches, and
    the regulariser is added once. Gate noise is drawn from one seed in sequence order, so the micro-batches see the
    same noise as the big batch."""
    mixer.zero_grad()
    mixer.set_training_step(3, 10)
    torch.manual_seed(123)
    losses = [mixer(part).square().mean() / micro_batches for part in x.chunk(micro_batches)]
    if retain_graph:  # a backward per micro-batch, keeping the graphs the regulariser reaches back into
        for loss in losses:
            loss.backward(retain_graph=True)
        mixer.regularization_loss().backward()
    else:
        (sum(losses) + mixer.regularization_loss()).backward()
    return {name: p.grad.clone() for name, p in mixer.named_parameters()}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("retain_graph", [False, True])
def test_regulariser_under_gradient_accumulation_gives_the_big_batch_gradient(causal, retain_graph):
    """One step on a batch of 8 and one on two micro-batches of 4 (loss scaled by 1/2, regulariser once per step):
    the same gradient in every parameter, the gate's included."""
    kwargs = dict(reg_start_step=0, lambda_omega=0.3, lambda_sigma=0.7, lambda_mask=0.2)
    x = torch.randn(8, 10, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    big = _step_gradients(make_mixer(causal, **kwargs).train(), x, 1)
    accumulated = _step_gradients(make_mixer(causal, **kwargs).train(), x, 2, retain_graph=retain_graph)
    for name, grad in big.items():
        torch.testing.assert_close(accumulated[name], grad, rtol=1e-12, atol=1e-14, msg=lambda m, n=name: f"{n}: {m}")
    assert big["gate_bias"].abs().sum() > 0 and big["sigma_raw"].abs().sum() > 0


def test_each_step_regularises_its_own_forwards():
    """Masks count towards the step they were drawn in: a new step, begun by set_training_step or by the backward
    through the last step's regulariser, starts from its own forwards only."""
    mixer = make_mixer(False, S=3, reg_start_step=0).train()
    x = torch.randn(4, 6, 12, dtype=torch.float64)
    for begin_with_set_training_step in (True, False):
        for step in range(3):
            if begin_with_set_training_step:
                mixer.set_training_step(step, 10)
            torch.manual_seed(step)
            (mixer(x * (step + 1)).square().mean() + mixer.regularization_loss()).backward()
            # The value is the regulariser of this step's masks alone.
            alone = make_mixer(False, S=3, reg_start_step=0).train()
            alone.load_state_dict(mixer.state_dict())
            torch.manual_seed(step)
            alone(x * (step + 1))
            assert mixer.regularization_loss().item() == pytest.approx(alone.regularization_loss().item(), rel=1e-12)


def test_training_mask_is_a_relaxed_bernoulli_of_the_logits():
    """sigmoid((z + logistic noise) / tau): the fraction of draws above 1/2 is sigmoid(z), whatever tau is."""
    mixer = make_mixer(False, S=3)
    mixer.tau.fill_(0.3)
    logits = torch.tensor([[-1.0, 0.0, 2.0]], dtype=torch.float64).expand(20000, 3)
    torch.manual_seed(0)
    mask = mixer.train().node_mask(logits)
    assert ((mask > 0.05) & (mask < 0.95)).float().mean() > 0.05  # relaxed: a share of draws is far from 0 and 1
    torch.testing.assert_close((mask > 0.5).double().mean(0), torch.sigmoid(logits[0]), rtol=0, atol=0.015)
    assert torch.equal(mixer.eval().node_mask(logits), torch.sigmoid(logits))  # all over 0.01: alpha itself


def test_tau_schedule_holds_then_anneals_geometrically():
    mixer = make_mixer(False, tau_start=1.0, tau_end=0.25, tau_hold=0.1, tau_anneal=0.4)
    taus = {}
    for step in (0, 9, 10, 30, 50, 80, 100):
        mixer.set_training_step(step, 100)
        taus[step] = mixer.tau.item()
    assert taus[0] == taus[9] == 1.0
    assert taus[10] == pytest.approx(1.0)
    assert taus[30] == pytest.approx(0.25**0.5)  # halfway through the anneal: geometric mean
    assert taus[50] == taus[80] == taus[100] == pytest.approx(0.25)


class WorkCount(TorchDispatchMode):
    """Total elements of every op's outputs: a proxy of the work done."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.elements += sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_eval_skips_nodes_off_for_the_whole_batch(causal, monkeypatch):
    S, off = 8, [1, 4, 5, 7]
    mixer = make_mixer(causal, S=S).eval()
    with torch.no_grad():
        mixer.gate_bias[off] = -50.0
    x = torch.randn(3, 16, 12, dtype=torch.float64)

    # Same output as mixing with every node and a mask that is zero on the skipped ones.
    with torch.no_grad():
        hard = mixer.node_mask(mixer.gate_logits(x))
        assert hard[..., off].abs().sum() == 0 and hard.sum() > 0
        full = mixer.out_proj(stlt_mix(mixer.value(x), mixer.sigma, mixer.omega, mixer.T, mixer.C, hard,
                                       causal=causal))
    seen = []
    real_mix = mixer_module.stlt_mix
    monkeypatch.setattr(mixer_module, "stlt_mix", lambda *a, **k: seen.append(a[1].shape[0]) or real_mix(*a, **k))
    with torch.no_grad(), WorkCount() as skipping:
        y = mixer(x)
    torch.testing.assert_close(y, full, rtol=1e-10, atol=1e-12)
    assert seen == [S - len(off)]

    # Less work than the same forward with every node on.
    with torch.no_grad():
        mixer.gate_bias[off] = 50.0
    with torch.no_grad(), WorkCount() as everything:
        mixer(x)
    assert seen[-1] == S
    assert skipping.elements < everything.elements


def test_eval_with_every_node_off_returns_the_output_bias():
    mixer = make_mixer(False).eval()
    with torch.no_grad():
        mixer.gate_bias.fill_(-50.0)
    mixer.start_node_count()
    y = mixer(torch.randn(2, 5, 12, dtype=torch.float64))
    torch.testing.assert_close(y, mixer.out_proj.bias.expand_as(y))
    assert mixer.stop_node_count().tolist() == [0.0, 2.0]  # no node in either sequence


# Integration with the models package: config keys, errors, hooks.


def test_models_with_stlt_layers_expose_the_hooks():
    model = build_model({"model": "gpt", "dim": 32, "depth": 3, "num_heads": 2, "context_length": 64,
                         "mixer": ["stlt", "attention", "stlt"], "stlt_nodes": 5, "stlt_T_init": 6.0})
    kinds = [type(block.mixer).__name__ for block in model.blocks]
    assert kinds == ["STLTMixer", "MixedHeadAttention", "STLTMixer"]
    assert model.blocks[0].mixer.num_nodes == 5 and model.blocks[0].mixer.causal
    model(torch.randint(0, 257, (2, 16)))
    stats = model.mixer_stats()
    assert set(stats) == {"stlt_T_l0", "stlt_T_l2"}
    assert stats["stlt_T_l0"] == pytest.approx(6.0)
    model.set_training_step(8000, 10000)
    model.train()(torch.randint(0, 257, (2, 16)))
    reg = model.regularization_loss()  # the mean over the STLT layers
    assert reg.item() > 0
    assert reg.item() == pytest.approx(sum(model.blocks[i].mixer.regularization_loss().item() for i in (0, 2)) / 2)
    groups = model.param_groups(weight_decay=0.1, slow_lr_scale=0.1)
    slow = [g for g in groups if g["lr_scale"] == 0.1]
    assert len(slow) == 1 and {id(p) for p in slow[0]["params"]} == {
        id(model.blocks[i].mixer.sigma_raw) for i in (0, 2)} | {id(model.blocks[i].mixer.omega_raw) for i in (0, 2)}
    model.set_training_step(50, 100)
    assert model.blocks[2].mixer.step.item() == 50


def test_per_layer_mixers_as_one_comma_separated_string():
    vit = build_model({"preset": "vit_tiny_digits", "mixer": "attention, stlt,attention,stlt", "stlt_nodes": 3})
    assert vit.mixer_kinds == ["attention", "stlt", "attention", "stlt"]
    assert build_model({"preset": "vit_tiny_digits", "mixer": ["attention", "stlt", "attention", "stlt"],
                        "stlt_nodes": 3}).mixer_kinds == vit.mixer_kinds


def test_vit_stlt_layers_are_bilateral():
    vit = build_model({"preset": "vit_tiny_digits", "mixer": "stlt", "stlt_nodes": 4})
    assert all(not block.mixer.causal for block in vit.blocks)
    assert vit(torch.randn(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"mixer": "stlt", "stlt_nodes": 0}, "stlt_nodes"),
        ({"mixer": "stlt", "stlt_nodes": 2.5}, "stlt_nodes"),
        ({"mixer": "stlt", "stlt_T_init": 3.0}, "stlt_T_init"),
        ({"mixer": "stlt", "stlt_T_init": "big"}, "stlt_T_init"),
        ({"mixer": "stlt", "stlt_delta": 0}, "stlt_delta"),
        ({"mixer": "stlt", "stlt_lambda_omega": -0.1}, "stlt_lambda_omega"),
        ({"mixer": "stlt", "stlt_reg_start_step": -1}, "stlt_reg_start_step"),
        ({"mixer": "stlt", "stlt_tau_end": 0.0}, "stlt_tau_end"),
        ({"mixer": "stlt", "stlt_tau_hold": 0.5, "stlt_tau_anneal": 0.6}, "stlt_tau_anneal"),
        ({"mixer": "stlt", "stlt_lr_scale": 0}, "stlt_lr_scale"),
        ({"mixer": "stlt", "stlt_backend": "cuda"}, "stlt_backend"),
        ({"mixer": "attention", "stlt_nodes": 8}, "stlt_nodes"),
        ({"mixer": "stlt", "k": 1}, "mixer"),
        ({"mixer": ["stlt", "attention"]}, "mixer"),
        ({"mixer": "stlt,attention"}, "mixer"),
        ({"mixer": "stlt,attn,stlt,stlt"}, "mixer[1]"),
    ],
)
def test_bad_stlt_configs_name_the_field(config, field):
    with pytest.raises(ConfigError) as info:
        build_model({"preset": "vit_tiny_digits", **config})
    assert info.value.field == field
    assert "must" in str(info.value) or "only used" in str(info.value)


# The evaluation's gate and S_eff, against their definitions.


def _alpha(mixer, x, keep=None):
    """sigmoid(W pool(x) + b) written out: the mean over the sequence's tokens (bilateral) or the prefix mean up to
    each position (causal); `keep` (B, N) 1 at tokens, 0 at padding."""
    keep = torch.ones(x.shape[:2], dtype=x.dtype) if keep is None else keep
    if mixer.causal:
        pooled = (x * keep[..., None]).cumsum(dim=1) / keep.cumsum(dim=1).clamp(min=1)[..., None]
    else:
        pooled = (x * keep[..., None]).sum(dim=1) / keep.sum(dim=1, keepdim=True)
    return torch.sigmoid(pooled @ mixer.gate_weight.T + mixer.gate_bias)


def _spread_gates(mixer):
    """Gate probabilities from about 1 to about 0 across the nodes, moving with the input."""
    with torch.no_grad():
        mixer.gate_weight.normal_(0, 0.5)
        mixer.gate_bias.copy_(torch.linspace(5, -7, mixer.num_nodes))
    return mixer


@pytest.mark.parametrize("causal", [False, True])
def test_eval_gate_weighs_nodes_by_alpha_and_skips_those_under_a_hundredth(causal, monkeypatch):
    """The write-up's inference rule (soft, the default): mask alpha_k, 0 where alpha_k < 0.01, and a node under
    0.01 in every row of the batch is not computed; the named option hard: 1[alpha > 0.5]."""
    mixer = _spread_gates(make_mixer(causal, S=8)).eval()
    x = torch.randn(3, 10, 12, dtype=torch.float64)
    alpha = _alpha(mixer, x)
    assert ((alpha > 0.01) & (alpha < 0.5)).any() and (alpha < 0.01).any()
    seen = []
    real_mix = mixer_module.stlt_mix
    monkeypatch.setattr(mixer_module, "stlt_mix", lambda *a, **k: seen.append(a[1].shape[0]) or real_mix(*a, **k))
    for gate, mask in (("soft", torch.where(alpha >= 0.01, alpha, 0.0)), ("hard", (alpha > 0.5).double())):
        mixer.eval_gate = gate
        with torch.no_grad():
            y = mixer(x)
            full = mixer.out_proj(real_mix(mixer.value(x), mixer.sigma, mixer.omega, mixer.T, mixer.C, mask,
                                           causal=causal, backend="reference"))
        torch.testing.assert_close(y, full, rtol=1e-10, atol=1e-12)
        computed = (mask.reshape(-1, 8) > 0).any(dim=0).sum().item()
        assert seen[-1] == computed < 8, gate
    assert seen[0] > seen[1]  # the soft gate keeps the nodes between 0.01 and 0.5


@pytest.mark.parametrize("causal", [False, True])
def test_active_nodes_are_counted_over_every_evaluation_forward_and_nothing_else(causal):
    """[active (row, node) pairs, rows] over several evaluation forwards of different sizes, padding included:
    rows are sequences (bilateral) or unpadded positions (causal), active nodes those with alpha >= 0.01."""
    mixer = _spread_gates(make_mixer(causal, S=7))
    batches = [torch.randn(2, 9, 12, dtype=torch.float64), torch.randn(5, 4, 12, dtype=torch.float64)]
    padding = torch.zeros(5, 4, dtype=torch.bool)
    padding[1, 2:], padding[3, 1:] = True, True
    mixer.train()(batches[0])  # training forwards do not count, nor those before counting starts
    mixer.eval()(batches[1])
    mixer.start_node_count()
    with torch.no_grad():
        mixer(batches[0])
        mixer(batches[1], padding_mask=padding)
        mixer.train()(batches[0])
    count = mixer.stop_node_count()
    active = rows = 0
    for x, keep in ((batches[0], None), (batches[1], (~padding).double())):
        alpha = _alpha(mixer, x, keep)
        if causal:
            real = torch.ones(x.shape[:2], dtype=torch.bool) if keep is None else keep.bool()
            active, rows = active + (alpha >= 0.01)[real].sum().item(), rows + real.sum().item()
        else:
            active, rows = active + (alpha >= 0.01).sum().item(), rows + x.shape[0]
    assert count.tolist() == [active, rows]
    assert 0 < active < 7 * rows
    mixer.eval()(batches[0])  # counting has stopped
    assert mixer._node_count is None


def test_models_name_each_gated_layers_count_as_their_other_metrics():
    gpt = build_model({"model": "gpt", "dim": 16, "depth": 3, "num_heads": 2, "context_length": 8,
                       "mixer": ["stlt", "attention", "stlt"], "stlt_nodes": 3}).eval()
    with torch.no_grad(), gpt.counting_active_nodes() as counts:
        gpt(torch.randint(0, 257, (2, 8)))
        gpt(torch.randint(0, 257, (1, 5)))
    assert set(counts) == {"stlt_s_eff_l0", "stlt_s_eff_l2"} and counts["stlt_s_eff_l0"][1] == 2 * 8 + 5
    encdec = build_model({"model": "encdec", "vocab_size": 40, "dim": 16, "depth": 2, "num_heads": 2,
                          "mixer": "stlt", "decoder_mixer": "stlt", "stlt_nodes": 3}).eval()
    with torch.no_grad(), encdec.counting_active_nodes() as counts:
        encdec(torch.randint(4, 40, (3, 6)), torch.randint(4, 40, (3, 5)))
    assert set(counts) == {"stlt_s_eff_enc0", "stlt_s_eff_enc1", "stlt_s_eff_dec0", "stlt_s_eff_dec1"}
    assert counts["stlt_s_eff_enc0"][1] == 3 and counts["stlt_s_eff_dec0"][1] == 3 * 5
    assert set(encdec.mixer_stats()) == {"stlt_T_enc0", "stlt_T_enc1", "stlt_T_dec0", "stlt_T_dec1"}
