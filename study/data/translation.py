"""Parallel text for the translation task: a shared subword vocabulary, a generated toy language pair, and the
worker-side batches (pure numpy + HF `tokenizers`, no Ray; the sources in `translation_sources.py` use Ray Data).

Vocabulary: one byte-level BPE (HF `tokenizers`, GPT-2's pre-tokeniser) trained on the source and target sides of
the training split together, the Transformer-base recipe's shared vocabulary. Byte-level means no unknown token
and an exact round trip: decoding a sentence's ids gives the sentence back, byte for byte, which is what lets the
task score detokenised BLEU against references decoded from the validation rows. Ids 0-3 are <pad>, <s>, </s>,
<unk> (the last never produced, kept for files trained elsewhere).

Rows: `src` = source ids + EOS, `tgt` = target ids + EOS, right-padded to one length per split, and `src_words`
(the source's whitespace-separated words, the length buckets of the BLEU per length).

The toy pair (`ToyLanguage`): an SVO source language whose nouns carry a number suffix and whose verb carries none,
and an SOV target language with postpositions and adjectives after the noun, whose verb must agree with the
subject. Between the subject and the verb stand prepositional phrases with nouns of either number and, in the
target, the object: a model that translates word by word gets the order and the agreement wrong.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")

_TOKENIZERS: dict[str, object] = {}  # per process: the `tokenizers.Tokenizer` of each vocabulary's fingerprint


@dataclass(frozen=True)
class Vocabulary:
    """A picklable shared subword vocabulary: the `tokenizers` JSON travels to the Ray Data and Train workers."""

    json: str
    fingerprint: str

    @classmethod
    def from_json(cls, text: str) -> "Vocabulary":
        return cls(text, hashlib.sha1(text.encode()).hexdigest())

    @classmethod
    def train(cls, texts, vocab_size: int) -> "Vocabulary":
        """Byte-level BPE with `vocab_size` entries (specials and the 256 byte symbols included) on `texts`."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tokenizer.train_from_iterator(texts, trainer)
        return cls.from_json(tokenizer.to_str())

    @property
    def tokenizer(self):
        tokenizer = _TOKENIZERS.get(self.fingerprint)
        if tokenizer is None:
            from tokenizers import Tokenizer

            tokenizer = _TOKENIZERS[self.fingerprint] = Tokenizer.from_str(self.json)
            for token_id, token in enumerate(SPECIAL_TOKENS):
                if tokenizer.token_to_id(token) != token_id:
                    raise ValueError(f"vocabulary: {token} must be id {token_id}, is {tokenizer.token_to_id(token)}")
        return tokenizer

    @property
    def size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int32) for e in self.tokenizer.encode_batch(list(texts),
                                                                                       add_special_tokens=False)]

    def decode(self, rows) -> list[str]:
        """Text of each row of ids: up to the first EOS, without padding or BOS."""
        out = []
        for row in rows:
            ids = [int(i) for i in row]
            if EOS in ids:
                ids = ids[:ids.index(EOS)]
            out.append(self.tokenizer.decode([i for i in ids if i not in (PAD, BOS)], skip_special_tokens=False))
        return out


def source_words(text: str) -> int:
    return len(text.split())


def encode_pairs(batch: dict, vocabulary: Vocabulary, length: int, drop_longer: bool) -> dict:
    """Ray Data map_batches function: {"source", "target"} texts -> {"src", "tgt"} (n, length) int32 ids + EOS,
    right-padded, and "src_words". A pair longer than `length` (EOS included) is dropped with `drop_longer` (the
    training filter), an error otherwise (a validation split is padded to its longest pair)."""
    sources = [str(s) for s in batch["source"]]
    targets = [str(t) for t in batch["target"]]
    src_ids, tgt_ids = vocabulary.encode(sources), vocabulary.encode(targets)
    keep = [i for i, (s, t) in enumerate(zip(src_ids, tgt_ids)) if max(len(s), len(t)) + 1 <= length]
    if not drop_longer and len(keep) < len(sources):
        raise ValueError(f"encode_pairs: a validation pair is longer than {length} tokens")
    src = np.full((len(keep), length), PAD, dtype=np.int32)
    tgt = np.full((len(keep), length), PAD, dtype=np.int32)
    for row, i in enumerate(keep):
        src[row, :len(src_ids[i])], src[row, len(src_ids[i])] = src_ids[i], EOS
        tgt[row, :len(tgt_ids[i])], tgt[row, len(tgt_ids[i])] = tgt_ids[i], EOS
    words = np.array([source_words(sources[i]) for i in keep], dtype=np.int32)
    return {"src": src, "tgt": tgt, "src_words": words}


def longest_pair(vocabulary: Vocabulary, sources: list[str], targets: list[str]) -> int:
    """Tokens (EOS included) of the longest side of any pair: the padded length that keeps every pair whole."""
    lengths = [len(ids) for ids in vocabulary.encode(sources) + vocabulary.encode(targets)]
    return max(lengths, default=0) + 1


class TranslationBatches:
    """Worker-side steps: padded rows -> the model's inputs, trimmed to the batch's longest sentence.

    `src` (B, Ns); `tgt_in` (B, Nt) = BOS then the target (the decoder's input, padded where `tgt_out` is);
    `tgt_out` (B, Nt) = the target then EOS (what each position predicts). Validation batches also carry
    `src_words` and the `vocabulary` that detokenises hypotheses and references (the task owns no data objects)."""

    def __init__(self, vocabulary: Vocabulary):
        self.vocabulary = vocabulary

    def __call__(self, batch: dict, rng: np.random.Generator) -> dict:
        src, tgt_in, tgt_out = self._tensors(batch)
        return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}

    def evaluate(self, batch: dict) -> dict:
        src, tgt_in, tgt_out = self._tensors(batch)
        return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out, "src_words": batch["src_words"].long(),
                "vocabulary": self.vocabulary}

    @staticmethod
    def _tensors(batch: dict):
        import torch

        src, tgt = batch["src"].long(), batch["tgt"].long()
        src = src[:, :max(1, int((src != PAD).sum(dim=1).max()))]
        tgt_out = tgt[:, :max(1, int((tgt != PAD).sum(dim=1).max()))]
        tgt_in = torch.cat((torch.full_like(tgt_out[:, :1], BOS), tgt_out[:, :-1]), dim=1)
        return src, tgt_in.masked_fill(tgt_out == PAD, PAD), tgt_out


# ---- the generated toy pair -----------------------------------------------------------------------------------

SOURCE_PLURAL = "s"  # source nouns: stem (singular) or stem + s (plural)
TARGET_PLURAL = "en"  # target nouns: stem or stem + en
VERB_AGREEMENT = {False: "o", True: "ul"}  # target verbs: stem + o (singular subject) or stem + ul (plural)


def _stems(rng: np.random.Generator, consonants: str, vowels: str, count: int, taken: set) -> list[str]:
    stems = []
    while len(stems) < count:
        stem = "".join(rng.choice(list(consonants)) + rng.choice(list(vowels)) for _ in range(2))
        if stem not in taken:
            taken.add(stem)
            stems.append(stem)
    return stems


@dataclass(frozen=True)
class ToyLanguage:
    """A lexicon of (source, target) stems per word class, drawn from `seed` (source stems CVCV over one
    alphabet, target stems over another, all distinct), and the grammar that makes sentence pairs:

        source  NP PP* verb NP                   NP = det adj* noun(+s)     PP = prep NP
        target  NP' PP'* NP' verb'(+o|+ul)       NP' = det' noun'(+en) adj'* (reversed)    PP' = NP' postp'

    The target verb ends in `ul` when the subject (the first noun) is plural, in `o` otherwise."""

    nouns: tuple[tuple[str, str], ...]
    verbs: tuple[tuple[str, str], ...]
    adjectives: tuple[tuple[str, str], ...]
    prepositions: tuple[tuple[str, str], ...]
    determiners: tuple[tuple[str, str], ...]

    @classmethod
    def make(cls, seed: int, *, nouns: int = 24, verbs: int = 12, adjectives: int = 12,
             prepositions: int = 6) -> "ToyLanguage":
        rng = np.random.default_rng([seed, 14])
        source_taken, target_taken = set(), set()
        counts = {"nouns": nouns, "verbs": verbs, "adjectives": adjectives, "prepositions": prepositions,
                  "determiners": 2}
        lexicon = {}
        for name, count in counts.items():
            src = _stems(rng, "bdfgklmnprtv", "aeiou", count, source_taken)
            tgt = _stems(rng, "chjqwxz", "aeiouy", count, target_taken)
            lexicon[name] = tuple(zip(src, tgt))
        return cls(**lexicon)

    def _noun_phrase(self, rng: np.random.Generator, max_adjectives: int) -> tuple[list[str], list[str], bool]:
        det = self.determiners[rng.integers(len(self.determiners))]
        noun = self.nouns[rng.integers(len(self.nouns))]
        adjectives = [self.adjectives[i] for i in rng.integers(len(self.adjectives), size=rng.integers(
            max_adjectives + 1))]
        plural = bool(rng.integers(2))
        source = [det[0], *(a[0] for a in adjectives), noun[0] + (SOURCE_PLURAL if plural else "")]
        target = [det[1], noun[1] + (TARGET_PLURAL if plural else ""), *(a[1] for a in reversed(adjectives))]
        return source, target, plural

    def sentence(self, rng: np.random.Generator, max_modifiers: int = 4,
                 max_adjectives: int = 2) -> tuple[str, str, bool]:
        """(source, target, the subject is plural) of one random sentence with 0..max_modifiers prepositional
        phrases between the subject and the verb."""
        subject_src, subject_tgt, plural = self._noun_phrase(rng, max_adjectives)
        source, target = list(subject_src), list(subject_tgt)
        for _ in range(rng.integers(max_modifiers + 1)):
            prep = self.prepositions[rng.integers(len(self.prepositions))]
            np_src, np_tgt, _ = self._noun_phrase(rng, max_adjectives)
            source += [prep[0], *np_src]
            target += [*np_tgt, prep[1]]
        verb = self.verbs[rng.integers(len(self.verbs))]
        object_src, object_tgt, _ = self._noun_phrase(rng, max_adjectives)
        source += [verb[0], *object_src]
        target += [*object_tgt, verb[1] + VERB_AGREEMENT[plural]]
        return " ".join(source), " ".join(target), plural

    def pairs(self, count: int, seed: int, **grammar) -> tuple[list[str], list[str]]:
        rng = np.random.default_rng([seed, 41])
        sources, targets = [], []
        for _ in range(count):
            source, target, _ = self.sentence(rng, **grammar)
            sources.append(source)
            targets.append(target)
        return sources, targets

    def word_by_word(self, source: str) -> str:
        """The context-free baseline: each source word replaced by its target word in place, nouns keeping their
        number, verbs in the singular (no reordering, no agreement)."""
        table = {s: t for group in (self.verbs, self.adjectives, self.prepositions, self.determiners)
                 for s, t in group}
        out = []
        for word in source.split():
            if word in table:
                out.append(table[word] + (VERB_AGREEMENT[False] if any(word == s for s, _ in self.verbs) else ""))
            else:
                stem = word.removesuffix(SOURCE_PLURAL)
                target = dict(self.nouns)[stem]
                out.append(target + (TARGET_PLURAL if word != stem else ""))
        return " ".join(out)
