"""nanochat's tokenizer: a byte-level BPE trained on the pre-training text, as karpathy/nanochat at e1770a3 trains
and uses it (nanochat/tokenizer.py `RustBPETokenizer`, scripts/tok_train.py).

Training is rustbpe's (nanochat's own trainer): the documents in order, each cut to `doc_cap` characters, until
more than `max_chars` characters are read (tok_train's `text_iterator`), split by nanochat's SPLIT_PATTERN, merged
up to `vocab_size - 9` tokens; the nine special tokens take the ids after the merges, in nanochat's order, so
`<|bos|>` is id `vocab_size - 9`. Encoding is tiktoken's, with the trained merges and the same pattern
(study/data/text.py `Tokenizer`, kind "nanochat").

A trained BPE is kept as a tiktoken ranks file (tiktoken's own format) in the data folder (`LAPSTUDY_DATA_DIR`,
else ~/.cache/lapstudy), under a name made of everything that decides it: the training text's identity, the
settings and the trainer's version. Every later trial, stage and node that reads the same folder loads it instead
of training again.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Callable, Iterable, Iterator

from study.errors import UserError

# nanochat/tokenizer.py SPLIT_PATTERN: GPT-4's, with numbers split into groups of at most 2 digits (\p{N}{1,2})
NANOCHAT_SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
                          r"""|\s*[\r\n]|\s+(?!\S)|\s+""")
NANOCHAT_VOCAB_SIZE = 2**16  # scripts/tok_train.py --vocab_size
NANOCHAT_MAX_CHARS = 2_000_000_000  # speedrun.sh: tok_train --max_chars=2000000000 (the script's default is 10B)
NANOCHAT_DOC_CAP = 10_000  # scripts/tok_train.py --doc_cap
TOKENIZER_FOLDER = "tokenizers"
# nanochat's special tokens (nanochat/tokenizer.py SPECIAL_TOKENS). <|bos|> is the tokenizer's end-of-text token, as
# nanochat does with tiktoken's GPT-2 (from_pretrained: "<|endoftext|>" is its bos); a tokenizer with `chat` gives
# the others the ids after it, in this order (study/data/chat.py renders conversations with them).
CHAT_SPECIAL_TOKENS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                       "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")


def capped_documents(texts: Iterable[str], max_chars: int, doc_cap: int) -> Iterator[str]:
    """tok_train.py's text_iterator: each document cut to doc_cap characters, stopping after the document that takes
    the count past max_chars."""
    read = 0
    for text in texts:
        text = text[:doc_cap]
        read += len(text)
        yield text
        if read > max_chars:
            return


def train_merges(texts: Iterable[str], vocab_size: int, max_chars: int, doc_cap: int) -> dict[bytes, int]:
    """The merge ranks (token bytes -> id) of RustBPETokenizer.train_from_iterator: the vocabulary less nanochat's
    nine special tokens."""
    import rustbpe

    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(capped_documents(texts, max_chars, doc_cap), vocab_size - len(CHAT_SPECIAL_TOKENS),
                                pattern=NANOCHAT_SPLIT_PATTERN)
    return {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}


def tokenizer_folder() -> Path:
    """Where trained BPEs are kept: beside the data mirror (LAPSTUDY_DATA_DIR), else the user's cache."""
    base = os.environ.get("LAPSTUDY_DATA_DIR")
    return Path(base) / TOKENIZER_FOLDER if base else Path.home() / ".cache" / "lapstudy" / TOKENIZER_FOLDER


def cache_path(text_identity: dict, vocab_size: int, max_chars: int, doc_cap: int) -> Path:
    """The file a BPE trained on this text with these settings is kept in."""
    key = {"text": text_identity, "vocab_size": vocab_size, "max_chars": max_chars, "doc_cap": doc_cap,
           "pattern": NANOCHAT_SPLIT_PATTERN, "rustbpe": version("rustbpe")}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return tokenizer_folder() / f"nanochat-{vocab_size}-{digest}.tiktoken"


def nanochat_merges(texts: Callable[[], Iterable[str]], text_identity: dict, *, vocab_size: int, max_chars: int,
                    doc_cap: int, tokenizer_file: str | None = None) -> tuple[dict[bytes, int], str]:
    """(merge ranks, the file they are in): read from tokenizer_file, else from the cache, else trained on
    `texts()` and cached."""
    from tiktoken.load import load_tiktoken_bpe

    if tokenizer_file:
        path = Path(os.path.expanduser(tokenizer_file))
        try:
            merges = load_tiktoken_bpe(str(path))
        except Exception as error:  # missing, or not "<base64 token> <rank>" lines
            raise UserError(f"dataset.tokenizer_file: {path} is not a tiktoken BPE ranks file ({error})") from None
        if len(merges) + len(CHAT_SPECIAL_TOKENS) != vocab_size:
            raise UserError(f"dataset.tokenizer_file: {path} holds {len(merges)} merges, which with nanochat's "
                            f"{len(CHAT_SPECIAL_TOKENS)} special tokens make {len(merges) + len(CHAT_SPECIAL_TOKENS)} "
                            f"tokens, not dataset.bpe.vocab_size {vocab_size}")
        return merges, str(path)
    path = cache_path(text_identity, vocab_size, max_chars, doc_cap)
    if path.is_file():
        return load_tiktoken_bpe(str(path)), str(path)
    merges = train_merges(texts(), vocab_size, max_chars, doc_cap)
    if len(merges) + len(CHAT_SPECIAL_TOKENS) != vocab_size:
        raise UserError(f"dataset.bpe.vocab_size: the training text gives only {len(merges)} merges (distinct pieces "
                        f"run out before {vocab_size - len(CHAT_SPECIAL_TOKENS)}); use a smaller vocab_size or more "
                        f"text (bpe.max_chars)")
    path.parent.mkdir(parents=True, exist_ok=True)
    # tiktoken's ranks format, "<base64 token> <rank>" a line (its dump_tiktoken_bpe needs blobfile for this), written
    # beside its final name and renamed: trials training the same BPE at once never read half a file
    lines = "".join(f"{base64.b64encode(token).decode()} {rank}\n"
                    for token, rank in sorted(merges.items(), key=lambda item: item[1]))
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".partial", delete=False) as partial:
        partial.write(lines)
    os.replace(partial.name, path)
    return merges, str(path)
