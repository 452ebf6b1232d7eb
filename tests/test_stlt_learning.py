"""Tiny models whose every token mixer is an STLT layer learn: a causal GPT gets below the bigram entropy of a text
corpus (impossible without mixing information across positions), and a ViT learns the scikit-learn digits.

Both train the way a study trial does: param_groups with the slow sigma/omega group, set_training_step every step,
and the model's regulariser added to the loss (the defaults start it after this short run, as the write-up does:
switched on from step 0, the usage penalty closes every gate before mixing has paid off)."""

from pydoc_data.topics import topics

import pytest
import torch
import torch.nn.functional as F

from digits_training import train_on_digits
from models import build_model
from tests.stlt_fixtures import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def validation_bigram_entropy(tokens: torch.Tensor, vocab: int) -> float:
    """H(x_{t+1} | x_t) in nats on the tokens themselves: no model that sees only the previous token can do better."""
    joint = torch.bincount(tokens[:-1] * vocab + tokens[1:], minlength=vocab * vocab).double().reshape(vocab, vocab)
    conditional = joint / joint.sum(dim=1, keepdim=True).clamp(min=1)
    return (-(joint * torch.log(conditional.clamp(min=1e-300))).sum() / joint.sum()).item()


def test_tiny_causal_stlt_gpt_beats_the_bigram_entropy():
    torch.manual_seed(0)
    text = "\n".join(topics[name] for name in sorted(topics)).encode("utf-8")[:300_000]
    data = torch.tensor(list(text), dtype=torch.long)
    train, val = data[: int(0.9 * len(data))], data[int(0.9 * len(data)):]
    bigram = validation_bigram_entropy(val, 256)
    length, batch_size, max_steps = 64, 32, 300
    model = build_model({"model": "gpt", "vocab_size": 256, "context_length": length, "dim": 64, "depth": 2,
                         "num_heads": 2, "mixer": "stlt", "stlt_nodes": 16})
    opt = torch.optim.AdamW(model.param_groups(weight_decay=0.0, slow_lr_scale=0.1), lr=3e-3)

    def windows(source, count, generator=None):
        start = torch.randint(0, len(source) - length - 1, (count,), generator=generator)
        idx = start[:, None] + torch.arange(length + 1)
        return source[idx[:, :-1]], source[idx[:, 1:]]

    val_x, val_y = windows(val, 256, torch.Generator().manual_seed(1))
    history = []
    for step in range(max_steps):
        model.train()
        model.set_training_step(step, max_steps)
        x, y = windows(train, batch_size)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) + model.regularization_loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 24:
            model.eval()
            with torch.no_grad(), model.counting_active_nodes() as nodes:
                history.append(F.cross_entropy(model(val_x).flatten(0, 1), val_y.flatten()).item())
            if history[-1] < bigram - 0.05:
                break
    assert history[-1] < bigram - 0.05, f"validation loss {history} vs bigram entropy {bigram:.3f}"
    assert all(active > 0 for active, _ in nodes.values()), nodes


def test_tiny_stlt_vit_learns_digits():
    torch.manual_seed(0)
    model = build_model({"preset": "vit_tiny_digits", "mixer": "stlt", "stlt_nodes": 16})
    optimizer = torch.optim.AdamW(model.param_groups(weight_decay=0.05, slow_lr_scale=0.1), lr=2e-3)
    best, epochs = train_on_digits(model, optimizer, epochs=20, target=0.9)
    assert best >= 0.9, f"best validation accuracy {best:.3f} after {epochs} epochs"
