"""Tokenisers and document packing for the language-modelling sources (pure numpy + tiktoken, no Ray).

Three tokenisers: GPT-2 BPE through `tiktoken` (vocab 50257, <|endoftext|> = 50256), nanochat's BPE (trained on the
pre-training text by study/data/nanochat_bpe.py, encoded by tiktoken with nanochat's split pattern; its nine special
tokens after the merges, vocab 65,536 for nanochat's) and UTF-8 bytes (vocab 257, end-of-text = 256). A merge table is
read on the driver (tiktoken's cache, `tokenizer_file`, or the trained BPE) and travels to the Ray Data workers inside
the `Tokenizer` object, so cluster nodes need neither the cache nor the internet.

Packing: documents are concatenated with an end-of-text token after each one and cut into windows of seq_len + 1
tokens with stride seq_len (inputs = window[:-1], targets = window[1:]), so every token of the stream except the first
is a target exactly once and nothing is padded; the tail shorter than a window is dropped.

Document windows (perplexity per context length): each document alone, behind an end-of-text token, in the rolling
windows of lm-evaluation-harness (`lm_eval.utils.get_rolling_token_windows`), so every token of every document is a
target exactly once, no window crosses a document, and each target sees its document before it or at least
context - stride + 1 tokens of it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from study.data.hub import offline_flag, probe
from study.data.nanochat_bpe import CHAT_SPECIAL_TOKENS, NANOCHAT_SPLIT_PATTERN
from study.errors import UserError

BYTE_VOCAB = 257
BYTE_EOT = 256
GPT2_MERGES = 50256  # GPT-2's merge table; <|endoftext|> is the id after it
IGNORE_INDEX = -1  # a target that is not trained on (nanochat's -1: chat_sft masks all but the assistant's tokens)
GPT2_EOT_TEXT = "<|endoftext|>"
GPT2_VOCAB_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
GPT2_ENCODER_JSON_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"
# tiktoken's GPT-2 split pattern (tiktoken_ext.openai_public.r50k_pat_str)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


_ENCODINGS: dict[str, object] = {}


def bpe_tokenizer(kind: str, mergeable_ranks: dict[bytes, int], chat: bool = False, file: str | None = None,
                  ) -> "Tokenizer":
    """A BPE tokenizer ("gpt2" or "nanochat") over these merges."""
    digest = hashlib.sha1(kind.encode())
    for token, rank in sorted(mergeable_ranks.items(), key=lambda item: item[1]):
        digest.update(token + rank.to_bytes(4, "little"))
    return Tokenizer(kind, mergeable_ranks, digest.hexdigest(), chat=chat, file=file)


def gpt2_tokenizer(mergeable_ranks: dict[bytes, int]) -> "Tokenizer":
    return bpe_tokenizer("gpt2", mergeable_ranks)


def nanochat_tokenizer(mergeable_ranks: dict[bytes, int], file: str | None = None) -> "Tokenizer":
    """nanochat's tokenizer: its special tokens are always in its vocabulary, after the merges (<|bos|> first);
    `file`: the ranks file the merges are kept in."""
    return bpe_tokenizer("nanochat", mergeable_ranks, chat=True, file=file)


@dataclass(frozen=True)
class Tokenizer:
    """A picklable tokenizer: `kind` is "byte", "gpt2" or "nanochat"; a BPE tokenizer carries its merge ranks."""

    kind: str
    mergeable_ranks: dict[bytes, int] | None = field(default=None, repr=False, compare=False)
    fingerprint: str = ""  # identifies the merge table (the per-process encoder cache key)
    chat: bool = False  # reserve ids for nanochat's chat special tokens after end-of-text (`special_id`)
    file: str | None = field(default=None, compare=False)  # nanochat's: the trained BPE's ranks file (a run names it)

    @property
    def name(self) -> str:
        return self.kind

    @property
    def eot(self) -> int:
        return BYTE_EOT if self.kind == "byte" else len(self.mergeable_ranks)

    @property
    def vocab_size(self) -> int:
        return self.eot + (len(CHAT_SPECIAL_TOKENS) if self.chat else 1)

    def special_id(self, name: str) -> int:
        """The id of one of nanochat's special tokens (a tokenizer with `chat`; <|bos|> is end-of-text)."""
        if name == CHAT_SPECIAL_TOKENS[0]:
            return self.eot
        if not self.chat or name not in CHAT_SPECIAL_TOKENS:
            raise KeyError(f"{name!r} is not a special token of this tokenizer (chat tokens: {self.chat})")
        return self.eot + CHAT_SPECIAL_TOKENS.index(name)

    @property
    def _encoding(self):
        # building an Encoding from 50k ranks takes a while: once per process (Ray reuses worker processes)
        encoding = _ENCODINGS.get(self.fingerprint)
        if encoding is None:
            import tiktoken

            nanochat = self.kind == "nanochat"  # RustBPETokenizer.train_from_iterator's Encoding
            encoding = tiktoken.Encoding(
                name=self.kind,
                pat_str=NANOCHAT_SPLIT_PATTERN if nanochat else GPT2_PATTERN,
                mergeable_ranks=self.mergeable_ranks,
                special_tokens={name: self.eot + i for i, name in enumerate(CHAT_SPECIAL_TOKENS)} if nanochat
                else {GPT2_EOT_TEXT: self.eot},
            )
            _ENCODINGS[self.fingerprint] = encoding
        return encoding

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text; text that looks like a special token is encoded as ordinary text."""
        if self.kind == "byte":
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]
        return [np.asarray(ids, dtype=np.int32) for ids in self._encoding.encode_ordinary_batch(list(texts))]

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each token id stands for (0 for end-of-text), for bits-per-byte."""
        if self.kind == "byte":
            table = np.ones(BYTE_VOCAB, dtype=np.int16)
        else:
            enc = self._encoding
            table = np.array(
                [len(enc.decode_single_token_bytes(i)) for i in range(self.eot)] + [0], dtype=np.int16
            )
        table[self.eot] = 0
        if self.chat:  # the special tokens stand for no text
            table = np.concatenate([table, np.zeros(len(CHAT_SPECIAL_TOKENS) - 1, dtype=np.int16)])
        return table


def pack_documents(docs: list[np.ndarray], eot: int, seq_len: int) -> np.ndarray:
    """(n, seq_len + 1) int32 windows over doc_0, eot, doc_1, eot, ... with stride seq_len; no padding."""
    if not docs:
        return np.zeros((0, seq_len + 1), dtype=np.int32)
    sep = np.array([eot], dtype=np.int32)
    stream = np.concatenate([part for doc in docs for part in (doc.astype(np.int32, copy=False), sep)])
    n = (len(stream) - 1) // seq_len
    index = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[index]


def count_words(text: str) -> int:
    """Words of a text: its whitespace-separated tokens (per-word perplexity divides by these; docs/data.md)."""
    return len(text.split())


def document_windows(batch: dict, tokenizer: Tokenizer, context: int, stride: int, text_column: str) -> dict:
    """Ray Data map_batches function: documents -> the rolling windows of `context` input tokens that
    lm-evaluation-harness's `get_rolling_token_windows` makes of each document alone, end-of-text before its first
    token, with a minimum context of context - stride + 1 tokens (the first window scores every token it holds;
    each later one is `context` tokens long and scores its last `stride` targets or fewer, the last one ending at
    the document's end). Rows:
      tokens  (n, context + 1)  the inputs, then the last target (targets = tokens[1:]); end-of-text after `length`
      length  (n,)              tokens of the row that are the window's (the inputs and the last target)
      scored  (n,)              how many of the window's last targets are scored
      words   (n,)              the document's words (`count_words`) on its first window, 0 on the others
    """
    from lm_eval.utils import get_rolling_token_windows  # in the Ray Data task; the driver never needs it

    texts = [t if isinstance(t, str) else bytes(t).decode("utf-8", errors="replace") for t in batch[text_column]]
    rows, lengths, scored, words = [], [], [], []
    for text, ids in zip(texts, tokenizer.encode(texts)):
        first = True
        for inputs, predicted in get_rolling_token_windows(ids.tolist(), tokenizer.eot, context,
                                                           context - stride + 1):
            row = np.full(context + 1, tokenizer.eot, dtype=np.int32)
            row[:len(inputs) + 1] = inputs + predicted[-1:]
            rows.append(row)
            lengths.append(len(inputs) + 1)
            scored.append(len(predicted))
            words.append(count_words(text) if first else 0)
            first = False
    return {"tokens": np.stack(rows) if rows else np.zeros((0, context + 1), dtype=np.int32),
            "length": np.array(lengths, dtype=np.int32), "scored": np.array(scored, dtype=np.int32),
            "words": np.array(words, dtype=np.int64)}


def _tiktoken_cache_dir() -> str:
    # the same rule as tiktoken.load.read_file_cached
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _gpt2_cached() -> bool:
    cache = _tiktoken_cache_dir()
    return cache != "" and all(
        os.path.exists(os.path.join(cache, hashlib.sha1(url.encode()).hexdigest()))
        for url in (GPT2_VOCAB_BPE_URL, GPT2_ENCODER_JSON_URL)
    )


def _ranks_from_file(path: str) -> dict[bytes, int]:
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks, load_tiktoken_bpe

    if os.path.isdir(path):
        vocab, encoder = os.path.join(path, "vocab.bpe"), os.path.join(path, "encoder.json")
        if not (os.path.isfile(vocab) and os.path.isfile(encoder)):
            raise UserError(f"dataset.tokenizer_file: folder {path} must hold vocab.bpe and encoder.json")
        return data_gym_to_mergeable_bpe_ranks(vocab, encoder)
    if not os.path.isfile(path):
        raise UserError(f"dataset.tokenizer_file: {path} does not exist (a .tiktoken file or a folder with vocab.bpe)")
    try:
        return load_tiktoken_bpe(path)
    except Exception as error:  # a file that is not "<base64 token> <rank>" lines
        raise UserError(f"dataset.tokenizer_file: {path} is not a tiktoken BPE ranks file ({error})") from None


def gpt2_available(raise_if_not: bool = False) -> bool:
    """GPT-2's BPE files are in tiktoken's cache, or their host answers within seconds (tiktoken then downloads
    them)."""
    if _gpt2_cached() or (not offline_flag() and probe("openaipublic.blob.core.windows.net")[0]):
        return True
    if raise_if_not:
        raise UserError(
            f"dataset.tokenizer: gpt2 needs GPT-2's BPE files, which are not in tiktoken's cache "
            f"({_tiktoken_cache_dir()}) and cannot be downloaded offline; set dataset.tokenizer_file "
            "(a .tiktoken file or a folder with vocab.bpe and encoder.json), TIKTOKEN_CACHE_DIR, or tokenizer: byte"
        )
    return False


def resolve_tokenizer(kind: str, tokenizer_file: str | None) -> Tokenizer:
    """The tokenizer a config asks for. gpt2 comes from tokenizer_file, else tiktoken's cache, else a download when
    the BPE host answers within seconds; otherwise gpt2 is a UserError and auto falls back to bytes. nanochat's BPE
    comes from tokenizer_file here (`source_tokenizer` trains it)."""
    if kind == "byte":
        return Tokenizer("byte")
    if kind == "nanochat":
        if not tokenizer_file:
            raise UserError("dataset.tokenizer: nanochat is trained on a pre-training source's documents (fineweb_edu, "
                            "wikitext103, pg19, text_files, pydoc_text), or read from dataset.tokenizer_file")
        path = os.path.expanduser(tokenizer_file)
        return nanochat_tokenizer(_ranks_from_file(path), path)
    if tokenizer_file:
        return gpt2_tokenizer(_ranks_from_file(os.path.expanduser(tokenizer_file)))
    if gpt2_available():
        from tiktoken_ext.openai_public import gpt2

        try:
            return gpt2_tokenizer(gpt2()["mergeable_ranks"])
        except Exception as error:
            if kind == "gpt2":
                raise UserError(f"dataset.tokenizer: gpt2 could not be loaded ({type(error).__name__}); "
                                "set dataset.tokenizer_file or use tokenizer: byte") from None
    if kind == "gpt2":
        gpt2_available(raise_if_not=True)
    return Tokenizer("byte")


def source_tokenizer(cfg, training_texts: Callable[[], Iterable[str]], text_identity: dict) -> Tokenizer:
    """The tokenizer of a text source's config. tokenizer: nanochat is nanochat's BPE: from tokenizer_file, else
    the cached one trained on the same text with the same `bpe` settings, else trained on `training_texts()` (the
    training documents in an order that does not depend on the trial's seed; `text_identity` names them)."""
    if cfg.tokenizer != "nanochat":
        return resolve_tokenizer(cfg.tokenizer, cfg.tokenizer_file)
    from study.data.nanochat_bpe import nanochat_merges

    merges, path = nanochat_merges(training_texts, text_identity, vocab_size=cfg.bpe.vocab_size,
                                   max_chars=cfg.bpe.max_chars, doc_cap=cfg.bpe.doc_cap,
                                   tokenizer_file=cfg.tokenizer_file)
    return nanochat_tokenizer(merges, path)


class TokenTargets:
    """Worker-side steps on packed (seq_len + 1)-token windows: inputs, next-token targets and the UTF-8 bytes each
    target stands for (what val_bpb divides by). The same for training and validation. Windows with a `loss_mask`
    (chat data) have IGNORE_INDEX targets, standing for 0 bytes, where the mask of the target token is 0. Document
    windows (`document_windows`) have IGNORE_INDEX targets outside their scored ones, and keep `length` and
    `words`."""

    def __init__(self, token_bytes: np.ndarray):
        self.token_bytes = token_bytes
        self._table = None  # token_bytes on the training device, made once per process (never pickled)

    def __getstate__(self):
        return {"token_bytes": self.token_bytes, "_table": None}

    def __call__(self, batch: dict, rng: np.random.Generator) -> dict:
        return self.evaluate(batch)

    def evaluate(self, batch: dict) -> dict:
        import torch

        tokens = batch["tokens"].long()
        targets = tokens[:, 1:]
        if self._table is None or self._table.device != targets.device:
            self._table = torch.from_numpy(self.token_bytes.astype(np.int64)).to(targets.device)
        target_bytes = self._table[targets]
        if "loss_mask" in batch:  # chat: only the masked-in tokens are targets (nanochat's render_conversation mask)
            keep = batch["loss_mask"][:, 1:].bool()
            targets, target_bytes = targets.masked_fill(~keep, IGNORE_INDEX), target_bytes.masked_fill(~keep, 0)
        extra = {}
        if "scored" in batch:  # document windows: the last `scored` of the row's length - 1 targets count
            position = torch.arange(targets.shape[1], device=targets.device)[None]
            end = batch["length"].long()[:, None] - 1
            keep = (position < end) & (position >= end - batch["scored"].long()[:, None])
            targets, target_bytes = targets.masked_fill(~keep, IGNORE_INDEX), target_bytes.masked_fill(~keep, 0)
            extra = {"length": batch["length"].long(), "words": batch["words"].long()}
        return {"input_ids": tokens[:, :-1], "targets": targets, "target_bytes": target_bytes, **extra}


def tokenize_and_pack(batch: dict, tokenizer: Tokenizer, seq_len: int, text_column: str) -> dict:
    """Ray Data map_batches function: a batch of documents -> {"tokens": int32 (n, seq_len + 1)} packed windows."""
    texts = [t if isinstance(t, str) else bytes(t).decode("utf-8", errors="replace") for t in batch[text_column]]
    return {"tokens": pack_documents(tokenizer.encode(texts), tokenizer.eot, seq_len)}


def doc_hash_fraction(keys: list[bytes], seed: int) -> np.ndarray:
    """A uniform number in [0, 1) per key, fixed by (key, seed): the streaming-friendly hold-out split."""
    salt = seed.to_bytes(8, "little", signed=True)
    return np.array(
        [int.from_bytes(hashlib.blake2b(key, digest_size=8, salt=salt[:8]).digest(), "little") / 2.0**64
         for key in keys],
        dtype=np.float64,
    )
