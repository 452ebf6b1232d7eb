"""nanochat's chat data, pure Python and numpy (no Ray): its conversation sets as lists of messages (tasks/*.py at
commit e1770a3), its chat template (nanochat/tokenizer.py `render_conversation`), and the Ray Data batch functions
that turn conversations into token windows with a loss mask.

A conversation is a list of messages `{"role": "user" | "assistant" | "system", "content": ...}`; an assistant's
content is a string or a list of parts `{"type": "text" | "python" | "python_output", "text": ...}` (GSM8K's
calculator calls). Rendered: <|bos|>, then per user message <|user_start|> text <|user_end|>, per assistant message
<|assistant_start|> text <|assistant_end|> (python parts inside <|python_start|> <|python_end|>, outputs inside
<|output_start|> <|output_end|>). The mask is 1 on what the assistant is trained to produce: its text, its python
parts and their delimiters, and <|assistant_end|>; 0 on <|bos|>, the user's turns, <|assistant_start|> and the
python outputs (they come from the tool at test time).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from study.data.config import SPELLING_PARTS
from study.data.fetch import fetch_once
from study.data.spelling import read_words, simple_spelling, simple_spelling_words, spelling_bee
from study.data.text import Tokenizer

MC_LETTERS = ("A", "B", "C", "D")


def render_mc(question: str, letters, choices) -> str:
    """tasks/common.py `render_mc`: the letter after each choice, no space after '=' (the answer is the bare letter)."""
    query = f"Multiple Choice question: {question}\n"
    query += "".join(f"- {choice}={letter}\n" for letter, choice in zip(letters, choices))
    return query + "\nRespond only with the letter of the correct answer."


def _gsm8k_parts(answer: str) -> list[dict]:
    """tasks/gsm8k.py: <<expr=result>> becomes a python part and its output."""
    parts = []
    for piece in re.split(r"(<<[^>]+>>)", answer):
        if piece.startswith("<<") and piece.endswith(">>"):
            inner = piece[2:-2]
            expr, result = inner.rsplit("=", 1) if "=" in inner else (inner, "")
            parts += [{"type": "python", "text": expr}, {"type": "python_output", "text": result}]
        else:
            parts.append({"type": "text", "text": piece})
    return parts


def conversation_of(part: str, row) -> list[dict]:
    """The messages of one row of a part (`ChatPart.name`), as nanochat's task of that dataset makes them."""
    if part == "jsonl":  # nanochat's CustomJSON: a list of messages per line; or {"messages": [...]}
        row = json.loads(row) if isinstance(row, str) else row
        return row["messages"] if isinstance(row, dict) else row
    if part == "smoltalk":
        return row["messages"]
    if part.startswith("mmlu"):
        row = row.get("train") or row  # auxiliary_train rows are wrapped in a 'train' struct (tasks/mmlu.py)
        return [{"role": "user", "content": render_mc(row["question"], MC_LETTERS, row["choices"])},
                {"role": "assistant", "content": MC_LETTERS[row["answer"]]}]
    if part == "gsm8k":
        return [{"role": "user", "content": row["question"]},
                {"role": "assistant", "content": _gsm8k_parts(row["answer"])}]
    if part.startswith("arc"):
        letters = row["choices"]["label"]
        return [{"role": "user", "content": render_mc(row["question"], letters, row["choices"]["text"])},
                {"role": "assistant", "content": row["answerKey"]}]
    raise ValueError(f"unknown conversation part {part!r}")


def render_conversation(messages: list[dict], tokenizer: Tokenizer,
                        max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """nanochat's `render_conversation`: (ids, mask) int32 / int8 of the same length, cut to `max_tokens`. A first
    system message is merged into the user message after it; then turns must alternate user, assistant."""
    if messages and messages[0]["role"] == "system":
        if len(messages) < 2 or messages[1]["role"] != "user":
            raise ValueError("a system message must be followed by a user message")
        messages = [{"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]},
                    *messages[2:]]
    if not messages:
        raise ValueError("a conversation needs at least one message")
    special = tokenizer.special_id
    ids, mask = [], []

    def add(tokens, value: int) -> None:
        tokens = [tokens] if isinstance(tokens, int) else list(tokens)
        ids.extend(tokens)
        mask.extend([value] * len(tokens))

    def encode(text: str):
        return tokenizer.encode([text])[0].tolist()

    add(special("<|bos|>"), 0)
    for i, message in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise ValueError(f"message {i} is from {message['role']}, expected {expected} (turns alternate)")
        content = message["content"]
        if expected == "user":
            if not isinstance(content, str):
                raise ValueError(f"message {i}: a user message is a string")
            add(special("<|user_start|>"), 0)
            add(encode(content), 0)
            add(special("<|user_end|>"), 0)
            continue
        add(special("<|assistant_start|>"), 0)
        for part in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            if part["type"] == "text":
                add(encode(part["text"]), 1)
            elif part["type"] == "python":
                add(special("<|python_start|>"), 1)
                add(encode(part["text"]), 1)
                add(special("<|python_end|>"), 1)
            elif part["type"] == "python_output":  # the tool's output: not the assistant's to predict
                add(special("<|output_start|>"), 0)
                add(encode(part["text"]), 0)
                add(special("<|output_end|>"), 0)
            else:
                raise ValueError(f"message {i}: unknown part type {part['type']!r}")
        add(special("<|assistant_end|>"), 1)
    ids, mask = ids[:max_tokens], mask[:max_tokens]
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.int8)


def to_messages(rows: list, part: str) -> dict:
    """Rows of a part (JSON lines for jsonl, row dicts otherwise) -> {"messages": JSON text of each conversation}."""
    return {"messages": np.array([json.dumps(conversation_of(part, row)) for row in rows], dtype=object)}


@dataclass(frozen=True)
class PartFiles:
    """What a Ray Data task needs to read one part: its files (parquet, or one .jsonl), how to open them, how many
    rows (the first `stop`)."""

    name: str
    files: tuple[str, ...]
    filesystem: object | None = None  # pyarrow filesystem of hub files; None: local paths
    stop: int | None = None
    url: str | None = None  # a local file's source, fetched when the file is missing
    size: int | None = None  # spelling parts: rows generated
    split: str = "train"


def read_parts(batch: dict, parts: list[PartFiles], rows_per_batch: int = 1024):
    """Ray Data map_batches over {"part": index} rows (one per part and repeat): yields each part's conversations,
    in file order, `rows_per_batch` at a time. One operator reads every part (a read operator per part, each with
    its own share of the CPUs Ray Data may use, starves the ones after it on a small node)."""
    import pyarrow.parquet as pq

    for index in batch["part"]:
        part = parts[int(index)]
        if part.name in SPELLING_PARTS:
            yield from _spelling_rows(part, rows_per_batch)
            continue
        left = part.stop
        for path in part.files:
            if part.name == "jsonl":
                with open(fetch_once(path, part.url)) as f:
                    lines = [line for line in f if line.strip()]
                chunks = (lines[i:i + rows_per_batch] for i in range(0, len(lines), rows_per_batch))
            else:
                source = part.filesystem.open_input_file(path) if part.filesystem is not None else path
                chunks = (b.to_pylist() for b in pq.ParquetFile(source).iter_batches(batch_size=rows_per_batch))
            for rows in chunks:
                rows = rows if left is None else rows[:left]
                if rows:
                    yield to_messages(rows, part.name)
                if left is not None:
                    left -= len(rows)
                    if left <= 0:
                        break
            if left is not None and left <= 0:
                break


def _spelling_rows(part: PartFiles, rows_per_batch: int):
    """The first `size` rows (or `stop`, if fewer) of a spelling task, generated from its word list."""
    words = read_words(fetch_once(part.files[0], part.url))
    if part.name == "simple_spelling":
        words, make = simple_spelling_words(words), simple_spelling
    else:
        make = spelling_bee
    count = min(part.size, part.stop or part.size)
    for start in range(0, count, rows_per_batch):
        rows = [make(words, i, part.split) for i in range(start, min(start + rows_per_batch, count))]
        yield {"messages": np.array([json.dumps(messages) for messages in rows], dtype=object)}


def render_batch(batch: dict, tokenizer: Tokenizer, seq_len: int, loss_on: str) -> dict:
    """Ray Data map_batches: conversations -> {"tokens": int32 (n, seq_len + 1), "loss_mask": int8 (n, seq_len + 1)}.

    loss_on "assistant" (chat_sft): one conversation per row, cut to seq_len + 1 tokens, padded with
    <|assistant_end|> under mask 0; rows with no masked-in target are dropped. "all" (mid_train): the rendered
    conversations back to back, cut into windows with stride seq_len as documents are, every token a target."""
    rendered = [render_conversation(json.loads(m), tokenizer, seq_len + 1) for m in batch["messages"]]
    width = seq_len + 1
    if loss_on == "all":
        stream = np.concatenate([ids for ids, _ in rendered]) if rendered else np.zeros(0, np.int32)
        n = max(0, (len(stream) - 1) // seq_len)
        tokens = stream[np.arange(n)[:, None] * seq_len + np.arange(width)[None, :]] if n else np.zeros((0, width),
                                                                                                         np.int32)
        return {"tokens": tokens.astype(np.int32), "loss_mask": np.ones_like(tokens, dtype=np.int8)}
    rendered = [(ids, mask) for ids, mask in rendered if mask[1:].any()]
    tokens = np.full((len(rendered), width), tokenizer.special_id("<|assistant_end|>"), dtype=np.int32)
    loss_mask = np.zeros((len(rendered), width), dtype=np.int8)
    for row, (ids, mask) in enumerate(rendered):
        tokens[row, :len(ids)], loss_mask[row, :len(mask)] = ids, mask
    return {"tokens": tokens, "loss_mask": loss_mask}
