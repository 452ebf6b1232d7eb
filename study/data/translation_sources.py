"""Translation sources: the generated toy pair (offline) and WMT14 from the hub's parquet files (or a local copy).

Both give pairs of texts to `translation_task`, which trains (or reads) the shared BPE vocabulary on the driver,
tokenises inside Ray Data map_batches tasks and pads every row of a split to one length. The validation split is
small (WMT14's newstest sets: 3 000 pairs) and read on the driver, padded to its longest pair so that no validation
sentence is cut: BLEU is scored on the whole reference.
"""

from __future__ import annotations

import numpy as np
import ray

from study.data.config import ToyTranslationConfig, WMT14Config
from study.data.hub import resolve_parquet_files
from study.data.task_data import TaskData
from study.data.translation import PAD, ToyLanguage, TranslationBatches, Vocabulary, encode_pairs, longest_pair
from study.errors import UserError

PAIRS_PER_TASK = 1024  # pairs per tokenise task batch


def translation_task(cfg, train_pairs: "ray.data.Dataset", val_sources: list[str], val_targets: list[str], *,
                     vocabulary: Vocabulary, num_train: int | None, materialize: bool, params: dict) -> TaskData:
    """`train_pairs`: a Ray dataset of {"source", "target"} texts; the validation pairs as lists."""
    val_length = longest_pair(vocabulary, val_sources, val_targets)
    train = train_pairs.map_batches(encode_pairs, fn_kwargs={"vocabulary": vocabulary, "length": cfg.max_tokens,
                                                             "drop_longer": True},
                                    batch_size=PAIRS_PER_TASK, batch_format="numpy")
    val = ray.data.from_items([{"source": s, "target": t} for s, t in zip(val_sources, val_targets)],
                              override_num_blocks=1).map_batches(
        encode_pairs, fn_kwargs={"vocabulary": vocabulary, "length": val_length, "drop_longer": False},
        batch_size=PAIRS_PER_TASK, batch_format="numpy").materialize()
    if materialize:
        train = train.materialize()
        num_train = train.count()
    return TaskData(
        datasets={"train": train, "val": val},
        # context_length: STLT's T_init "auto" reads it (the longest training sentence)
        model_overrides={"vocab_size": vocabulary.size, "pad_id": PAD, "context_length": cfg.max_tokens},
        num_train=num_train,
        num_val=len(val_sources),
        batch_steps=TranslationBatches(vocabulary),
        params={**params, "vocab_size": vocabulary.size, "num_train": num_train, "num_val": len(val_sources)},
        shuffle_buffer=cfg.shuffle_buffer,
    )


def _vocabulary(cfg, texts) -> tuple[Vocabulary, str]:
    if cfg.tokenizer_file:
        with open(cfg.tokenizer_file, encoding="utf-8") as file:
            vocabulary = Vocabulary.from_json(file.read())
        try:
            vocabulary.size
        except Exception as error:  # not a tokenizers file, or its specials elsewhere
            raise UserError(f"dataset.tokenizer_file: {cfg.tokenizer_file}: {error}") from None
        return vocabulary, cfg.tokenizer_file
    return Vocabulary.train(texts(), cfg.vocab_size), "bpe trained on the training split"


def load_toy_translation(cfg: ToyTranslationConfig, seed: int) -> TaskData:
    """Pairs 0..num_train-1 train, then num_val validation pairs whose sources the training pairs do not hold."""
    language = ToyLanguage.make(cfg.split_seed)
    grammar = {"max_modifiers": cfg.max_modifiers, "max_adjectives": cfg.max_adjectives}
    sources, targets = language.pairs(cfg.num_train, cfg.split_seed, **grammar)
    seen = set(sources)
    extra_sources, extra_targets = language.pairs(4 * cfg.num_val + 100, cfg.split_seed + 1, **grammar)
    val = [(s, t) for s, t in zip(extra_sources, extra_targets) if s not in seen][:cfg.num_val]
    vocabulary, tokenizer = _vocabulary(cfg, lambda: sources + targets)
    train = ray.data.from_items([{"source": s, "target": t} for s, t in zip(sources, targets)],
                                override_num_blocks=2)
    return translation_task(cfg, train, [s for s, _ in val], [t for _, t in val], vocabulary=vocabulary,
                            num_train=None, materialize=True,
                            params={"source": "toy_translation", "tokenizer": tokenizer})


def _translation_rows(batch: dict, source_lang: str, target_lang: str) -> dict:
    """A batch of the hub's `translation` structs -> {"source", "target"} texts."""
    rows = batch["translation"]
    return {"source": np.array([r[source_lang] for r in rows], dtype=object),
            "target": np.array([r[target_lang] for r in rows], dtype=object)}


def _read_pairs(files: list[str], filesystem, cfg: WMT14Config, limit: int | None) -> tuple[list[str], list[str]]:
    """The first `limit` pairs (None: all) of parquet files, read on the driver."""
    import pyarrow.parquet as pq

    sources, targets = [], []
    for path in files:
        parquet = pq.ParquetFile(filesystem.open_input_file(path) if filesystem else path)
        for batch in parquet.iter_batches(columns=["translation"], batch_size=65536):
            for row in batch.column(0).to_pylist():
                sources.append(row[cfg.source_lang])
                targets.append(row[cfg.target_lang])
                if limit is not None and len(sources) >= limit:
                    return sources, targets
    return sources, targets


def load_wmt14(cfg: WMT14Config, seed: int) -> TaskData:
    """Training pairs streamed from the train split's parquet files in a seeded order; the validation split (or
    test, newstest2014) read on the driver; the BPE learnt on the first `tokenizer_pairs` training pairs."""
    hub = resolve_parquet_files(cfg.hub_id, config_name=cfg.config_name, revision=cfg.revision,
                                local_dir=cfg.local_dir, source="wmt14", what=f"{cfg.hub_id} ({cfg.config_name})")
    train_files = hub.files("train", "source")
    val_sources, val_targets = _read_pairs(hub.files(cfg.val_split, "val_split"), hub.filesystem, cfg, None)

    def tokenizer_texts():
        sources, targets = _read_pairs(train_files, hub.filesystem, cfg, cfg.tokenizer_pairs)
        return sources + targets

    vocabulary, tokenizer = _vocabulary(cfg, tokenizer_texts)
    order = [train_files[i] for i in np.random.default_rng(seed).permutation(len(train_files))]
    train = ray.data.read_parquet(order, filesystem=hub.filesystem, columns=["translation"]).map_batches(
        _translation_rows, fn_kwargs={"source_lang": cfg.source_lang, "target_lang": cfg.target_lang},
        batch_format="numpy")
    if cfg.max_train_pairs:
        train = train.limit(cfg.max_train_pairs)
    return translation_task(cfg, train, val_sources, val_targets, vocabulary=vocabulary, num_train=None,
                            materialize=False,
                            params={"source": "wmt14", "hub_id": cfg.hub_id, "pair": cfg.config_name,
                                    "direction": f"{cfg.source_lang}-{cfg.target_lang}", "val_split": cfg.val_split,
                                    "read_from": "local copy" if hub.local else "hub", "tokenizer": tokenizer})
