"""Text sources on generated corpora: .txt / .jsonl / .parquet files and a local copy of the FineWeb-Edu repository;
packing without padding, bytes per token, splits by document, determinism, a GPT-2-style BPE file."""

import base64
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data_fixtures import ray_local  # noqa: F401
from study.data import load_task_data, parse_dataset_config
from study.data.hub import MIRROR_ENV
from study.data.text import Tokenizer, gpt2_tokenizer, pack_documents
from study.errors import UserError

WORDS = "the cat sat on a mat while the dog ran after the ball into the garden near an old tree".split()


def _documents(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(count):
        words = rng.choice(WORDS, size=int(rng.integers(20, 120)))
        docs.append(f"Document {i}: " + " ".join(words) + (" é€" if i % 3 == 0 else ""))  # some multi-byte UTF-8
    return docs


def _stream(data, split: str, batch_size: int = 64):
    ds = data.datasets[split]
    batches = list(data.val_batches(ds, batch_size=batch_size, device="cpu"))
    return batches


def _decode_bytes(batches, eot: int, with_tail: bool = False):
    """The whole documents of a packed byte-level stream (inputs of every window plus the last target), and the
    start of the document the stream's dropped tail cut off."""
    tokens = []
    for batch in batches:
        for ids, targets in zip(batch["input_ids"], batch["targets"]):
            tokens.extend(ids.tolist())
            last = int(targets[-1])
    tokens.append(last)
    docs, current = [], []
    for t in tokens:
        if t == eot:
            docs.append(bytes(current))
            current = []
        else:
            current.append(t)
    return (docs, bytes(current)) if with_tail else docs


@pytest.fixture(scope="module")
def txt_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("txt")
    for i, doc in enumerate(_documents(20)):
        (root / f"doc_{i:02d}.txt").write_text(doc, encoding="utf-8")
    return root


def test_pack_documents_tiles_the_stream_without_padding():
    docs = [np.arange(1, 8), np.arange(10, 13), np.arange(20, 26)]  # 7 + 3 + 6 tokens, + 3 separators = 19
    windows = pack_documents(docs, eot=0, seq_len=4)
    stream = np.array([1, 2, 3, 4, 5, 6, 7, 0, 10, 11, 12, 0, 20, 21, 22, 23, 24, 25, 0])
    assert windows.shape == ((19 - 1) // 4, 5)
    for j, window in enumerate(windows):
        assert np.array_equal(window, stream[4 * j: 4 * j + 5])  # consecutive windows overlap by one token
    assert pack_documents([], eot=0, seq_len=4).shape == (0, 5)


def test_txt_files_split_by_file_and_packed_in_order(ray_local, txt_corpus):
    cfg = parse_dataset_config({"source": "text_files", "path": str(txt_corpus), "seq_len": 32,
                                "val_fraction": 0.2, "tokenizer": "byte"})
    data = load_task_data(cfg, seed=0)
    assert data.model_overrides == {"vocab_size": 257, "context_length": 32}
    val = _stream(data, "val")
    docs = {d.encode("utf-8") for d in _documents(20)}
    val_docs, tail = _decode_bytes(val, 256, with_tail=True)
    assert all(d in docs for d in val_docs)  # whole documents
    # 20% of the files: 4 documents, the last one possibly cut where the stream's last partial window was dropped
    assert len(val_docs) + bool(tail) == 4 and any(d.startswith(tail) for d in docs - set(val_docs))
    train_docs = _decode_bytes(_stream(data, "train"), 256)
    assert not set(train_docs) & set(val_docs) and len(set(train_docs)) >= 14
    for batch in val:
        assert batch["input_ids"].shape[1] == 32 and batch["input_ids"].dtype == torch.int64
        # bytes per target: one per byte, none for the separator; their sum is the text's UTF-8 size
        assert torch.equal(batch["target_bytes"], (batch["targets"] != 256).long())


def test_val_bpb_counts_the_loss_of_byte_carrying_targets_only(ray_local, txt_corpus):
    """val_bpb = (loss over targets with bytes) / (ln 2 * bytes), by an explicit loop over a real packed stream:
    the end-of-text separators (no bytes) count in val_loss but not in bits per byte."""
    import math

    from study.tasks.language_modeling import language_model_sums

    cfg = parse_dataset_config({"source": "text_files", "path": str(txt_corpus), "seq_len": 32,
                                "val_fraction": 0.2, "tokenizer": "byte"})
    data = load_task_data(cfg, seed=0)
    generator = torch.Generator().manual_seed(0)
    sums = torch.zeros(4, dtype=torch.float64)
    nats = all_nats = 0.0
    byte_count = target_count = separators = 0
    for batch in _stream(data, "val", batch_size=8):
        logits = torch.randn(*batch["targets"].shape, 257, generator=generator)
        sums += language_model_sums(logits, batch["targets"], batch["target_bytes"])
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        for row, targets in enumerate(batch["targets"].tolist()):
            for position, target in enumerate(targets):
                loss = -log_probs[row, position, target].item()
                all_nats += loss
                target_count += 1
                if target == 256:
                    separators += 1
                else:
                    nats += loss
                    byte_count += 1
    assert separators > 0, "the stream should hold end-of-text targets"
    assert sums[1].item() == target_count and sums[3].item() == byte_count
    assert sums[0].item() / sums[1].item() == pytest.approx(all_nats / target_count, rel=1e-6)  # val_loss
    assert sums[2].item() / (math.log(2) * sums[3].item()) == pytest.approx(nats / (math.log(2) * byte_count),
                                                                             rel=1e-6)  # val_bpb


def test_jsonl_hash_split_is_disjoint_deterministic_and_reshuffled_per_epoch(ray_local, tmp_path):
    docs = _documents(200, seed=1)
    for part in range(2):
        with open(tmp_path / f"part{part}.jsonl", "w") as f:
            for doc in docs[part::2]:
                f.write(json.dumps({"text": doc, "meta": part}) + "\n")
    cfg = parse_dataset_config({"source": "text_files", "path": str(tmp_path), "seq_len": 64, "tokenizer": "byte",
                                "val_fraction": 0.1})
    data = load_task_data(cfg, seed=0)
    val_docs = set(_decode_bytes(_stream(data, "val"), 256))
    train_docs = set(_decode_bytes(_stream(data, "train"), 256))
    assert not val_docs & train_docs
    assert 5 <= len(val_docs) <= 40
    run = lambda **kw: torch.cat([b["input_ids"] for b in data.train_batches(  # noqa: E731
        data.datasets["train"], batch_size=16, device="cpu", **kw)])
    first = run(epoch=0, seed=2)
    assert torch.equal(first, run(epoch=0, seed=2))
    assert not torch.equal(first, run(epoch=1, seed=2))
    assert (first == 256).any()  # documents are separated inside windows, not padded


def _tiny_bpe(path) -> dict[bytes, int]:
    """A GPT-2-style ranks file: the 256 bytes plus merges for frequent words of the corpus."""
    ranks = {bytes([b]): b for b in range(256)}
    for token in (b"th", b"the", b" the", b"at", b" cat", b" mat", b" sat", b"an", b" an", b"og", b" dog"):
        ranks[token] = len(ranks)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return ranks


def test_parquet_text_with_a_bpe_file_counts_the_bytes_of_each_token(ray_local, tmp_path):
    docs = _documents(60, seed=3)
    pq.write_table(pa.table({"body": docs}), tmp_path / "corpus.parquet", row_group_size=16)
    bpe = tmp_path / "tiny.tiktoken"
    ranks = _tiny_bpe(bpe)
    cfg = parse_dataset_config({"source": "text_files", "path": str(tmp_path / "corpus.parquet"), "seq_len": 24,
                                "tokenizer": "gpt2", "tokenizer_file": str(bpe), "text_column": "body",
                                "val_fraction": 0.2})
    data = load_task_data(cfg, seed=0)
    eot = len(ranks)
    assert data.model_overrides == {"vocab_size": eot + 1, "context_length": 24}
    tokenizer = gpt2_tokenizer(ranks)
    by_id = {r: t for t, r in ranks.items()}
    for batch in _stream(data, "val") + _stream(data, "train"):
        targets = batch["targets"]
        expected = torch.tensor([[0 if t == eot else len(by_id[t]) for t in row] for row in targets.tolist()])
        assert torch.equal(batch["target_bytes"], expected)
    # decoding the validation stream gives back whole documents of the corpus
    ids = [t for b in _stream(data, "val") for row in b["input_ids"].tolist() for t in row]
    text = b"".join(by_id.get(t, b"\n") for t in ids).decode("utf-8", errors="replace")
    assert sum(doc in text for doc in docs) >= 5
    assert int(max(ids)) <= eot and len(tokenizer.encode(["the cat"])[0]) < len("the cat")  # merges are used


def test_fineweb_edu_reads_a_local_copy_and_holds_out_the_last_files_first_documents(ray_local, tmp_path,
                                                                                       monkeypatch):
    repo = tmp_path / "HuggingFaceFW" / "fineweb-edu"
    os.makedirs(repo / "sample" / "10BT")
    docs = _documents(90, seed=4)
    for part in range(3):
        chunk = docs[30 * part: 30 * (part + 1)]
        pq.write_table(pa.table({"text": chunk, "id": [f"<urn:{30 * part + i}>" for i in range(30)],
                                 "score": [3.0] * 30}), repo / "sample" / "10BT" / f"{part:03d}_00000.parquet")
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/*/*\n"
        "- config_name: sample-10BT\n  data_files:\n  - split: train\n    path: sample/10BT/*\n---\n"
    )
    os.makedirs(repo / "data" / "CC-MAIN-2024-10")
    monkeypatch.setenv(MIRROR_ENV, str(tmp_path))
    cfg = parse_dataset_config({"source": "fineweb_edu", "tokenizer": "byte", "seq_len": 48, "val_documents": 5})
    data = load_task_data(cfg, seed=0)
    assert data.params["read_from"] == "local copy"
    val_docs = _decode_bytes(_stream(data, "val"), 256)
    assert val_docs[:4] == [d.encode() for d in docs[60:64]]  # the first documents of the last file
    train_docs = set(_decode_bytes(_stream(data, "train"), 256))
    assert not train_docs & {d.encode() for d in docs[60:65]}
    assert len(train_docs) >= 80
    capped = load_task_data(parse_dataset_config(
        {"source": "fineweb_edu", "tokenizer": "byte", "seq_len": 48, "val_documents": 5,
         "max_train_documents": 10}), seed=0)
    assert len(_decode_bytes(_stream(capped, "train"), 256)) <= 10


def test_tokenizer_gpt2_offline_without_cache_fails_clearly_and_auto_falls_back(ray_local, txt_corpus, monkeypatch,
                                                                                   tmp_path):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="dataset.tokenizer: gpt2 needs GPT-2's BPE files.*tokenizer: byte"):
        load_task_data(parse_dataset_config(
            {"source": "text_files", "path": str(txt_corpus), "tokenizer": "gpt2"}), seed=0)
    data = load_task_data(parse_dataset_config(
        {"source": "text_files", "path": str(txt_corpus), "tokenizer": "auto"}), seed=0)
    assert data.params["tokenizer"] == "byte" and data.model_overrides["vocab_size"] == 257


def test_byte_tokenizer_round_trips_utf8():
    tokenizer = Tokenizer("byte")
    text = "naïve café — 東京"
    (ids,) = tokenizer.encode([text])
    assert bytes(ids.astype(np.uint8).tolist()).decode("utf-8") == text
    assert tokenizer.token_bytes()[ids].sum() == len(text.encode("utf-8"))
