"""The lm-evaluation-harness adapter (study/evals/harness.py) against numbers computed here by hand, and the harness
driven end to end over the local task fixtures in tests/fixtures/evals/ (ARC, MMLU and GSM8K formats), no hub.

A tiny byte-level GPT trained for a few hundred steps to memorise the fixtures' right answers must score 1.0 on the
multiple-choice tasks; on GSM8K it is taught one wrong answer, so exact match must be exactly 3/4."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import models
from models.gpt import GPTConfig
from study.data.text import Tokenizer
from study.evals.evaluate import evaluate_model, metric_name
from study.evals.harness import LapstudyLM, TextTokenizer

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "evals"
BYTES = Tokenizer("byte")


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)  # the fixtures' data_files are relative to the repository root


def tiny_gpt(seed: int = 0, context_length: int = 192, depth: int = 2):
    torch.manual_seed(seed)
    return models.build_model({"preset": "gpt_tiny", "depth": depth, "context_length": context_length}).eval()


def _lines(name):
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


GSM_WRONG = 2  # the GSM8K item the model is taught a wrong final answer for


def _memorised_texts() -> list[str]:
    texts = []
    for row in _lines("arc.jsonl"):
        answer = row["choices"]["text"][row["choices"]["label"].index(row["answerKey"])]
        texts.append(f"Question: {row['question']}\nAnswer: {answer}")
    for row in _lines("mmlu.jsonl"):
        c = row["choices"]
        texts.append(f"{row['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer: "
                     + "ABCD"[row["answer"]])
    for i, row in enumerate(_lines("gsm8k.jsonl")):
        answer = row["answer"] if i != GSM_WRONG else row["answer"].rsplit("#### ", 1)[0] + "#### 99"
        texts.append(f"Question: {row['question']}\nAnswer: {answer}\n\nQuestion:")
    return texts


@pytest.fixture(scope="module")
def trained():
    """A tiny GPT that has memorised the fixtures' answers (each text after an end-of-text, as training packs)."""
    model = tiny_gpt(1, depth=1)
    seqs = [torch.tensor([BYTES.eot] + list(t.encode())) for t in _memorised_texts()]
    width = max(len(s) for s in seqs)
    batch = torch.full((len(seqs), width), BYTES.eot)
    mask = torch.zeros((len(seqs), width - 1), dtype=torch.bool)
    for i, s in enumerate(seqs):
        batch[i, :len(s)] = s
        mask[i, :len(s) - 1] = True
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model.train()
    for _ in range(220):
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits[mask], batch[:, 1:][mask])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1, f"the tiny model did not memorise the fixtures (loss {loss.item():.3f})"
    return model.eval()


def _by_hand(model, context: str, continuation: str) -> tuple[float, bool]:
    """log p(continuation | context) from the model's logits, one position at a time, and whether it is greedy."""
    ids = [BYTES.eot] + list(context.encode()) + list(continuation.encode())  # a document starts after eot
    n = len(continuation.encode())
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids]))[0].double(), dim=-1)
    total, greedy = 0.0, True
    for position in range(len(ids) - n, len(ids)):
        total += logprobs[position - 1, ids[position]].item()
        greedy &= int(logprobs[position - 1].argmax()) == ids[position]
    return total, greedy


class _Request:
    def __init__(self, *args):
        self.args = args


def test_loglikelihood_is_the_sum_of_log_softmax_over_the_continuation():
    model = tiny_gpt(3)
    lm = LapstudyLM(model, BYTES, batch_size=2)
    pairs = [("Question: why?\nAnswer:", " because"), ("abc", "d"), ("The sky is", " blue and wide"),
             ("x", " y z")]
    got = lm.loglikelihood([_Request(c, x) for c, x in pairs])
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        expected, expected_greedy = _by_hand(model, context, continuation)
        assert logprob == pytest.approx(expected, abs=1e-4)
        assert greedy == expected_greedy
    # an empty context is conditioned on end-of-text
    (logprob, _), = lm.loglikelihood([_Request("", "hi")])
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([[BYTES.eot, ord("h")]]))[0].double(), dim=-1)
    assert logprob == pytest.approx(lp[0, ord("h")].item() + lp[1, ord("i")].item(), abs=1e-4)


class NextByte(torch.nn.Module):
    """A constructed language model: after byte b it puts probability ~1 on byte b + 1."""

    def __init__(self):
        super().__init__()
        self.config = GPTConfig(context_length=32)
        self.weight = torch.nn.Parameter(torch.zeros(()))

    def forward(self, idx):
        return F.one_hot((idx + 1) % 257, 257).float() * 20.0 + self.weight


def test_is_greedy_on_a_constructed_case():
    lm = LapstudyLM(NextByte(), BYTES)
    (lp_d, greedy_d), (_, greedy_e), (_, greedy_de), (_, greedy_df) = lm.loglikelihood(
        [_Request("abc", "d"), _Request("abc", "e"), _Request("abc", "de"), _Request("abc", "df")])
    assert greedy_d and greedy_de  # d follows c, e follows d
    assert not greedy_e and not greedy_df
    assert lp_d == pytest.approx(-math.log(1 + 256 * math.exp(-20.0)), abs=1e-6)


def test_loglikelihood_rolling_is_the_text_log_likelihood_after_end_of_text():
    model = tiny_gpt(4, context_length=16)
    lm = LapstudyLM(model, BYTES)
    text = "a rolling window over more than sixteen bytes of text"
    (total,) = lm.loglikelihood_rolling([_Request(text)])
    # by hand: disjoint windows of 16 targets, each predicted from (at most) the 16 tokens before it
    ids = [BYTES.eot] + list(text.encode())
    expected = 0.0
    with torch.no_grad():
        for start in range(1, len(ids), 16):
            stop = min(start + 16, len(ids))
            window = ids[max(0, stop - 17):stop]
            lp = torch.log_softmax(model(torch.tensor([window[:-1]]))[0].double(), dim=-1)
            for t in range(start, stop):
                expected += lp[t - 1 - max(0, stop - 17), ids[t]].item()
    assert total == pytest.approx(expected, abs=1e-3)


def test_generation_stops_at_the_stop_sequence(trained):
    lm = LapstudyLM(trained, BYTES)
    question = _lines("gsm8k.jsonl")[0]["question"]
    full = lm.generate(f"Question: {question}\nAnswer:", max_gen_toks=40)
    assert "Question:" in full  # it learned to go on with the next question ...
    cut = lm.generate(f"Question: {question}\nAnswer:", until=["Question:"], max_gen_toks=40)
    assert cut == full[:full.index("Question:")]  # ... which the stop sequence cuts off
    assert cut.strip().endswith("#### 7")
    assert lm.generate(f"Question: {question}\nAnswer:", until="#", max_gen_toks=40) == full[:full.index("#")]
    assert len(TextTokenizer(BYTES).encode(lm.generate("zzz", max_gen_toks=5))) <= 5


def test_multiple_choice_and_gsm8k_through_simple_evaluate(trained):
    metrics = evaluate_model(trained, BYTES, ["arc_easy", "mmlu", "gsm8k"], include_path=[FIXTURES],
                             include_defaults=False, log=lambda _: None)
    assert metrics[metric_name("arc_easy", "acc")] == 1.0
    assert metrics[metric_name("mmlu", "acc")] == 1.0
    assert metrics["eval_gsm8k_exact_match_strict_match"] == pytest.approx(3 / 4)
    assert metrics["eval_gsm8k_exact_match_flexible_extract"] == pytest.approx(3 / 4)


def _mc_accuracy_by_hand(model) -> float:
    rows = _lines("mmlu.jsonl")
    right = 0
    for row in rows:
        c = row["choices"]
        context = f"{row['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"
        scores = [_by_hand(model, context, f" {letter}")[0] for letter in "ABCD"]
        right += max(range(4), key=lambda i: scores[i]) == row["answer"]
    return right / len(rows)


def test_a_random_model_scores_what_its_logits_say_and_chance_on_average():
    model = tiny_gpt(11)
    metrics = evaluate_model(model, BYTES, ["mmlu"], include_path=[FIXTURES], include_defaults=False,
                             log=lambda _: None)
    assert metrics["eval_mmlu_acc"] == pytest.approx(_mc_accuracy_by_hand(model))
    # over random models the accuracy is chance, 1/4: the mean of 24 models' (8 questions each) within 3 sigma
    accuracies = [_mc_accuracy_by_hand(tiny_gpt(100 + s)) for s in range(24)]
    sigma = math.sqrt(0.25 * 0.75 / (24 * 8))
    assert abs(sum(accuracies) / len(accuracies) - 0.25) < 3 * sigma * 1.6  # answers are not independent across models


def test_a_hub_task_fails_fast_offline_naming_include_path(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from study.errors import UserError

    with pytest.raises(UserError, match="--include-path"):
        evaluate_model(tiny_gpt(0), BYTES, ["arc_challenge"], include_path=[FIXTURES], log=lambda _: None)
