"""The translation task (study/tasks/translation.py) and its data (study/data/translation.py): the loss against a
hand computation, BLEU against sacreBLEU's own corpus score, the length buckets, the toy pair's agreement, the
vocabulary's round trip, the evaluation of a tiny model, the offline failure of WMT14; and one Ray study on the toy
pair that learns (slow)."""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch
import yaml

from study.data.translation import (
    BOS,
    EOS,
    PAD,
    SOURCE_PLURAL,
    VERB_AGREEMENT,
    ToyLanguage,
    TranslationBatches,
    Vocabulary,
    encode_pairs,
)
from study.errors import UserError
from study.optim import build_schedule
from study.runspec import Resources, resolve
from study.space import load_space
from study.tasks import GeometrySpec
from study.tasks.translation import (
    BUCKETS,
    Translation,
    bleu_from_statistics,
    bleu_statistics,
    bucket_of,
    smoothed_loss,
)
from study.worker import Worker
from study_fixtures import lapstudy, metric_history, mlflow_runs, ray_address, tune_trials, write_yaml  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def toy():
    language = ToyLanguage.make(0)
    sources, targets = language.pairs(600, 0)
    return language, sources, targets, Vocabulary.train(sources + targets, 640)


def test_the_loss_is_label_smoothed_cross_entropy_over_the_unpadded_targets():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    targets = torch.tensor([[4, 5, EOS], [6, EOS, PAD]])
    eps = 0.1
    terms = []
    for b in range(2):
        for n in range(3):
            if targets[b, n] == PAD:
                continue
            log_p = logits[b, n] - torch.logsumexp(logits[b, n], dim=0)
            terms.append((1 - eps) * -log_p[targets[b, n]] + eps * -log_p.mean())
    assert torch.allclose(smoothed_loss(logits, targets, eps), torch.stack(terms).mean(), atol=1e-6)
    plain = torch.nn.functional.cross_entropy(logits[0], targets[0])
    assert not torch.allclose(smoothed_loss(logits, targets, eps), plain)


def test_bleu_from_summed_statistics_is_sacrebleus_corpus_bleu():
    hypotheses = ["the cat sat on the mat", "a dog barked at the moon today", "hello there"]
    references = ["the cat sat on a mat", "a dog barked loudly at the moon", "hello there general"]
    assert bleu_from_statistics(bleu_statistics(references, references)) == pytest.approx(100.0)
    whole = sacrebleu.corpus_bleu(hypotheses, [references]).score
    assert 0 < whole < 100
    # what the workers do: statistics of disjoint shards, added up
    summed = bleu_statistics(hypotheses[:1], references[:1]) + bleu_statistics(hypotheses[1:], references[1:])
    assert bleu_from_statistics(summed) == pytest.approx(whole, abs=1e-9)
    assert math.isnan(bleu_from_statistics(bleu_statistics([], [])))


def test_bucket_bleu_is_sacrebleus_corpus_bleu_of_the_buckets_sentences_smoothing_included():
    """Each bucket's score from statistics summed over two workers' shards equals sacrebleu.corpus_bleu on that
    bucket's sentences, exactly; one bucket holding every sentence is corpus_bleu of the corpus. The first bucket's
    two sentences share trigrams with their references but no 4-gram: corpus_bleu's 'exp' smoothing scores them
    above 0, where BLEU without smoothing is 0."""
    hypotheses = ["the cat sat there on a mat", "a dog barked loudly at night", "hello there my friend",
                  "we went home early today", "it rained all day long here", "birds sing in the morning"]
    references = ["the cat sat on the mat", "a dog barked at the moon", "hello there my friend",
                  "we went home late today", "it rained all day here", "the birds sing in the morning"]
    buckets = [0, 0, 1, 1, 2, 2]
    for bucket in range(3):
        mine = [i for i, b in enumerate(buckets) if b == bucket]
        shards = [mine[::2], mine[1::2]]  # two workers' sentences of the bucket
        summed = sum(bleu_statistics([hypotheses[i] for i in shard], [references[i] for i in shard])
                     for shard in shards)
        expected = sacrebleu.corpus_bleu([hypotheses[i] for i in mine], [[references[i] for i in mine]])
        assert bleu_from_statistics(summed) == expected.score, bucket
    first = sacrebleu.corpus_bleu(hypotheses[:2], [references[:2]])
    assert first.counts[3] == 0 < first.totals[3] and first.counts[2] > 0 and first.score > 0
    assert sacrebleu.BLEU.compute_bleu(first.counts, first.totals, first.sys_len, first.ref_len).score == 0.0
    whole = bleu_statistics(hypotheses[:3], references[:3]) + bleu_statistics(hypotheses[3:], references[3:])
    assert bleu_from_statistics(whole) == sacrebleu.corpus_bleu(hypotheses, [references]).score


def test_length_buckets_count_source_words():
    assert [name for name, _, _ in BUCKETS] == ["le20", "21_50", "51_100", "gt100"]
    assert [bucket_of(w) for w in (1, 20, 21, 50, 51, 100, 101, 400)] == [0, 0, 1, 1, 2, 2, 3, 3]
    rows = encode_pairs({"source": np.array(["a b  c", " ".join(["w"] * 101)], dtype=object),
                         "target": np.array(["x", "y"], dtype=object)}, Vocabulary.train(["a b c w x y"], 300),
                        256, False)
    assert rows["src_words"].tolist() == [3, 101]


def test_the_toy_targets_verb_agrees_with_the_subject_phrases_away(toy):
    language, sources, targets, _ = toy
    nouns = {source for source, _ in language.nouns}
    far = 0
    for source, target in zip(sources, targets):
        words = source.split()
        first_noun = next(i for i, w in enumerate(words) if w in nouns or w.removesuffix(SOURCE_PLURAL) in nouns)
        plural = words[first_noun] not in nouns
        verb = target.split()[-1]
        assert verb.endswith(VERB_AGREEMENT[plural]) and not verb.endswith(VERB_AGREEMENT[not plural])
        between = target.split()[2:-1]
        far += len(between) >= 6
    assert far > len(sources) // 3  # most verbs stand far from their subject
    # the context-free baseline: word by word, no reordering, no agreement
    word_by_word = sacrebleu.corpus_bleu([language.word_by_word(s) for s in sources], [targets]).score
    assert word_by_word < 15


def test_the_vocabulary_round_trips_text_byte_for_byte(toy):
    _, sources, targets, vocabulary = toy
    texts = sources[:50] + targets[:50] + ["Grüße aus Köln — 3 × 4 = 12,  zwei Leerzeichen!", "  lead and trail "]
    ids = vocabulary.encode(texts)
    assert vocabulary.decode([[*row.tolist(), EOS, PAD, PAD] for row in ids]) == texts
    assert vocabulary.size <= 640 and np.mean([len(i) for i in ids[:50]]) < 2 * np.mean(
        [len(s.split()) for s in sources[:50]])
    restored = Vocabulary.from_json(vocabulary.json)
    assert restored.encode(texts[:3])[0].tolist() == ids[0].tolist()


def test_batches_shift_the_target_right_behind_bos(toy):
    _, sources, targets, vocabulary = toy
    rows = encode_pairs({"source": np.array(sources[:4], dtype=object), "target": np.array(targets[:4], dtype=object)},
                        vocabulary, 128, True)
    batch = TranslationBatches(vocabulary).evaluate({k: torch.from_numpy(v) for k, v in rows.items()})
    src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
    assert src.shape[1] == int((src != PAD).sum(dim=1).max()) < 128  # trimmed to the longest sentence
    assert (tgt_in[:, 0] == BOS).all()
    real = tgt_out != PAD
    assert torch.equal(tgt_in[:, 1:][real[:, 1:]], tgt_out[:, :-1][real[:, 1:]])
    assert ((tgt_in == PAD) == ~real).all()
    assert vocabulary.decode(tgt_out.tolist()) == targets[:4]


def test_evaluate_on_a_tiny_model_returns_every_metric(toy):
    language, sources, targets, vocabulary = toy
    torch.manual_seed(0)
    resolved = resolve({"model": "encdec", "vocab_size": vocabulary.size, "dim": 32, "depth": 1, "num_heads": 2,
                        "mt_beam_size": 2, "mt_max_len_b": 5}, "translation", {}, epochs=1)
    model = Translation.build_model(resolved, None)
    task = Translation(model, Worker(0, 1, torch.device("cpu")), seed=0,
                       geometry=GeometrySpec(max_batches=1, top_targets=8, pca_points=50), resolved=resolved)
    rows = encode_pairs({"source": np.array(sources[:24], dtype=object),
                         "target": np.array(targets[:24], dtype=object)}, vocabulary, 128, False)
    steps = TranslationBatches(vocabulary)

    def batches(split="val"):
        for i in (0, 12):
            yield steps.evaluate({k: torch.from_numpy(v[i:i + 12]) for k, v in rows.items()})

    task.setup(batches)
    train_batch = steps({k: torch.from_numpy(v[:12]) for k, v in rows.items()}, np.random.default_rng(0))
    assert set(train_batch) == {"src", "tgt_in", "tgt_out"} and task.loss(model, train_batch).item() > 0
    evaluation = task.evaluate(batches(), autocast=contextlib.nullcontext(), geometry=True)
    metrics = evaluation.metrics
    assert set(Translation.quality_metrics) <= set(metrics)
    assert {f"geom_{name}" for name in Translation.geometry_metrics} <= set(metrics)
    assert 0 <= metrics["val_bleu"] <= 100 and metrics["val_loss"] > 0 and metrics["decode_tokens_per_s"] > 0
    assert 0 <= metrics["val_bleu_le20"] <= 100  # the toy's sentences are 5-29 words
    assert math.isnan(metrics["val_bleu_51_100"]) and math.isnan(metrics["val_bleu_gt100"])
    words = [len(source.split()) for source in sources[:24]]
    assert metrics["val_bleu_sentences"] == 24 and metrics["val_bleu_gt100_sentences"] == 0
    assert metrics["val_bleu_le20_sentences"] == sum(w <= 20 for w in words) > 0
    assert metrics["val_bleu_21_50_sentences"] == sum(21 <= w <= 50 for w in words) > 0
    assert 0 < metrics["geom_between_token_frac"] < 1 and evaluation.pictures.label_name == "source token"
    assert set(Translation.epoch_metrics()) >= {"val_bleu", "tokens_per_s", "train_loss"}


def test_s_eff_counts_the_teacher_forced_pass_over_every_pair_and_not_the_beam_search(toy):
    """stlt_s_eff_enc0 / _dec0 against the gate's definition over each batch's own encode and decode (padding left
    out: a sentence is one row of the bilateral encoder, each target position one of the causal decoder): active
    nodes are those with alpha >= 0.01. The beam search, which encodes the first pairs again, does not count."""
    _, sources, targets, vocabulary = toy
    torch.manual_seed(0)
    resolved = resolve({"model": "encdec", "vocab_size": vocabulary.size, "dim": 32, "depth": 1, "num_heads": 2,
                        "mixer": "stlt", "decoder_mixer": "stlt", "stlt_nodes": 6, "mt_beam_size": 2,
                        "mt_max_len_b": 3, "mt_bleu_sentences": 3}, "translation", {}, epochs=1)
    model = Translation.build_model(resolved, None).eval()
    mixers = {"enc0": model.encoder_layers[0].mixer, "dec0": model.decoder_layers[0].mixer}
    with torch.no_grad():
        for mixer in mixers.values():  # gates from always on to always off, many moving with the sentence
            mixer.gate_weight.normal_(0, 3.0)
            mixer.gate_bias.copy_(torch.linspace(6, -8, 6))
    rows = encode_pairs({"source": np.array(sources[:20], dtype=object),
                         "target": np.array(targets[:20], dtype=object)}, vocabulary, 128, False)
    steps = TranslationBatches(vocabulary)
    batches = [steps.evaluate({k: torch.from_numpy(v[i:i + 7]) for k, v in rows.items()}) for i in (0, 7, 14)]
    seen = {name: [] for name in mixers}
    hooks = [mixer.register_forward_pre_hook(lambda module, args, kwargs, name=name: seen[name].append(
        (args[0], kwargs["padding_mask"])), with_kwargs=True) for name, mixer in mixers.items()]
    with torch.no_grad():
        for batch in batches:
            model.decode(batch["tgt_in"], model.encode(batch["src"]))
    expected = {}
    for name, mixer in mixers.items():
        active = count = 0
        for x, padding in seen[name]:
            keep = (~padding).to(x.dtype)[..., None]
            if mixer.causal:
                pooled = (x * keep).cumsum(dim=1) / keep.cumsum(dim=1).clamp(min=1)
                alpha = torch.sigmoid(pooled @ mixer.gate_weight.T + mixer.gate_bias)[~padding]
            else:
                alpha = torch.sigmoid((x * keep).sum(dim=1) / keep.sum(dim=1) @ mixer.gate_weight.T + mixer.gate_bias)
            active, count = active + (alpha >= 0.01).sum().item(), count + alpha.shape[0]
        expected[name] = active / count
        assert 0 < expected[name] < 6, name
    for hook in hooks:
        hook.remove()
    task = Translation(model, Worker(0, 1, torch.device("cpu")), seed=0, geometry=GeometrySpec(), resolved=resolved)
    task.setup(lambda split="val": iter(batches))
    metrics = task.evaluate(iter(batches), autocast=contextlib.nullcontext(), geometry=False).metrics
    assert metrics["stlt_s_eff_enc0"] == pytest.approx(expected["enc0"], rel=1e-12)
    assert metrics["stlt_s_eff_dec0"] == pytest.approx(expected["dec0"], rel=1e-12)


def test_wmt14_offline_fails_at_once_naming_the_offline_source(monkeypatch, tmp_path):
    from study.data import check_dataset

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LAPSTUDY_DATA_DIR", str(tmp_path))
    started = time.perf_counter()
    with pytest.raises(UserError) as error:
        check_dataset({"source": "wmt14"})
    assert time.perf_counter() - started < 2
    message = str(error.value)
    assert "wmt/wmt14" in message and "toy_translation" in message and "local_dir" in message
    assert "\n" not in message


def test_wmt14_reads_a_local_copy_in_the_direction_asked(tmp_path):
    """The driver's side of the WMT14 source without Ray: the hub layout's parquet files of a local copy, resolved
    by `datasets` from the copy's card, read as (source, target) in the configured direction."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from study.data.config import WMT14Config
    from study.data.hub import resolve_parquet_files
    from study.data.translation_sources import _read_pairs

    root = tmp_path / "wmt" / "wmt14"
    (root / "de-en").mkdir(parents=True)
    for split, n in (("train", 5), ("validation", 3)):
        rows = [{"de": f"Satz {i} über Köln", "en": f"sentence {i} about Cologne"} for i in range(n)]
        pq.write_table(pa.table({"translation": rows}), root / "de-en" / f"{split}-00000-of-00001.parquet")
    (root / "README.md").write_text("---\nconfigs:\n- config_name: de-en\n  data_files:\n"
                                    "  - split: train\n    path: de-en/train-*\n"
                                    "  - split: validation\n    path: de-en/validation-*\n---\n")
    cfg = WMT14Config(source="wmt14", local_dir=str(root))
    hub = resolve_parquet_files(cfg.hub_id, config_name=cfg.config_name, revision=None, local_dir=cfg.local_dir,
                                source="wmt14", what="wmt14")
    assert hub.local and set(hub.splits) == {"train", "validation"}
    sources, targets = _read_pairs(hub.files("validation", "val_split"), hub.filesystem, cfg, None)
    assert sources == [f"sentence {i} about Cologne" for i in range(3)] and targets[2] == "Satz 2 über Köln"
    assert len(_read_pairs(hub.files("train", "source"), None, cfg, 4)[0]) == 4


# ---- one study on the toy pair, through the command line on a local Ray cluster -------------------------------------

SHIPPED = yaml.safe_load((REPO / "search_spaces" / "translation_toy.yaml").read_text())
EPOCHS = 3
SPACE = {**SHIPPED, "name": "translation", "epochs": EPOCHS, "num_samples": 1, "early_stopping": "none",
         "sampler": "grid", "conditional": [], "points_to_evaluate": [],
         "dataset": {"source": "toy_translation", "num_train": 2000, "num_val": 60},
         "geometry": {"every": 3, "max_batches": 1, "pca_points": 100},
         "fixed": {**SHIPPED["fixed"], **SHIPPED["conditional"][0]["fixed"], "lr": 5.0e-3, "batch_size": 32,
                   "stlt_nodes": 16, "stlt_reg_start_step": 60},
         "parameters": {"mixer": ["stlt"]}}  # adaptive STLT, bilateral in the encoder and causal in the decoder


@pytest.mark.slow(seconds=50)
def test_a_toy_translation_study_of_stlt_learns_past_word_by_word_and_logs_bleu_per_bucket(tmp_path, ray_address):
    write_yaml(tmp_path / "translation.yaml", SPACE)
    run = lapstudy("run", "translation.yaml", "--storage", "studies", "--address", ray_address, cwd=tmp_path,
                   timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    study_dir = tmp_path / "studies" / "translation"
    uri = f"sqlite:///{study_dir / 'mlflow.db'}"
    [(trial, rows)] = tune_trials(study_dir).items()
    [mlflow_run] = [r for r in mlflow_runs(uri, "translation") if r.data.tags["lapstudy.trial_id"] == trial]
    bleu = [value for _, value in metric_history(uri, mlflow_run.info.run_id, "val_bleu")]
    loss = [value for _, value in metric_history(uri, mlflow_run.info.run_id, "val_loss")]
    # the context-free baseline, the toy pair translated word by word, scores about 7
    language = ToyLanguage.make(0)
    sources, targets = language.pairs(200, 1)
    baseline = sacrebleu.corpus_bleu([language.word_by_word(s) for s in sources], [targets]).score
    assert len(bleu) == EPOCHS and bleu[-1] > bleu[0] and loss[-1] < loss[0], (bleu, loss)
    assert bleu[-1] > baseline, (bleu, baseline)
    assert metric_history(uri, mlflow_run.info.run_id, "val_bleu_le20")
    assert [value for _, value in metric_history(uri, mlflow_run.info.run_id, "val_bleu_sentences")] == [60] * EPOCHS
    assert metric_history(uri, mlflow_run.info.run_id, "geom_between_token_frac")
    # The write-up's regulariser on from step 60 leaves most nodes in use: S_eff well above 0 in every layer.
    for layer in ("enc0", "enc1", "dec0", "dec1"):
        s_eff = [value for _, value in metric_history(uri, mlflow_run.info.run_id, f"stlt_s_eff_{layer}")]
        assert len(s_eff) == EPOCHS and s_eff[-1] >= 8, (layer, s_eff)  # of 16 nodes
    assert rows[-1]["decode_tokens_per_s"] > 0 and rows[-1]["epoch"] == EPOCHS


def test_the_wmt14_space_trains_as_transformer_base_does():
    """search_spaces/stlt_wmt14.yaml claims Transformer-base's recipe (Vaswani et al. 2017, 5.3-5.4 and table 3):
    its settings against the paper's numbers, the learning rate against the paper's formula step by step."""
    space = load_space(REPO / "search_spaces" / "stlt_wmt14.yaml")
    fixed = space.fixed
    train = space.run_spec(space.resolve(space.points_to_evaluate[0]), Resources()).train
    assert (train.beta1, train.beta2, train.eps, train.weight_decay) == (0.9, 0.98, 1e-9, 0.0)
    assert fixed["mt_label_smoothing"] == 0.1 and fixed["mt_beam_size"] == 4 and fixed["mt_length_penalty"] == 0.6
    d_model, warmup = 512, 4000
    assert train.warmup_epochs * train.steps_per_epoch == warmup
    assert train.steps_per_epoch * space.epochs == 100_000  # the base model's 100k steps
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=train.lr)
    schedule = build_schedule(optimizer, train, train.steps_per_epoch, space.epochs)
    for step in range(1, 12_001):
        paper = d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(paper, rel=2e-3), step  # lr rounded to 7.0e-4
        optimizer.step()
        schedule.step()
