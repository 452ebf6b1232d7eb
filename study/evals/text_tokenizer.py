"""One text at a time through the project's tokenizer, and back: what the harness adapter and GSM8K's sampler read
and write (apart from the harness module, so that GSM8K's tools import without lm-evaluation-harness)."""

from __future__ import annotations


class TextTokenizer:
    """String in, token ids out, and back: the project's `Tokenizer` (study/data/text.py) for one text at a time."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @property
    def name(self) -> str:
        return self.tokenizer.name

    @property
    def eot(self) -> int:
        return self.tokenizer.eot

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode([text])[0].tolist()

    def decode(self, ids: list[int]) -> str:
        ids = [i for i in ids if i != self.eot]
        if self.tokenizer.kind == "byte":
            return bytes(ids).decode("utf-8", errors="replace")
        # the tiktoken Encoding the Tokenizer builds and caches per process (it has no decode of its own)
        return self.tokenizer._encoding.decode_bytes(ids).decode("utf-8", errors="replace")
