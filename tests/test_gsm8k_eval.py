"""GSM8K as nanochat scores a chat model (study/evals/gsm8k.py): the answer extraction and the calculator against
their definitions (nanochat's regex, Python's own arithmetic), the calculator's results forced into a sample after
<|python_end|>, the decoding cache giving what full recomputation gives, and pass@k counted per problem over the
first k samples."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from models import build_model
from study.data.text import Tokenizer
from study.evals import gsm8k
from study.evals.evaluate import evaluate_model

FIXTURE = Path(__file__).parent / "fixtures" / "chat" / "openai" / "gsm8k"
TOKENIZER = dataclasses.replace(Tokenizer("byte"), chat=True)
TEXT = gsm8k.ChatText(TOKENIZER)
NANOCHAT_GSM_RE = re.compile(r"#### (\-?[0-9\.\,]+)")  # nanochat tasks/gsm8k.py, as written there


@pytest.mark.parametrize("text", ["so #### 1,234 apples", "#### -5", "#### 3.50\n#### 7", "no marker 12",
                                  "####12", "#### ,", "The answer: #### 0"])
def test_the_answer_is_what_nanochats_regex_finds_without_commas(text):
    found = NANOCHAT_GSM_RE.search(text)
    assert gsm8k.extract_answer(text) == (found.group(1).strip().replace(",", "") if found else None)


def test_the_calculator_gives_pythons_arithmetic():
    rng = random.Random(0)

    def expression(depth: int) -> str:
        if depth == 0 or rng.random() < 0.3:
            return rng.choice([str(rng.randint(0, 999)), f"{rng.randint(0, 99)}.{rng.randint(0, 99)}",
                               f"{rng.randint(1, 9)},{rng.randint(100, 999)}"])
        left, right = expression(depth - 1), expression(depth - 1)
        return rng.choice([f"{left} {rng.choice('+-*/')} {right}", f"({left})", f"-{left}"])

    checked = 0
    for _ in range(400):
        text = expression(4)
        try:
            expected = eval(text.replace(",", ""), {"__builtins__": {}}, {})  # the definition: Python's arithmetic
        except (ZeroDivisionError, SyntaxError):
            expected = None
        assert gsm8k.calculator(text) == expected, text
        checked += expected is not None
    assert checked > 300
    assert gsm8k.calculator("'strawberry'.count('r')") == 3


@pytest.mark.parametrize("text", ["2**10", "__import__('os').system('true')", "open('x')", "'ab'.upper()",
                                  "1/0", "x + 1", "'a'.count('a') + 1", "[1, 2]", "", "()"])
def test_the_calculator_refuses_anything_else(text):
    assert gsm8k.calculator(text) is None


class ScriptedChatModel(nn.Module):
    """Greedy decoding of it writes, after each question's prompt, that question's script (token ids), position by
    position after the prompt; no decoding cache, so every step is a forward over the whole sequence."""

    def __init__(self, scripts: dict[str, list[int]], vocab_size: int):
        super().__init__()
        self.scripts, self.anchor = scripts, nn.Parameter(torch.zeros(()))
        self.config = type("Config", (), {"vocab_size": vocab_size, "context_length": 4096})()

    def new_cache(self, capacity: int = 0):
        raise NotImplementedError

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(idx.shape[0], idx.shape[1], self.config.vocab_size)
        assistant = TEXT.special["<|assistant_start|>"]
        for row, ids in enumerate(idx.tolist()):
            start = ids.index(assistant) + 1
            question = TEXT.decode(ids[ids.index(TEXT.special["<|user_start|>"]) + 1:start - 2])
            script = self.scripts[question]
            position = len(ids) - start
            logits[row, -1, script[min(position, len(script) - 1)]] = 10.0
        return logits


def _script(*pieces) -> list[int]:
    return [token for piece in pieces for token in (TEXT.encode(piece) if isinstance(piece, str) else [piece])]


def test_the_calculators_result_is_forced_in_after_python_end():
    s = TEXT.special
    filler = TEXT.encode("Z")[0]  # what the model would write where the tool's output goes
    script = _script("50 minutes: ", s["<|python_start|>"], "12/60", s["<|python_end|>"], *[filler] * 5,
                     " a minute, so #### 10", s["<|assistant_end|>"], "never")
    model = ScriptedChatModel({"q": script}, TOKENIZER.vocab_size)
    [completion] = gsm8k.sample_with_calculator(model, TEXT, TEXT.prompt("q"), 1, max_new_tokens=64, temperature=0.0,
                                                top_k=50, generator=torch.Generator().manual_seed(0))
    assert TEXT.decode(completion) == ("50 minutes: <|python_start|>12/60<|python_end|><|output_start|>0.2"
                                       "<|output_end|> a minute, so #### 10")


def test_pass_at_k_counts_problems_with_a_correct_answer_among_their_first_k_samples():
    problems = gsm8k.load_problems([FIXTURE])
    assert len(problems) == 6 and all("####" in p["answer"] for p in problems)
    right = {p["question"]: _script(f"#### {gsm8k.extract_answer(p['answer'])}", TEXT.special["<|assistant_end|>"])
             for p in problems}
    model = ScriptedChatModel(right, TOKENIZER.vocab_size)
    metrics, records = gsm8k.evaluate_gsm8k(model, TOKENIZER, problems, num_samples=2, temperature=0.0, log=lambda m: 0)
    assert metrics == {"pass_at_1": 1.0} and all(r["correct"] == [True, True] for r in records)
    wrong = {q: _script("#### 123456789", TEXT.special["<|assistant_end|>"]) for q in list(right)[:2]}
    model = ScriptedChatModel({**right, **wrong}, TOKENIZER.vocab_size)
    metrics, _ = gsm8k.evaluate_gsm8k(model, TOKENIZER, problems, num_samples=1, temperature=0.0, log=lambda m: 0)
    assert metrics == {"pass_at_1": pytest.approx(4 / 6)}


def test_pass_at_k_reads_the_first_k_samples_of_each_problem():
    correct = [[False, True, False], [True, False, False], [False, False, False], [False, False, True]]
    assert [gsm8k.pass_at(correct, k) for k in (1, 2, 3)] == [0.25, 0.5, 0.75]


def _tiny_chat_gpt() -> nn.Module:
    torch.manual_seed(0)
    return build_model({"preset": "gpt_tiny", "block_style": "nanochat", "vocab_size": TOKENIZER.vocab_size,
                        "context_length": 256, "laplacian_schedule": "ramp", "start_layer": 1, "increment": 1,
                        "max_count": 2}).eval()


def test_sampling_with_the_decoding_cache_equals_full_recomputation(monkeypatch):
    model = _tiny_chat_gpt()
    prompt = TEXT.prompt("Eli has 9 bags with 7 apples each. How many apples?")

    def samples():
        return gsm8k.sample_with_calculator(model, TEXT, prompt, 3, max_new_tokens=40, temperature=1.0, top_k=50,
                                            generator=torch.Generator().manual_seed(7))

    cached = samples()
    monkeypatch.setattr(type(model), "new_cache", lambda self, capacity=0: (_ for _ in ()).throw(NotImplementedError))
    assert samples() == cached and len({tuple(s) for s in cached}) > 1  # three different draws


def test_pass_at_k_grows_with_k_on_a_real_model_and_is_logged_by_name():
    metrics = evaluate_model(_tiny_chat_gpt(), TOKENIZER, ["gsm8k_chat"], include_path=[FIXTURE], num_samples=10,
                             temperature=1.0, seed=3, log=lambda m: 0)
    assert set(metrics) == {"eval_gsm8k_chat_pass_at_1", "eval_gsm8k_chat_pass_at_10"}
    assert 0.0 <= metrics["eval_gsm8k_chat_pass_at_1"] <= metrics["eval_gsm8k_chat_pass_at_10"] <= 1.0


def test_a_model_without_chat_tokens_is_refused():
    from study.errors import UserError

    with pytest.raises(UserError, match="gsm8k_chat.*chat tokens"):
        evaluate_model(_tiny_chat_gpt(), Tokenizer("byte"), ["gsm8k_chat"], include_path=[FIXTURE])


def test_offline_without_a_local_copy_the_hub_is_named(monkeypatch):
    from study.errors import UserError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="openai/gsm8k.*--include-path"):
        gsm8k.load_problems([])
