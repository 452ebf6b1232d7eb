"""Translation (the encoder-decoder, models/encdec.py): label-smoothed cross-entropy on the target tokens, judged by
detokenised sacreBLEU of beam-search hypotheses with a length penalty (models/beam_search.py), overall and per
source-length bucket, with the validation loss and the decoding speed (docs/translation.md).

BLEU is a corpus statistic, not a mean over sentences: each worker adds up sacreBLEU's sufficient statistics (the
matched and total n-gram counts, the hypothesis and reference lengths: `BLEU.corpus_score`) of its shard and bucket,
the sums are all-reduced, and the score is computed from the totals by sacreBLEU's `BLEU.compute_bleu` with the
smoothing `corpus_bleu` uses ('exp'), which is what `sacrebleu.corpus_bleu` computes on those sentences at once.
S_eff (STLT layers) is counted over the teacher-forced forward of every validation pair, not the beam search.

Geometry: the encoder's output tokens (the memory the decoder reads), padding left out, grouped by the source token
at their position, over the K most frequent source tokens of the validation split (`geometry.top_targets`): the
within-token variance is how much the context moves a token's representation, the between-token share how much
of the variance is the token's identity. The metrics are the language-collapse ones under these names.
"""

from __future__ import annotations

import time

import sacrebleu
import torch
import torch.nn.functional as F
from pydantic import Field

from models.beam_search import beam_search
from models.geometry import GeometryAccumulator, most_frequent_targets
from study.schema import StrictModel
from study.tasks.base import GeometryPictures, Task

PAD, BOS, EOS = 0, 1, 2  # study/data/translation.py's special ids (the model's pad_id is set by the data to PAD)
# Source-length buckets in words, (name, fewest, most): the write-up's claim is on sentences over 100 words.
BUCKETS = (("le20", 0, 20), ("21_50", 21, 50), ("51_100", 51, 100), ("gt100", 101, None))
# sacrebleu.corpus_bleu's metric: its defaults are corpus_bleu's (13a tokenisation, 'exp' smoothing, case-sensitive)
SACREBLEU = sacrebleu.BLEU()
ORDER = SACREBLEU.max_ngram_order
BLEU_STATS = 2 * ORDER + 2  # sacreBLEU's sufficient statistics: matched n-grams per order, totals, sys_len, ref_len
# The accumulator's language-collapse names, and what they are called here (groups are source tokens).
GEOMETRY_NAMES = {"total_var": "total_var", "within_seq_var": "within_seq_var", "pcs99": "pcs99",
                  "within_target_var": "within_token_var", "between_target_var": "between_token_var",
                  "between_target_frac": "between_token_frac", "target_nc1": "token_nc1",
                  "target_total_var": "token_total_var"}


class TranslationOptions(StrictModel):
    """The translation keys of a trial (defaults: Transformer-base, Vaswani et al. 2017, section 5.4 and 6.1)."""

    mt_label_smoothing: float = Field(0.1, ge=0, lt=1, description="label smoothing of the training loss")
    mt_beam_size: int = Field(4, ge=1, description="beam width of the evaluation's search (1: greedy)")
    mt_length_penalty: float = Field(0.6, ge=0, description="alpha of GNMT's length penalty ((5 + |y|) / 6)^alpha")
    mt_max_len_a: float = Field(1.0, ge=0, description="hypotheses have at most a * source tokens + b tokens")
    mt_max_len_b: int = Field(50, ge=1, description="(Vaswani et al.: input length + 50)")
    mt_bleu_sentences: int | None = Field(None, ge=1, description="decode only the first N validation sentences of "
                                                                  "each worker (None: all); the loss uses all")


def bleu_statistics(hypotheses: list[str], references: list[str]) -> torch.Tensor:
    """sacreBLEU's sufficient statistics of a set of sentences, summed (float64, BLEU_STATS: matched n-grams of each
    order, their totals, sys_len, ref_len), zeros for none."""
    if not hypotheses:
        return torch.zeros(BLEU_STATS, dtype=torch.float64)
    score = SACREBLEU.corpus_score(hypotheses, [references])
    return torch.tensor([*score.counts, *score.totals, score.sys_len, score.ref_len], dtype=torch.float64)


def bleu_from_statistics(stats: torch.Tensor) -> float:
    """Corpus BLEU (0-100) from summed statistics, with corpus_bleu's smoothing, as sacrebleu.corpus_bleu scores the
    sentences together; NaN when there is no sentence."""
    values = [int(round(v)) for v in stats.tolist()]
    sys_len, ref_len = values[2 * ORDER:]
    if ref_len == 0:
        return float("nan")
    return sacrebleu.BLEU.compute_bleu(
        values[:ORDER], values[ORDER:2 * ORDER], sys_len, ref_len, smooth_method=SACREBLEU.smooth_method,
        smooth_value=SACREBLEU.smooth_value, effective_order=SACREBLEU.effective_order, max_ngram_order=ORDER).score


def bucket_of(words: int) -> int:
    """The index in BUCKETS of a source of `words` words."""
    for index, (_, low, high) in enumerate(BUCKETS):
        if words >= low and (high is None or words <= high):
            return index
    raise ValueError(f"no bucket for {words} words")


def smoothed_loss(logits: torch.Tensor, targets: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Label-smoothed cross-entropy per target token, padding ignored: logits (B, N, V), targets (B, N)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=PAD,
                           label_smoothing=smoothing)


class Translation(Task):
    name = "translation"
    model_family = "encdec"
    data_kind = "translation"
    input_key = "src"
    sum_names = ("loss", "tokens")
    quality_metrics = ("val_bleu", "val_loss", *(f"val_bleu_{name}" for name, _, _ in BUCKETS),
                       "val_bleu_sentences", *(f"val_bleu_{name}_sentences" for name, _, _ in BUCKETS),
                       "decode_tokens_per_s")
    throughput = ("samples", "tokens")
    geometry_metrics = tuple(GEOMETRY_NAMES.values())
    layer_geometry_metrics = ()
    report_geometry = ("between_token_frac", "token_nc1", "within_seq_var")
    options = TranslationOptions

    def setup(self, eval_batches):
        """The K most frequent source tokens of the validation split (all workers): the geometry's groups."""
        vocab = self.model.config.vocab_size
        counts = torch.zeros(vocab, dtype=torch.float64)
        for batch in eval_batches("val"):
            counts += torch.bincount(batch["src"].flatten().cpu(), minlength=vocab).double()
        counts[[PAD, BOS, EOS]] = 0
        counts = self.worker.all_reduce(counts)
        ids = torch.repeat_interleave(torch.arange(vocab), counts.long())
        self.top_tokens = most_frequent_targets(ids, self.geometry.top_targets).to(self.worker.device)

    def loss(self, model, batch):
        logits = model(batch["src"], batch["tgt_in"])
        return smoothed_loss(logits, batch["tgt_out"], self.option.mt_label_smoothing)

    def count(self, batch):
        return {"samples": len(batch["src"]), "tokens": int((batch["tgt_out"] != PAD).sum())}

    def evaluate(self, batches, *, autocast, geometry):
        """The validation loss (cross-entropy per target token, unsmoothed) and S_eff over every pair, then beam
        search on the first `mt_bleu_sentences` of this worker's pairs: BLEU overall and per source-length bucket,
        with the sentences each holds, and the generated tokens per second of decoding; at geometry epochs the
        encoder geometry of the first batches."""
        model, option = self.model, self.option
        model.eval()
        sums = torch.zeros(len(self.sum_names), dtype=torch.float64)
        decoding = torch.zeros(2, dtype=torch.float64)  # tokens generated, seconds
        hypotheses, references, buckets = [], [], []
        accumulator = self.new_accumulator() if geometry else None
        nodes = self.node_counts()
        with torch.no_grad():
            for index, batch in enumerate(batches):
                with autocast, nodes.counting():
                    memory = model.encode(batch["src"])
                    logits = model.decode(batch["tgt_in"], memory)
                sums += torch.stack([F.cross_entropy(logits.float().flatten(0, 1), batch["tgt_out"].flatten(),
                                                     ignore_index=PAD, reduction="sum").double().cpu(),
                                     (batch["tgt_out"] != PAD).sum().double().cpu()])
                if geometry and (self.geometry.max_batches is None or index < self.geometry.max_batches):
                    self.accumulate(accumulator, memory.states, None, batch)
                room = len(batch["src"]) if option.mt_bleu_sentences is None else (
                    option.mt_bleu_sentences - len(hypotheses))
                if room <= 0:
                    continue
                src = batch["src"][:room]
                longest = int((src != PAD).sum(dim=1).max())
                started = time.perf_counter()
                with autocast:
                    out = beam_search(model, src, beam_size=option.mt_beam_size, alpha=option.mt_length_penalty,
                                      bos_id=BOS, eos_id=EOS, pad_id=PAD,
                                      max_len=int(option.mt_max_len_a * longest) + option.mt_max_len_b)
                decoding += torch.tensor([float(out.lengths.sum()), time.perf_counter() - started],
                                         dtype=torch.float64)
                vocabulary = batch["vocabulary"]
                hypotheses += vocabulary.decode(out.tokens.tolist())
                references += vocabulary.decode(batch["tgt_out"][:room].tolist())
                buckets += [bucket_of(int(w)) for w in batch["src_words"][:room]]
        # Row 0: every decoded sentence; row 1 + i: those of bucket i. Each: its count, then sacreBLEU's statistics.
        groups = [list(range(len(hypotheses)))] + [[j for j, b in enumerate(buckets) if b == i]
                                                    for i in range(len(BUCKETS))]
        stats = torch.stack([torch.cat([torch.tensor([float(len(group))], dtype=torch.float64),
                                        bleu_statistics([hypotheses[j] for j in group],
                                                        [references[j] for j in group])]) for group in groups])
        totals = self.worker.all_reduce(torch.cat([sums, decoding, stats.flatten()]))
        sums, decoding, stats = totals[:2], totals[2:4], totals[4:].view(len(groups), 1 + BLEU_STATS)
        seconds = decoding[1].item() / self.worker.world  # the workers decode side by side
        names = ["val_bleu", *(f"val_bleu_{name}" for name, _, _ in BUCKETS)]
        metrics = {"val_loss": sums[0].item() / max(sums[1].item(), 1),
                   **{name: bleu_from_statistics(row[1:]) for name, row in zip(names, stats)},
                   **{f"{name}_sentences": int(row[0]) for name, row in zip(names, stats)},
                   "decode_tokens_per_s": decoding[0].item() / seconds if seconds > 0 else float("nan"),
                   **nodes.metrics()}
        return self.finish_evaluation(metrics, accumulator if geometry else None, [])

    # ---- geometry: the encoder's output tokens grouped by their source token ---------------------------------------

    def new_accumulator(self, layer=False):
        return GeometryAccumulator(self.model.config.dim, target_ids=self.top_tokens,
                                   reservoir_size=1 if layer else self.geometry.pca_points,
                                   seed=self._reservoir_seed(), device=self.worker.device)

    def accumulate(self, accumulator, tokens, feature, batch, last=False):
        """tokens (B, Ns, D): each sentence's unpadded tokens (the accumulator's sequences have no padding)."""
        lengths = (batch["src"] != PAD).sum(dim=1).tolist()
        for row, length in enumerate(lengths):
            accumulator.update(tokens[row:row + 1, :length], targets=batch["src"][row:row + 1, :length])

    def finish_geometry(self, accumulator):
        values = accumulator.all_reduce_().compute()
        values = {mine: values[theirs] for theirs, mine in GEOMETRY_NAMES.items()}
        points, labels = accumulator.pca_projection()
        parts = {"within token": values["within_token_var"], "between token": values["between_token_var"]}
        return values, GeometryPictures(points, labels, "source token", parts, values["token_total_var"])
