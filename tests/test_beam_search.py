"""Beam search and greedy decoding (models/beam_search.py) against brute force: every hypothesis up to max_len
scored with teacher-forced logits of the full model, not with the cached decoding steps the search uses."""

import itertools

import pytest
import torch

from models.beam_search import beam_search, greedy_search, length_penalty
from models.encdec import EncDecConfig, EncoderDecoder
from tests.stlt_fixtures import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

PAD, BOS, EOS = 0, 1, 2
BODY = (3, 4)  # the tokens a hypothesis holds before its EOS
V = 5


def make_model(kind: str, seed: int) -> EncoderDecoder:
    torch.manual_seed(seed)
    stlt = dict(mixer="stlt", decoder_mixer="stlt", laplacian_sites="cross", mixer_options={"stlt_nodes": 4})
    config = EncDecConfig(dim=16, depth=1, num_heads=2, vocab_size=V, k=1, **(stlt if kind == "stlt" else {}))
    return EncoderDecoder(config).double().eval()


def sources():
    """Three sources of different lengths, right-padded."""
    src = torch.tensor([[3, 4, 4, 3, 3], [4, 3, PAD, PAD, PAD], [4, 4, 4, 3, PAD]])
    return src


def brute_force(model, src, max_len, alpha, penalty):
    """The best score log P(y | x) / lp(|y|) over every y = body tokens then EOS, |y| <= max_len, for each source."""
    hypotheses = [list(body) + [EOS] for n in range(max_len) for body in itertools.product(BODY, repeat=n)]
    best = []
    with torch.no_grad():
        for i in range(src.shape[0]):
            scored = []
            for y in hypotheses:
                decoder_in = torch.tensor([[BOS] + y[:-1]])
                log_probs = torch.log_softmax(model(src[i:i + 1], decoder_in)[0], dim=-1)
                lp = log_probs[torch.arange(len(y)), torch.tensor(y)].sum()
                scored.append((float(lp / length_penalty(len(y), alpha, penalty)), y))
            best.append(max(scored))
    return best


@pytest.mark.parametrize("kind", ["attention", "stlt"])
@pytest.mark.parametrize("alpha, penalty", [(0.6, "gnmt"), (1.0, "fairseq"), (0.0, "gnmt")])
def test_a_beam_as_wide_as_the_hypothesis_space_finds_the_exhaustive_best(kind, alpha, penalty):
    """Beam size V^L = 5^4 >= every extension of every step: the search scores all 1 + 2 + 4 + 8 hypotheses and
    returns the best by brute force, per sentence of a padded batch."""
    max_len = 4
    model = make_model(kind, seed=0)
    src = sources()
    result = beam_search(model, src, beam_size=V ** max_len, alpha=alpha, penalty=penalty, bos_id=BOS, eos_id=EOS,
                         pad_id=PAD, max_len=max_len)
    for i, (score, y) in enumerate(brute_force(model, src, max_len, alpha, penalty)):
        n = len(y)
        assert result.tokens[i, :n].tolist() == y and (result.tokens[i, n:] == PAD).all()
        assert result.lengths[i] == n
        assert result.scores[i].item() == pytest.approx(score, abs=1e-9)
        assert result.log_probs[i].item() == pytest.approx(score * float(length_penalty(n, alpha, penalty)), abs=1e-9)


def test_the_exhaustive_check_has_teeth():
    """On the models above, some sentence's best hypothesis is not greedy's, so the equality is not trivial."""
    differs = 0
    for kind, seed in itertools.product(["attention", "stlt"], range(2)):
        model = make_model(kind, seed)
        best = brute_force(model, sources(), 4, 0.6, "gnmt")
        greedy = greedy_search(model, sources(), bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=4).tokens
        differs += sum(greedy[i, : len(y)].tolist() != y for i, (_, y) in enumerate(best))
    assert differs > 0


@pytest.mark.parametrize("kind", ["attention", "stlt"])
@pytest.mark.parametrize("seed", range(3))
def test_beam_of_one_is_greedy(kind, seed):
    torch.manual_seed(100 + seed)
    model = make_model(kind, seed)
    src = torch.randint(3, V, (6, 7))
    src[2, 3:] = PAD
    greedy = greedy_search(model, src, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=9, alpha=0.6)
    beam = beam_search(model, src, beam_size=1, alpha=0.6, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=9)
    assert torch.equal(beam.tokens, greedy.tokens) and torch.equal(beam.lengths, greedy.lengths)
    torch.testing.assert_close(beam.scores, greedy.scores)


def test_batched_search_equals_one_sentence_at_a_time():
    """Padding and the other sentences of a batch change no sentence's result (beam 4, Transformer-base's alpha)."""
    model = make_model("attention", seed=1)
    src = sources()
    batch = beam_search(model, src, beam_size=4, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=6)
    for i in range(src.shape[0]):
        row = src[i:i + 1, : int((src[i] != PAD).sum())]
        alone = beam_search(model, row, beam_size=4, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=6)
        assert torch.equal(alone.tokens[0], batch.tokens[i])
        torch.testing.assert_close(alone.scores[0], batch.scores[i])


def test_length_penalties():
    assert float(length_penalty(1, 0.6)) == pytest.approx(1.0)  # GNMT's is 1 at length 1
    assert float(length_penalty(7, 0.6)) == pytest.approx(2.0 ** 0.6)  # (5 + 7) / 6 = 2
    assert float(length_penalty(7, 0.6, "fairseq")) == pytest.approx(7 ** 0.6)
    with pytest.raises(ValueError):
        length_penalty(3, 0.6, "wu")
