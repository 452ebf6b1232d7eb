"""Chat data for mid-training and SFT (study/data/chat.py, chat_sources.py) against nanochat at commit e1770a3:
render_conversation's tokens and mask written out by hand, the SFT loss counted over the assistant's tokens only,
the conversation sets as nanochat's tasks build them, and hub parts failing fast offline. The fixtures in
tests/fixtures/chat/ are local copies of the hub repositories' layouts (tests/fixtures/chat/make_fixtures.py)."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from fault_fixtures import free_port
from study.data import check_dataset
from study.data.chat import PartFiles, conversation_of, read_parts, render_batch, render_conversation
from study.data.config import ChatPart
from study.data.spelling import read_words, simple_spelling, simple_spelling_words, spelling_bee
from study.data.text import Tokenizer, TokenTargets
from study.errors import UserError
from study.runspec import resolve
from study.tasks import GeometrySpec, task_class
from study.worker import Worker

FIXTURES = Path(__file__).parent / "fixtures" / "chat"
BYTES = Tokenizer("byte", chat=True)
# nanochat's special tokens after the byte tokenizer's 256 bytes; <|bos|> is its end-of-text, 256
BOS, USER, USER_END, ASSISTANT, ASSISTANT_END, PY, PY_END, OUT, OUT_END = range(256, 265)


def b(text: str) -> list[int]:
    return list(text.encode())


def test_chat_tokens_extend_the_vocabulary_after_end_of_text():
    assert BYTES.vocab_size == 265 and Tokenizer("byte").vocab_size == 257
    assert BYTES.special_id("<|output_end|>") == OUT_END and BYTES.special_id("<|bos|>") == BOS
    assert BYTES.token_bytes()[256:].tolist() == [0] * 9 and BYTES.token_bytes()[:256].tolist() == [1] * 256


def test_render_conversation_tokens_and_mask_by_hand():
    """A system message merged into the first user turn, an assistant turn with a python call and its output (GSM8K's
    form), a second exchange: nanochat's tokens, and 1 exactly on what the assistant writes and its end token."""
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "python", "text": "1+1"},
                                          {"type": "python_output", "text": "2"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "yes"},
    ]
    expected = [
        (BOS, 0), (USER, 0), *[(t, 0) for t in b("S\n\nQ")], (USER_END, 0),
        (ASSISTANT, 0), (ord("a"), 1), (PY, 1), *[(t, 1) for t in b("1+1")], (PY_END, 1),
        (OUT, 0), (ord("2"), 0), (OUT_END, 0), (ord("b"), 1), (ASSISTANT_END, 1),
        (USER, 0), *[(t, 0) for t in b("ok")], (USER_END, 0),
        (ASSISTANT, 0), *[(t, 1) for t in b("yes")], (ASSISTANT_END, 1),
    ]
    ids, mask = render_conversation(messages, BYTES)
    assert ids.tolist() == [t for t, _ in expected] and mask.tolist() == [m for _, m in expected]
    ids, mask = render_conversation(messages, BYTES, max_tokens=5)
    assert ids.tolist() == [t for t, _ in expected[:5]]
    with pytest.raises(ValueError, match="message 1 is from user, expected assistant"):
        render_conversation([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], BYTES)


def _sft_batch(seq_len: int = 12) -> tuple[dict, list[tuple[np.ndarray, np.ndarray]]]:
    conversations = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                     [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                      {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]]
    rows = render_batch({"messages": [json.dumps(c) for c in conversations]}, BYTES, seq_len, "assistant")
    return rows, [render_conversation(c, BYTES) for c in conversations]


def test_sft_rows_are_padded_with_assistant_end_and_targets_ignored_off_the_assistant():
    rows, rendered = _sft_batch()
    ids, mask = rendered[0]  # 1 + (1 + 2 + 1) + (1 + 2 + 1) = 9 tokens: fits, padded to 13
    assert rows["tokens"][0].tolist() == ids.tolist() + [ASSISTANT_END] * 4
    assert rows["loss_mask"][0].tolist() == mask.tolist() + [0] * 4
    batch = TokenTargets(BYTES.token_bytes()).evaluate({k: torch.from_numpy(v) for k, v in rows.items()})
    # targets of row 0: the next token where that token is the assistant's ("y", "o", <|assistant_end|>), else -1
    assert batch["targets"][0].tolist() == [-1] * 5 + [ord("y"), ord("o"), ASSISTANT_END] + [-1] * 4
    assert batch["target_bytes"][0].tolist() == [0] * 5 + [1, 1, 0] + [0] * 4
    assert rows["tokens"][1].tolist() == rendered[1][0][:13].tolist()  # cut at seq_len + 1


def test_masked_loss_counts_only_assistant_tokens():
    """The language-modelling task's loss and evaluation sums on an SFT batch, against -log p summed by hand over
    the positions whose next token is the assistant's (nanochat's chat_sft loss: the mean over those)."""
    rows, _ = _sft_batch()
    batch = TokenTargets(BYTES.token_bytes()).evaluate({k: torch.from_numpy(v) for k, v in rows.items()})
    logits = torch.randn(2, 12, BYTES.vocab_size, generator=torch.Generator().manual_seed(0))
    terms = []
    for r in range(2):
        for t in range(12):
            if rows["loss_mask"][r, t + 1]:
                terms.append(-torch.log_softmax(logits[r, t], -1)[int(rows["tokens"][r, t + 1])].item())
    task = task_class("language_modeling")(torch.nn.Module(), Worker(0, 1, torch.device("cpu")), seed=0,
                                           geometry=GeometrySpec(),
                                           resolved=resolve({}, "language_modeling", {}, epochs=1))
    loss = task.loss(lambda ids: logits, batch)
    assert len(terms) == int(rows["loss_mask"][:, 1:].sum()) and loss.item() == pytest.approx(sum(terms) / len(terms))
    sums = dict(zip(task.sum_names, task.eval_sums(logits, batch).tolist()))
    assert sums["targets"] == len(terms) and sums["loss"] == pytest.approx(sum(terms))
    assert task.eval_metrics(sums)["val_loss"] == pytest.approx(sum(terms) / len(terms))
    assert math.isfinite(task.eval_metrics(sums)["val_bpb"])


def test_midtraining_packs_conversations_and_trains_on_every_token():
    conversations = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
                     for i in range(4)]
    rows = render_batch({"messages": [json.dumps(c) for c in conversations]}, BYTES, 8, "all")
    stream = np.concatenate([render_conversation(c, BYTES)[0] for c in conversations])  # 10 tokens each
    assert rows["tokens"].shape == (4, 9) and rows["loss_mask"].all()
    assert rows["tokens"].tolist() == [stream[8 * i: 8 * i + 9].tolist() for i in range(4)]


def _first(path: str) -> dict:
    return pq.read_table(FIXTURES / path).to_pylist()[0]


def test_conversation_sets_are_nanochats_tasks():
    """Rows in the hub's columns become the messages nanochat's tasks/*.py make of them."""
    row = _first("cais/mmlu/auxiliary_train/train-00000-of-00001.parquet")["train"]
    messages = conversation_of("mmlu_auxiliary_train", {"train": row})
    letters = "ABCD"
    assert messages[0]["content"] == (f"Multiple Choice question: {row['question']}\n"
                                      + "".join(f"- {c}={letters[i]}\n" for i, c in enumerate(row["choices"]))
                                      + "\nRespond only with the letter of the correct answer.")
    assert messages[1] == {"role": "assistant", "content": letters[row["answer"]]}
    arc = _first("allenai/ai2_arc/ARC-Easy/train-00000-of-00001.parquet")
    assert conversation_of("arc_easy", arc)[1]["content"] == arc["answerKey"]
    assert f"- {arc['choices']['text'][0]}={arc['choices']['label'][0]}\n" in conversation_of("arc_easy", arc)[0][
        "content"]
    gsm = conversation_of("gsm8k", {"question": "Q", "answer": "So 2*3 = <<2*3=6>>6.\n#### 6"})
    assert gsm[1]["content"] == [{"type": "text", "text": "So 2*3 = "}, {"type": "python", "text": "2*3"},
                                 {"type": "python_output", "text": "6"}, {"type": "text", "text": "6.\n#### 6"}]
    smol = _first("HuggingFaceTB/smol-smoltalk/data/train-00000-of-00001.parquet")
    assert conversation_of("smoltalk", smol) == smol["messages"]
    line = (FIXTURES / "conversations.jsonl").read_text().splitlines()[0]
    assert conversation_of("jsonl", line) == json.loads(line)
    parts = [PartFiles("jsonl", (str(FIXTURES / "conversations.jsonl"),), stop=5),
             PartFiles("arc_easy", (str(FIXTURES / "allenai/ai2_arc/ARC-Easy/train-00000-of-00001.parquet"),))]
    read = list(read_parts({"part": np.array([0, 1, 0])}, parts, rows_per_batch=4))
    messages = [json.loads(m) for chunk in read for m in chunk["messages"]]
    assert [len(chunk["messages"]) for chunk in read] == [4, 1, 4, 4, 4, 4, 4, 1]  # stop 5; 16 ARC rows; stop 5
    assert messages[0] == json.loads(line) and messages[5] == conversation_of("arc_easy", arc)


def _refused_at_once(config: dict, within_s: float) -> str:
    """The one-line UserError check_dataset raises for `config`, within `within_s` seconds."""
    started = time.perf_counter()
    with pytest.raises(UserError) as error:
        check_dataset(config)
    message = str(error.value)
    assert time.perf_counter() - started < within_s and "\n" not in message
    return message


def test_hub_parts_fail_fast_offline_naming_the_offline_alternative(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LAPSTUDY_DATA_DIR", raising=False)
    config = {"source": "chat", "tokenizer": "byte", "train": [{"name": "jsonl", "path": str(FIXTURES /
                                                                                             "conversations.jsonl")},
                                                             {"name": "gsm8k"}],
              "val": [{"name": "jsonl", "path": str(FIXTURES / "conversations.jsonl")}]}
    message = _refused_at_once(config, within_s=3)
    assert message.startswith("dataset.train[1]: gsm8k streams openai/gsm8k") and "{name: jsonl" in message
    # a local copy is read instead of the hub, offline too
    config["train"][1]["local_dir"] = str(FIXTURES / "openai" / "gsm8k")
    check_dataset(config)


def test_chat_part_fields_are_checked():
    with pytest.raises(UserError, match=r"dataset\.train\.0.*path: is read only with name: jsonl, spelling_bee, "
                                        r"simple_spelling \(here smoltalk\); leave it out"):
        check_dataset({"source": "chat", "train": [{"name": "smoltalk", "path": "x.jsonl"}],
                                            "val": [{"name": "smoltalk"}]})
    with pytest.raises(UserError, match=r"dataset\.val\[0\]\.local_dir: /nope is not a folder \(a local copy of "
                                        r"openai/gsm8k\)"):
        check_dataset({"source": "chat", "train": [{"name": "jsonl", "path": str(
            FIXTURES / "conversations.jsonl")}], "val": [{"name": "gsm8k", "local_dir": "/nope"}]})
    with pytest.raises(UserError, match=r"dataset\.train\[0\]\.path: .*nope\.jsonl does not exist"):
        check_dataset({"source": "chat", "train": [{"name": "jsonl", "path": "/nope.jsonl"}],
                                            "val": [{"name": "jsonl", "path": "/nope.jsonl"}]})


def test_the_stage_spaces_load_and_the_laptop_copy_finds_its_fixtures_offline(monkeypatch):
    """Relative paths of a stage's dataset are read from the space's folder (as the first stage's are), so the laptop
    space's chat parts find tests/fixtures/chat offline from anywhere; the d20 space trains every stage with
    nanochat's optimiser, SFT at chat_sft's learning rates (0.02 of base_train's) and schedule."""
    from study.space import load_space

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LAPSTUDY_DATA_DIR", raising=False)
    spaces = Path(__file__).resolve().parents[1] / "search_spaces"
    laptop = load_space(spaces / "gpt_d20_stages_laptop.yaml")
    for stage in laptop.stages:
        for part in stage.dataset.train + stage.dataset.val:
            assert Path(part.local_dir or part.path).is_absolute() and Path(part.local_dir or part.path).exists()
        check_dataset(stage.dataset)
    d20 = load_space(spaces / "gpt_d20_stages.yaml")
    assert d20.fixed["optimizer"] == "nanochat" and d20.dataset.chat_tokens
    assert [stage.name for stage in d20.stages] == ["midtrain", "sft"]
    assert [stage.dataset.loss_on for stage in d20.stages] == ["all", "assistant"]
    sft = d20.stages[1].hyperparameters
    assert (sft["matrix_lr"], sft["embedding_lr"], sft["unembedding_lr"]) == pytest.approx((0.02 * 0.02, 0.2 * 0.02,
                                                                                            0.004 * 0.02))
    assert sft["warmdown_ratio"] == 1.0 and sft["muon_momentum_warmup"] == 0


SPELLING_REFERENCE = json.loads((FIXTURES / "spelling_reference.json").read_text())


def test_spelling_tasks_make_nanochats_rows():
    """Rows of SpellingBee and SimpleSpelling as nanochat's own tasks/spellingbee.py makes them from the same word
    list (tests/fixtures/chat/make_spelling_reference.py), train and test seeds alike."""
    words = read_words(str(FIXTURES / "words.txt"))
    for key, rows in SPELLING_REFERENCE.items():
        name, split = key.split("/")
        for index, messages in rows.items():
            made = (spelling_bee(words, int(index), split) if name == "spelling_bee"
                    else simple_spelling(simple_spelling_words(words), int(index), split))
            assert made == messages, (key, index)


def test_spelling_answers_are_right_and_the_tool_output_is_not_a_target():
    """Independent of nanochat: every SpellingBee answer is the letter's count in the word, by hand, by the tool call
    and after '#### '; every SimpleSpelling answer spells its word; the tool's output is masked out of the loss."""
    words = read_words(str(FIXTURES / "words.txt"))
    questions = set()
    for index in range(300):
        user, assistant = spelling_bee(words, index, "train")
        text, check, call, output, final = (part["text"] for part in assistant["content"])
        word, letter = re.fullmatch(r"'(\w+)'\.count\('(\w)'\)", call).groups()
        count = word.count(letter)
        assert word in words and output == str(count) and final.endswith(f"#### {count}")
        assert f"{word}:{','.join(word)}\n" in text and text.count(" hit! count=") == count
        assert text.endswith(f"This gives us {count}.") and word in user["content"] and letter in user["content"]
        questions.add(user["content"])
        spelled = simple_spelling(simple_spelling_words(words), index, "test")[1]["content"]
        assert spelled.split(":")[1].replace(",", "") == spelled.split(":")[0]
    assert len(questions) > 250  # templates, case, quotes and question marks vary
    ids, mask = render_conversation([user, assistant], BYTES)
    start, end = ids.tolist().index(OUT), ids.tolist().index(OUT_END)
    assert bytes(ids[start + 1:end].tolist()).decode() == output and not mask[start:end + 1].any()
    assert mask[ids.tolist().index(PY)] == 1


def test_spelling_parts_generate_their_size_in_rows_from_the_word_list():
    words = str(FIXTURES / "words.txt")
    parts = [PartFiles("spelling_bee", (words,), size=5, split="test"),
             PartFiles("simple_spelling", (words,), size=300, stop=3)]
    read = list(read_parts({"part": np.array([0, 1])}, parts, rows_per_batch=2))
    assert [len(chunk["messages"]) for chunk in read] == [2, 2, 1, 2, 1]
    rows = [json.loads(m) for chunk in read for m in chunk["messages"]]
    assert rows[2] == SPELLING_REFERENCE["spelling_bee/test"]["2"]
    assert rows[5] == SPELLING_REFERENCE["simple_spelling/train"]["0"]


@pytest.fixture
def word_server():
    """A real HTTP server handing out words.txt, counting its requests."""
    import http.server
    import threading

    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(FIXTURES), **kwargs)

        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/words.txt", requests
    server.shutdown()
    server.server_close()


def test_a_missing_word_list_is_fetched_once_from_its_url(tmp_path, word_server):
    url, requests = word_server
    path = tmp_path / "cache" / "words_alpha.txt"
    config = {"source": "chat", "tokenizer": "byte",
              "train": [{"name": "simple_spelling", "size": 4, "path": str(path), "url": url}],
              "val": [{"name": "jsonl", "path": str(FIXTURES / "conversations.jsonl")}]}
    check_dataset(config)  # the URL answers: no error, nothing fetched yet
    assert not path.exists() and requests == []
    parts = [PartFiles("simple_spelling", (str(path),), url=url, size=4)]
    first = list(read_parts({"part": np.array([0, 0])}, parts))
    assert path.read_bytes() == (FIXTURES / "words.txt").read_bytes() and requests == ["/words.txt"]
    assert list(tmp_path.glob("cache/*.part")) == []
    assert first[0]["messages"].tolist() == first[1]["messages"].tolist()
    assert json.loads(first[0]["messages"][0]) == SPELLING_REFERENCE["simple_spelling/train"]["0"]


def test_an_unfetchable_word_list_fails_fast_naming_the_offline_alternative(tmp_path, monkeypatch):
    """The default word list is nanochat's, in nanochat's cache: without it and without a network, one line that names
    the path, the URL and what to do instead."""
    monkeypatch.setenv("HOME", str(tmp_path))
    closed = free_port()
    config = {"source": "chat", "tokenizer": "byte",
              "train": [{"name": "jsonl", "path": str(FIXTURES / "conversations.jsonl")},
                        {"name": "spelling_bee", "size": 10, "url": f"http://127.0.0.1:{closed}/words_alpha.txt"}],
              "val": [{"name": "jsonl", "path": str(FIXTURES / "conversations.jsonl")}]}
    message = _refused_at_once(config, within_s=5)
    assert message.startswith(f"dataset.train[1].path: {tmp_path}/.cache/nanochat/words_alpha.txt is missing and "
                              f"http://127.0.0.1:{closed}/words_alpha.txt cannot be fetched")
    assert "offline, copy the file there or set the path to a local copy (a word list, one word per line)" in message
    # Unless told otherwise, nanochat's list where nanochat keeps it (nanochat/common.py get_base_dir), fetched from
    # where nanochat fetches it (tasks/spellingbee.py WORD_LIST_URL).
    assert (ChatPart(name="spelling_bee", size=10).path, ChatPart(name="simple_spelling", size=1).url) == (
        "~/.cache/nanochat/words_alpha.txt",
        "https://raw.githubusercontent.com/dwyl/english-words/refs/heads/master/words_alpha.txt")


def test_spelling_part_fields_are_checked():
    jsonl = {"name": "jsonl", "path": str(FIXTURES / "conversations.jsonl")}
    for part, pattern in (({"name": "spelling_bee"}, r"dataset\.train\.0.*size is for name: spelling_bee, "
                                                      r"simple_spelling, which need it"),
                          ({"name": "gsm8k", "size": 3}, r"size: is read only with name: spelling_bee, simple_spelling "
                                                         r"\(here gsm8k\)"),
                          ({"name": "gsm8k", "url": "http://x/y"}, r"url: is read only with name: jsonl, spelling_bee, "
                                                                   r"simple_spelling \(here gsm8k\)"),
                          ({**jsonl, "revision": "main"}, r"revision: is read only with name: smoltalk, "
                                                          r".*\(here jsonl\)"),
                          ({**jsonl, "split": "test"}, r"split: is read only with name: smoltalk, .*simple_spelling "
                                                       r"\(here jsonl\)"),
                          ({"name": "simple_spelling", "size": 3, "split": "validation"},
                           r"split: simple_spelling has train and test, got 'validation'"),
                          ({"name": "simple_spelling", "size": 3, "path": "/nope.txt", "url": "ftp://x/words"},
                           r"dataset\.train\[0\]\.url: must be an http\(s\) URL, got 'ftp://x/words'")):
        with pytest.raises(UserError, match=pattern):
            check_dataset({"source": "chat", "train": [part], "val": [jsonl]})


# nanochat's mixtures at e1770a3 as (task, split, stop, size), one entry per time a task is listed:
# scripts/mid_train.py:98-111 and scripts/chat_sft.py:84-93 (CustomJSON of identity_conversations.jsonl: "identity").
NANOCHAT_MIXTURES = {
    "midtrain": {
        "train": [("smoltalk", "train", None, None), ("mmlu_auxiliary_train", "train", None, None),
                  ("gsm8k", "train", None, None), ("identity", None, None, None), ("identity", None, None, None),
                  ("simple_spelling", "train", None, 200_000), ("spelling_bee", "train", None, 80_000)],
        "val": [("smoltalk", "test", None, None), ("mmlu", "test", 5200, None), ("gsm8k", "test", 420, None)],
    },
    "sft": {
        "train": [("arc_easy", "train", None, None), ("arc_challenge", "train", None, None),
                  ("gsm8k", "train", None, None), ("smoltalk", "train", 10_000, None), ("identity", None, None, None),
                  ("simple_spelling", "train", None, 300), ("spelling_bee", "train", None, 300)],
        "val": [("smoltalk", "test", None, None)],
    },
}


def _as_nanochat_task(part) -> list[tuple]:
    if part.name == "jsonl":
        assert part.path.endswith("/.cache/nanochat/identity_conversations.jsonl") and part.url == \
            "https://karpathy-public.s3.us-west-2.amazonaws.com/identity_conversations.jsonl"
        entry = ("identity", None, None, None)
    else:
        split = part.split or ("train" if part.name in ("spelling_bee", "simple_spelling") else part.hub[2])
        entry = (part.name, split, part.stop, part.size)
    return [entry] * part.repeat


@pytest.mark.parametrize("space", ["gpt_d20_stages.yaml", "gpt_d20_paper.yaml"])
def test_the_d20_stages_mix_nanochats_tasks(space):
    """Every task nanochat's mid_train and chat_sft mix, as often, with the same split, stop and size: the hub sets,
    the identity conversations (fetched from where nanochat fetches them) and the spelling tasks."""
    from study.space import load_space

    stages = {stage.name: stage for stage in load_space(Path(__file__).resolve().parents[1] / "search_spaces" / space)
              .stages}
    for name, sides in NANOCHAT_MIXTURES.items():
        for side, expected in sides.items():
            parts = getattr(stages[name].dataset, side)
            assert [entry for part in parts for entry in _as_nanochat_task(part)] == expected, (name, side)


def test_a_chat_part_records_the_fields_its_kind_reads():
    """What a trial's config and MLflow's dataset input hold of each part (study/data/chat_sources.py reads them)."""
    hub = ChatPart(name="gsm8k", revision="main")
    jsonl = ChatPart(name="jsonl", path="x.jsonl")
    spelling = ChatPart(name="spelling_bee", size=10, split="test")
    assert set(hub.model_dump()) == {"name", "split", "local_dir", "revision", "stop", "repeat"}
    assert set(jsonl.model_dump()) == {"name", "path", "url", "stop", "repeat"}
    assert set(spelling.model_dump()) == {"name", "split", "path", "url", "size", "stop", "repeat"}
    for part in (hub, jsonl, spelling):
        assert ChatPart.model_validate(part.model_dump()) == part
