"""nanochat's tokenizer (study/data/nanochat_bpe.py, `Tokenizer` kind "nanochat"): trained as karpathy/nanochat's
tok_train.py trains it at e1770a3 (rustbpe, its split pattern, its special tokens after the merges), encoded with
tiktoken, and kept in the data folder's cache. Fast: a small vocabulary over CPython's shipped documentation text,
no Ray."""

from __future__ import annotations

import pytest
import rustbpe

from study.data import nanochat_bpe
from study.data.config import FineWebEduConfig, PydocTextConfig
from study.data.nanochat_bpe import capped_documents, nanochat_merges, train_merges
from study.data.offline import pydoc_documents
from study.data.text import nanochat_tokenizer, source_tokenizer
from study.errors import UserError

# nanochat/tokenizer.py at e1770a3, copied as it stands there
NANOCHAT_SPECIAL_TOKENS = ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                           "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]
NANOCHAT_SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""  # noqa: E501
# scripts/tok_train.py's sanity check
TOK_TRAIN_TEXT = """Hello world! This is a test.
Numbers: 123, 4567, 89
Contractions: I'm, you're, it's
Special chars: @#$%^&*()
Unicode: 你好世界 🌍"""
VOCAB = 512
TEXTS = [text for _, text in pydoc_documents()]


@pytest.fixture(scope="module")
def trained():
    return train_merges(TEXTS, VOCAB, max_chars=10**9, doc_cap=10_000)


def test_the_split_pattern_and_defaults_are_nanochats():
    assert nanochat_bpe.NANOCHAT_SPLIT_PATTERN == NANOCHAT_SPLIT_PATTERN
    settings = FineWebEduConfig(source="fineweb_edu", tokenizer="nanochat").bpe
    # tok_train.py's --vocab_size 2**16 and --doc_cap 10,000; speedrun.sh's --max_chars=2000000000
    assert (settings.vocab_size, settings.doc_cap, settings.max_chars) == (65536, 10_000, 2_000_000_000)


def text_iterator(docs, max_chars, doc_cap):
    """scripts/tok_train.py's text_iterator, its arguments made parameters."""
    nchars = 0
    for doc in docs:
        doc_text = doc
        if len(doc_text) > doc_cap:
            doc_text = doc_text[:doc_cap]
        nchars += len(doc_text)
        yield doc_text
        if nchars > max_chars:
            return


def rustbpe_reference(vocab_size=VOCAB, max_chars=10**9, doc_cap=10_000):
    """RustBPETokenizer.train_from_iterator's first step on tok_train's text."""
    reference = rustbpe.Tokenizer()
    reference.train_from_iterator(text_iterator(TEXTS, max_chars, doc_cap), vocab_size - len(NANOCHAT_SPECIAL_TOKENS),
                                  pattern=NANOCHAT_SPLIT_PATTERN)
    return reference


def test_documents_are_capped_and_read_as_tok_train_reads_them():
    for max_chars, doc_cap in ((1, 10), (5_000, 300), (60_000, 10_000), (10**9, 10_000)):
        assert list(capped_documents(TEXTS, max_chars, doc_cap)) == list(text_iterator(TEXTS, max_chars, doc_cap))


def test_merges_are_rustbpes_with_the_special_tokens_after_them(trained):
    """RustBPETokenizer.train_from_iterator: rustbpe trains vocab_size - 9 tokens with SPLIT_PATTERN, and the nine
    special tokens take the ids from len(mergeable_ranks) on, in nanochat's order."""
    reference = rustbpe_reference()
    assert trained == {bytes(k): v for k, v in reference.get_mergeable_ranks()}
    tokenizer = nanochat_tokenizer(trained)
    assert tokenizer.vocab_size == VOCAB and len(trained) == VOCAB - 9
    offset = len(trained)
    assert {name: tokenizer.special_id(name) for name in NANOCHAT_SPECIAL_TOKENS} == \
        {name: offset + i for i, name in enumerate(NANOCHAT_SPECIAL_TOKENS)}
    assert tokenizer.eot == tokenizer.special_id("<|bos|>") == VOCAB - 9  # the document delimiter is <|bos|>
    assert tokenizer._encoding.encode_single_token("<|assistant_end|>") == offset + 4


def test_tiktoken_encodes_as_rustbpes_own_encoder_and_decodes_back(trained):
    """The trained merges through tiktoken (nanochat's inference path) give the ids rustbpe's own encoder gives."""
    reference = rustbpe_reference()
    tokenizer = nanochat_tokenizer(trained)
    samples = [TOK_TRAIN_TEXT, *(text[:3000] for text in TEXTS[:20])]
    for text, ids in zip(samples, tokenizer.encode(samples)):
        assert ids.tolist() == reference.encode(text)
        assert tokenizer._encoding.decode(ids.tolist()) == text
    # numbers in pieces of at most two digits (nanochat's \p{N}{1,2}), so no token holds three
    digits = tokenizer.encode(["31415926535897932384 " * 50])[0].tolist()
    assert max(len(tokenizer._encoding.decode([i]).strip()) for i in digits) <= 2


def test_token_bytes_count_each_tokens_bytes_and_none_for_special_tokens(trained):
    tokenizer = nanochat_tokenizer(trained)
    table = tokenizer.token_bytes()
    assert len(table) == VOCAB
    assert table[len(trained):].tolist() == [0] * 9
    ranks = {rank: token for token, rank in trained.items()}
    assert table[:len(trained)].tolist() == [len(ranks[i]) for i in range(len(trained))]


def test_a_trained_bpe_is_cached_in_the_data_folder_and_read_back(tmp_path, monkeypatch, trained):
    monkeypatch.setenv("LAPSTUDY_DATA_DIR", str(tmp_path))
    identity = {"source": "test", "text": "pydoc"}
    settings = {"vocab_size": VOCAB, "max_chars": 10**9, "doc_cap": 10_000}
    merges, path = nanochat_merges(lambda: TEXTS, identity, **settings)
    assert merges == trained and path.startswith(str(tmp_path / "tokenizers"))

    def no_training(*args, **kwargs):
        raise AssertionError("trained again although cached")

    monkeypatch.setattr(nanochat_bpe, "train_merges", no_training)
    assert nanochat_merges(lambda: TEXTS, identity, **settings) == (trained, path)
    # other settings or other text: another file, trained anew
    with pytest.raises(AssertionError, match="trained again"):
        nanochat_merges(lambda: TEXTS, identity, **{**settings, "doc_cap": 100})
    with pytest.raises(AssertionError, match="trained again"):
        nanochat_merges(lambda: TEXTS, {**identity, "text": "other"}, **settings)
    # a cached file named in a config is read as it is
    assert nanochat_merges(lambda: [], {}, **settings, tokenizer_file=path)[0] == trained


def test_the_pydoc_source_trains_its_bpe_on_its_training_documents_only(tmp_path, monkeypatch):
    monkeypatch.setenv("LAPSTUDY_DATA_DIR", str(tmp_path))
    cfg = PydocTextConfig(source="pydoc_text", tokenizer="nanochat", bpe={"vocab_size": 300})
    seen = []
    texts = TEXTS[:40]
    tokenizer = source_tokenizer(cfg, lambda: seen.extend(texts) or texts, {"source": "pydoc_text", "n": 40})
    assert seen == texts and tokenizer.kind == "nanochat" and tokenizer.vocab_size == 300 and tokenizer.chat
    assert cfg.model_keys() == {"context_length": cfg.seq_len, "vocab_size": 300}


def test_wrong_files_sizes_and_settings_are_one_line_errors(tmp_path, monkeypatch, trained):
    monkeypatch.setenv("LAPSTUDY_DATA_DIR", str(tmp_path))
    _, small = nanochat_merges(lambda: TEXTS, {"source": "test"}, vocab_size=VOCAB, max_chars=10**9, doc_cap=10_000)
    with pytest.raises(UserError, match=r"dataset\.tokenizer_file: .*503 merges.*not dataset\.bpe\.vocab_size 65536"):
        nanochat_merges(lambda: [], {}, vocab_size=65536, max_chars=1, doc_cap=1, tokenizer_file=str(small))
    (tmp_path / "junk.tiktoken").write_text("not a ranks file\n")
    with pytest.raises(UserError, match=r"dataset\.tokenizer_file: .*junk\.tiktoken is not a tiktoken BPE ranks"):
        nanochat_merges(lambda: [], {}, vocab_size=512, max_chars=1, doc_cap=1,
                        tokenizer_file=str(tmp_path / "junk.tiktoken"))
    with pytest.raises(UserError, match=r"dataset\.bpe\.vocab_size: the training text gives only"):
        nanochat_merges(lambda: ["abc abc"], {"tiny": 1}, vocab_size=4096, max_chars=10, doc_cap=10)
    with pytest.raises(ValueError, match=r"bpe: is read only with tokenizer: nanochat \(here gpt2\)"):
        FineWebEduConfig(source="fineweb_edu", bpe={"vocab_size": 1024})


def test_a_run_names_its_trained_bpe_in_every_dataset_that_reads_it_and_reloads(tmp_path):
    """After the first stage trained the BPE, the run's config names its file in the pre-training dataset and in the
    chat stages' (what the later stages, `lapstudy eval` and a re-run read), and that config reads back the same."""
    from pathlib import Path

    from study.runspec import Resources, RunSpec
    from study.space import load_space

    space = load_space(Path(__file__).parents[1] / "search_spaces" / "gpt_d20_stages_laptop.yaml")
    spec = space.run_spec(space.resolve({"max_count": 2}), Resources())
    assert spec.dataset.tokenizer_file is None
    pinned = spec.with_tokenizer_file(str(tmp_path / "bpe.tiktoken"))
    datasets = [pinned.dataset, *(stage.dataset for stage in pinned.stages)]
    assert [(d.tokenizer, d.tokenizer_file) for d in datasets] == [("nanochat", str(tmp_path / "bpe.tiktoken"))] * 3
    assert RunSpec.model_validate(pinned.document()) == pinned
    assert spec.with_tokenizer_file(None) is spec


def test_the_d20_pretraining_data_fails_at_once_offline_before_any_training(monkeypatch, tmp_path):
    """Offline, with no local copy of FineWeb-Edu, the d20 spaces' data is refused at once, naming the offline
    alternatives (a local copy, text_files, pydoc_text), before a BPE is trained or anything is written."""
    import time
    from pathlib import Path

    from study.data import check_dataset
    from study.space import load_space

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LAPSTUDY_DATA_DIR", str(tmp_path))
    space = load_space(Path(__file__).parents[1] / "search_spaces" / "gpt_d20_stages.yaml")
    started = time.monotonic()
    with pytest.raises(UserError) as refused:
        check_dataset(space.dataset)
    assert time.monotonic() - started < 3
    message = str(refused.value)
    assert "fineweb" in message.lower() and "text_files" in message and "pydoc_text" in message
    assert list(tmp_path.iterdir()) == []
