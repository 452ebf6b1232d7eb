"""Language modelling (the GPT): next-token cross-entropy; validation loss in nats, perplexity and bits per UTF-8
byte; perplexity per token and per word at other context lengths where the data makes document windows of them
(`eval_contexts`: every validation document alone, in sliding windows; docs/data.md), with S_eff at each; the token
geometry grouped by next-token target ("language collapse")."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from models.geometry import GeometryAccumulator, most_frequent_targets
from study.data.task_data import CONTEXT_SPLIT, context_split
from study.tasks.base import Evaluation, GeometryPictures, Task

IGNORE_INDEX = -1  # a target not trained on nor evaluated (chat data outside the assistant's replies, as nanochat)


def language_model_sums(logits: torch.Tensor, targets: torch.Tensor, target_bytes: torch.Tensor) -> torch.Tensor:
    """[loss summed over all targets, number of targets, loss summed over targets that carry bytes, their bytes].
    val_bpb divides the third by ln 2 times the fourth: end-of-text and other zero-byte targets count in val_loss
    but not in bits per byte, so that val_bpb compares across tokenizers. IGNORE_INDEX targets count in neither."""
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none",
                             ignore_index=IGNORE_INDEX).double()
    counted = targets.flatten() != IGNORE_INDEX
    carries_bytes = (target_bytes.flatten() > 0) & counted
    return torch.stack([losses.sum(), counted.sum().double(), losses[carries_bytes].sum(),
                        target_bytes.flatten()[carries_bytes].sum().double()]).cpu()


def context_metric(length: int, unit: str) -> str:
    """Validation perplexity at a context of `length` tokens (docs/data.md), per "token" or per "word"."""
    return f"val_ppl_{unit}_ctx{length}"


def context_suffix(length: int) -> str:
    """What the other metrics of a context length end in (S_eff: stlt_s_eff_l3_ctx1024)."""
    return f"_ctx{length}"


def perplexity(loss_sum: float, targets: float) -> float:
    return math.exp(loss_sum / targets) if targets else math.nan


class LanguageModeling(Task):
    name = "language_modeling"
    model_family = "gpt"
    data_kind = "text"
    input_key = "input_ids"
    sum_names = ("loss", "targets", "byte_loss", "bytes")
    quality_metrics = ("val_bpb", "val_loss", "val_ppl")
    throughput = ("samples", "tokens")
    geometry_metrics = ("total_var", "within_seq_var", "pcs99", "within_target_var", "between_target_var",
                        "between_target_frac", "target_nc1", "target_total_var")
    layer_geometry_metrics = ("within_target_var", "between_target_var", "between_target_frac", "target_nc1")
    report_geometry = ("between_target_frac", "target_nc1", "within_seq_var")

    @classmethod
    def epoch_metrics(cls, dataset=None) -> tuple[str, ...]:
        return (*super().epoch_metrics(dataset),
                *(context_metric(length, unit) for length in getattr(dataset, "eval_contexts", ())
                  for unit in ("token", "word")))

    def setup(self, eval_batches):
        """The K most frequent next-token targets of the validation split (all workers): the language-collapse
        groups, fixed before the first evaluation so that every epoch groups the same tokens."""
        vocab = self.model.config.vocab_size
        counts = torch.zeros(vocab, dtype=torch.float64)
        for batch in eval_batches("val"):
            targets = batch["targets"].flatten()
            counts += torch.bincount(targets[targets != IGNORE_INDEX], minlength=vocab).double().cpu()
        counts = self.worker.all_reduce(counts)
        ids = torch.repeat_interleave(torch.arange(vocab), counts.long())
        self.top_targets = most_frequent_targets(ids, self.geometry.top_targets).to(self.worker.device)
        self.eval_batches = eval_batches
        self.contexts = sorted(int(name.removeprefix(CONTEXT_SPLIT)) for name in eval_batches.names
                               if name.startswith(CONTEXT_SPLIT))

    def evaluate(self, batches, *, autocast, geometry: bool) -> Evaluation:
        """The validation pass, then the perplexity at each context length of the data: the validation documents
        in its windows, each window run on its own tokens (a batch's windows grouped by length, so nothing is
        padded; positions past the trained context are the model's to extrapolate), per token and per word, with
        S_eff over those forwards."""
        evaluation = super().evaluate(batches, autocast=autocast, geometry=geometry)
        for length in self.contexts:
            sums = torch.zeros(3, dtype=torch.float64)  # loss, targets, words
            nodes = self.node_counts()
            with torch.no_grad():
                for batch in self.eval_batches(context_split(length)):
                    sums[2] += batch["words"].sum().item()
                    for used in batch["length"].unique().tolist():
                        rows = batch["length"] == used
                        targets = batch["targets"][rows, :used - 1]
                        with autocast, nodes.counting():
                            logits = self.model(batch["input_ids"][rows, :used - 1])
                        losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum",
                                                 ignore_index=IGNORE_INDEX)
                        sums[:2] += torch.stack([losses.double(), (targets != IGNORE_INDEX).sum().double()]).cpu()
            loss, targets, words = self.worker.all_reduce(sums).tolist()
            evaluation.metrics.update({context_metric(length, "token"): perplexity(loss, targets),
                                       context_metric(length, "word"): perplexity(loss, words),
                                       **nodes.metrics(context_suffix(length))})
        return evaluation

    def loss(self, model, batch):
        logits = model(batch["input_ids"])
        """Mean next-token cross-entropy over the targets that are not IGNORE_INDEX (chat_sft's loss)."""
        return F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten(), ignore_index=IGNORE_INDEX)

    def count(self, batch):
        return {"samples": len(batch["input_ids"]), "tokens": batch["input_ids"].numel()}

    def eval_sums(self, logits, batch):
        return language_model_sums(logits, batch["targets"], batch["target_bytes"])

    def eval_metrics(self, sums):
        return {"val_loss": sums["loss"] / sums["targets"], "val_ppl": perplexity(sums["loss"], sums["targets"]),
                "val_bpb": sums["byte_loss"] / (math.log(2) * sums["bytes"])}

    def new_accumulator(self, layer=False):
        return GeometryAccumulator(self.model.config.dim, target_ids=self.top_targets,
                                   reservoir_size=1 if layer else self.geometry.pca_points,
                                   seed=self._reservoir_seed(), device=self.worker.device)

    def accumulate(self, accumulator, tokens, feature, batch, last=False):
        accumulator.update(tokens, targets=batch["targets"])

    def finish_geometry(self, accumulator):
        values = accumulator.all_reduce_().compute()
        points, labels = accumulator.pca_projection()
        parts = {"within target": values["within_target_var"], "between target": values["between_target_var"]}
        return values, GeometryPictures(points, labels, "next token", parts, values["target_total_var"])
