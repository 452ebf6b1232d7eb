"""GSM8K as nanochat scores a chat model, the paper's pass@10 (karpathy/nanochat at e1770a3: tasks/gsm8k.py,
nanochat/engine.py, scripts/chat_rl.py's `run_gsm8k_eval`): each test problem rendered as a user turn and the start of
the assistant's, `num_samples` completions sampled (top-k 50) with the calculator tool (an expression the model writes
between <|python_start|> and <|python_end|> is evaluated and its result forced in between <|output_start|> and
<|output_end|>), a completion correct when the number after its "#### " equals the reference's; pass@k the share of
problems with a correct completion among their first k.

Problems: the hub's openai/gsm8k (main, test) shuffled with seed 42 as nanochat does, or a copy in its layout
(`main/test-*.parquet`) in an `--include-path` folder (the way to evaluate offline).
"""

from __future__ import annotations

import ast
import operator
import re
from collections import deque
from pathlib import Path

import torch

from models.gpt import sample_next_token
from study.data.chat import render_conversation
from study.data.hub import hub_reachable
from study.data.text import CHAT_SPECIAL_TOKENS
from study.errors import UserError
from study.evals.spec import GSM8K_CHAT
from study.evals.text_tokenizer import TextTokenizer

TASK = GSM8K_CHAT
HUB_DATASET, HUB_CONFIG = "openai/gsm8k", "main"
SHUFFLE_SEED = 42  # tasks/gsm8k.py: load_dataset(...).shuffle(seed=42)
TOP_K = 50  # chat_rl.py and chat_eval.py
MAX_NEW_TOKENS = 256  # chat_rl.py's max_new_tokens
ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")  # tasks/gsm8k.py GSM_RE


def extract_answer(text: str) -> str | None:
    """The number after the first "#### ", without commas (openai/grade-school-math's normalisation)."""
    found = ANSWER.search(text)
    return found.group(1).strip().replace(",", "") if found else None


def find_local_split(include_paths: list[Path]) -> list[Path]:
    for folder in include_paths:
        files = sorted((Path(folder) / HUB_CONFIG).glob("test-*.parquet"))
        if files:
            return files
    return []


def load_problems(include_paths: list[Path]) -> list[dict]:
    """The test problems ({question, answer}) in nanochat's order."""
    import datasets

    files = find_local_split(include_paths)
    if files:
        rows = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train")
    else:
        reachable, why = hub_reachable()
        if not reachable:
            raise UserError(f"--tasks {TASK}: the problems come from the hub ({HUB_DATASET}), which cannot be reached "
                            f"({why}); put a copy in its layout ({HUB_CONFIG}/test-*.parquet) in a folder given as "
                            "--include-path (see docs/evals.md)")
        rows = datasets.load_dataset(HUB_DATASET, HUB_CONFIG, split="test")
    return [{"question": row["question"], "answer": row["answer"]} for row in rows.shuffle(seed=SHUFFLE_SEED)]


# ---- the calculator tool --------------------------------------------------------------------------------------------

_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_STRING_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789'\"()._ ")


def calculator(expression: str):
    """nanochat's `use_calculator`: an arithmetic expression of + - * / and parentheses (commas in numbers dropped,
    no powers), or a string's .count(...); None for anything else or an error. Evaluated from its syntax tree, not by
    eval: the same values Python gives, and nothing else can run."""
    expression = expression.replace(",", "")
    arithmetic = all(c in "0123456789*+-/.() " for c in expression)
    if arithmetic and "**" in expression:
        return None
    if not arithmetic and (not all(c in _STRING_CHARS for c in expression) or ".count(" not in expression):
        return None
    try:
        return _value(ast.parse(expression, mode="eval").body, arithmetic)
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError, RecursionError):
        return None


def _value(node: ast.AST, arithmetic: bool):
    if isinstance(node, ast.Constant) and (isinstance(node.value, str) != arithmetic) \
            and isinstance(node.value, int | float | str) and not isinstance(node.value, bool):
        return node.value
    if arithmetic and isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        return _ARITHMETIC[type(node.op)](_value(node.left, True), _value(node.right, True))
    if arithmetic and isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
        return _SIGNS[type(node.op)](_value(node.operand, True))
    if not arithmetic and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "count" and not node.keywords and len(node.args) == 1:
        return _value(node.func.value, False).count(_value(node.args[0], False))
    raise ValueError("not a calculator expression")


# ---- sampling with the tool -----------------------------------------------------------------------------------------

class ChatText:
    """Text and the chat tokens of a tokenizer with `chat` (study/data/text.py), as nanochat's tokenizer renders
    them."""

    def __init__(self, tokenizer):
        self.tokenizer, self.plain = tokenizer, TextTokenizer(tokenizer)
        self.special = {name: tokenizer.special_id(name) for name in CHAT_SPECIAL_TOKENS}
        self.names = {i: name for name, i in self.special.items()}

    def encode(self, text: str) -> list[int]:
        return self.plain.encode(text)

    def decode(self, ids: list[int]) -> str:
        """Text, each chat token written as its name."""
        text, run = [], []
        for i in [*ids, None]:
            if i is None or i in self.names:
                text.append(self.plain.decode(run))
                run = []
                if i is not None:
                    text.append(self.names[i])
            else:
                run.append(i)
        return "".join(text)

    def prompt(self, question: str) -> list[int]:
        """nanochat's `render_for_completion` of a one-question conversation: the user's turn as training renders
        it, then the start of the assistant's."""
        ids, _ = render_conversation([{"role": "user", "content": question}], self.tokenizer)
        return [*ids.tolist(), self.special["<|assistant_start|>"]]


@torch.no_grad()
def sample_with_calculator(model, text: ChatText, prompt: list[int], num_samples: int, *, max_new_tokens: int,
                           temperature: float, top_k: int | None, generator: torch.Generator) -> list[list[int]]:
    """nanochat's `Engine.generate_batch`: `num_samples` completions of `prompt` (the tokens after it, terminal
    <|assistant_end|> or <|bos|> left out), the calculator's results forced in after each <|python_end|>."""
    device = next(model.parameters()).device
    special = text.special
    ends = {special["<|assistant_end|>"], special["<|bos|>"]}
    rows = [{"tokens": [], "forced": deque(), "expression": None, "done": False} for _ in range(num_samples)]
    ids = torch.tensor([prompt] * num_samples, device=device)
    try:
        cache = model.new_cache(len(prompt) + max_new_tokens)
    except NotImplementedError:  # a mixer without a decoding state: the whole sequence each step
        cache = None
    logits = model(ids, cache=cache)[:, -1] if cache is not None else model(ids)[:, -1]
    for _ in range(max_new_tokens):
        sampled = sample_next_token(logits.float(), temperature, top_k, generator)[:, 0].tolist()
        column = []
        for row, token in zip(rows, sampled):
            token = row["forced"].popleft() if row["forced"] else token
            column.append(token)
            if row["done"]:
                continue
            if token in ends:
                row["done"] = True
                continue
            row["tokens"].append(token)
            if token == special["<|python_start|>"]:
                row["expression"] = []
            elif token == special["<|python_end|>"] and row["expression"] is not None:
                result = calculator(text.decode(row["expression"])) if row["expression"] else None
                if result is not None:
                    row["forced"].extend([special["<|output_start|>"], *text.encode(str(result)),
                                          special["<|output_end|>"]])
                row["expression"] = None
            elif row["expression"] is not None:
                row["expression"].append(token)
        if all(row["done"] for row in rows):
            break
        step = torch.tensor(column, device=device)[:, None]
        if cache is not None:
            logits = model(step, cache=cache)[:, -1]
        else:
            ids = torch.cat([ids, step], dim=1)
            logits = model(ids[:, -model.config.context_length:])[:, -1]
    return [row["tokens"] for row in rows]


def evaluate_gsm8k(model, tokenizer, problems: list[dict], *, num_samples: int, temperature: float,
                   ks: tuple[int, ...] = (1, 10), max_new_tokens: int = MAX_NEW_TOKENS, seed: int = 0,
                   log=print) -> tuple[dict[str, float], list[dict]]:
    """({"pass_at_<k>": value} for every k <= num_samples, one record per problem)."""
    text = ChatText(tokenizer)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    records = []
    try:
        for number, problem in enumerate(problems, start=1):
            completions = sample_with_calculator(model, text, text.prompt(problem["question"]), num_samples,
                                                 max_new_tokens=max_new_tokens, temperature=temperature,
                                                 top_k=TOP_K, generator=generator)
            reference = extract_answer(problem["answer"])
            answers = [extract_answer(text.decode(c)) for c in completions]
            records.append({"question": problem["question"], "reference": reference, "answers": answers,
                            "correct": [a == reference for a in answers]})
            if number % 50 == 0 or number == len(problems):
                passed = sum(any(r["correct"]) for r in records)
                log(f"{TASK}: {number}/{len(problems)} problems, {passed} with a correct completion")
    finally:
        model.train(was_training)
    correct = [r["correct"] for r in records]
    return {f"pass_at_{k}": pass_at(correct, k) for k in ks if k <= num_samples}, records


def pass_at(correct: list[list[bool]], k: int) -> float:
    """The share of problems with a correct sample among their first k (chat_rl.py's pass@k)."""
    return sum(any(samples[:k]) for samples in correct) / len(correct)
