"""Language-modelling sources: FineWeb-Edu, WikiText-103 and PG-19 streamed from the hub, and local text / jsonl /
parquet files.

Documents are tokenised and packed inside Ray Data (`build.text_task`); nothing is read before the first batch is
asked for, except the validation document ids of FineWeb-Edu (one column of one file).
"""

from __future__ import annotations

import glob
import os
import re

import numpy as np
import ray

from study.data.build import TEXT_MAP_BATCH, text_task
from study.data.config import FineWebEduConfig, PG19Config, TextFilesConfig, WikiText103Config
from study.data.hub import resolve_parquet_files
from study.data.task_data import TaskData
from study.data.text import doc_hash_fraction, resolve_tokenizer, source_tokenizer
from study.errors import UserError

TEXT_EXTENSIONS = (".txt", ".jsonl", ".parquet")


def _seeded_order(items: list, seed: int) -> list:
    """A fixed seeded permutation of the training files: the epochs then differ by the workers' local shuffle
    (seeded by (seed, epoch)), so epoch k is the same whether or not the run was resumed before it."""
    return [items[i] for i in np.random.default_rng(seed).permutation(len(items))]


def _drop_ids(batch: dict, ids: frozenset, id_column: str) -> dict:
    keep = np.array([i not in ids for i in batch[id_column]], dtype=bool)
    return {name: values[keep] for name, values in batch.items()}


def _first_ids(path: str, filesystem, column: str, count: int) -> list[str]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(filesystem.open_input_file(path) if filesystem else path)
    if column not in parquet.schema_arrow.names:
        raise UserError(f"dataset: {path} has no {column!r} column (columns: {', '.join(parquet.schema_arrow.names)})")
    ids = []
    for batch in parquet.iter_batches(columns=[column], batch_size=min(count, 65536)):
        ids.extend(batch.column(0).to_pylist())
        if len(ids) >= count:
            break
    return ids[:count]


def document_texts(docs: "ray.data.Dataset", column: str):
    """The documents' texts, in the dataset's order (what nanochat's BPE is trained on)."""
    for batch in docs.iter_batches(batch_size=TEXT_MAP_BATCH, batch_format="numpy"):
        for text in batch[column]:
            yield text if isinstance(text, str) else bytes(text).decode("utf-8", errors="replace")


def _early_tokenizer(cfg):
    """GPT-2 or bytes, resolved before the network so that a missing tokenizer fails first; None for nanochat's,
    which is trained on (or cached for) the training documents once they can be read."""
    return None if cfg.tokenizer == "nanochat" else resolve_tokenizer(cfg.tokenizer, cfg.tokenizer_file)


def load_fineweb_edu(cfg: FineWebEduConfig, seed: int) -> TaskData:
    """Validation: the first val_documents documents of the sample's last parquet file; training: every other
    document of the sample (the validation ids are filtered out), its files in a seeded order. nanochat's BPE is
    trained on the training documents with the files in their own order (tok_train.py reads the shards in order)."""
    tokenizer = _early_tokenizer(cfg)
    hub = resolve_parquet_files(cfg.hub_id, config_name=cfg.sample, revision=cfg.revision, local_dir=cfg.local_dir,
                                source="fineweb_edu", what=f"{cfg.hub_id} ({cfg.sample})")
    files = hub.files("train", "sample")
    id_column = "id"
    val_ids = frozenset(_first_ids(files[-1], hub.filesystem, id_column, cfg.val_documents))
    columns = [cfg.text_column, id_column]
    read = lambda paths, **kw: ray.data.read_parquet(paths, filesystem=hub.filesystem, columns=columns, **kw)  # noqa: E731
    val_docs = read(files[-1:]).limit(cfg.val_documents)
    train_docs = read(_seeded_order(files, seed)).map_batches(
        _drop_ids, fn_kwargs={"ids": val_ids, "id_column": id_column}, batch_format="numpy"
    )
    if cfg.max_train_documents:
        train_docs = train_docs.limit(cfg.max_train_documents)
    if tokenizer is None:
        in_order = read(files).map_batches(_drop_ids, fn_kwargs={"ids": val_ids, "id_column": id_column},
                                           batch_format="numpy")
        identity = {"source": "fineweb_edu", "hub_id": cfg.hub_id, "sample": cfg.sample, "revision": cfg.revision,
                    "val_documents": cfg.val_documents, "files": [os.path.basename(f) for f in files]}
        tokenizer = source_tokenizer(cfg, lambda: document_texts(in_order, cfg.text_column), identity)
    return text_task(
        cfg, train_docs, val_docs, tokenizer=tokenizer, text_column=cfg.text_column,
        params={"source": "fineweb_edu", "hub_id": cfg.hub_id, "sample": cfg.sample,
                "read_from": "local copy" if hub.local else "hub", "val_documents": len(val_ids)},
    )


# WikiText's articles start at a level-1 heading line (" = Title = "); its level-2 headings read " = = Section = = ".
WIKITEXT_ARTICLE = re.compile(r"^ = [^=].* = $")
WIKITEXT_LINES_PER_TASK = 20_000  # lines joined into articles per Ray Data task: about 70 articles
BOOKS_PER_TASK = 8  # PG-19 books tokenised per task: a book is about 400 kB of text


def wikitext_articles(batch: dict, column: str) -> dict:
    """Consecutive lines joined into articles, a new one at each level-1 heading. An article cut by a task's batch
    boundary becomes two documents (one end-of-text between them): about one article in seventy."""
    articles, current = [], []
    for line in batch[column]:
        if WIKITEXT_ARTICLE.match(line.rstrip("\n")) and current:
            articles.append("".join(current))
            current = []
        current.append(line)
    if current:
        articles.append("".join(current))
    return {column: np.array([a for a in articles if a.strip()], dtype=object)}


def load_wikitext103(cfg: WikiText103Config, seed: int) -> TaskData:
    tokenizer = _early_tokenizer(cfg)
    hub = resolve_parquet_files(cfg.hub_id, config_name=cfg.config_name, revision=cfg.revision,
                                local_dir=cfg.local_dir, source="wikitext103", what=f"{cfg.hub_id} ({cfg.config_name})")

    def articles(split: str, field_name: str):
        lines = ray.data.read_parquet(hub.files(split, field_name), filesystem=hub.filesystem,
                                      columns=[cfg.text_column])
        return lines.map_batches(wikitext_articles, fn_kwargs={"column": cfg.text_column},
                                 batch_size=WIKITEXT_LINES_PER_TASK, batch_format="numpy")

    train = articles("train", "source")
    if tokenizer is None:
        identity = {"source": "wikitext103", "hub_id": cfg.hub_id, "config": cfg.config_name,
                    "revision": cfg.revision}
        tokenizer = source_tokenizer(cfg, lambda: document_texts(train, cfg.text_column), identity)
    return text_task(cfg, train, articles(cfg.val_split, "val_split"), tokenizer=tokenizer,
                     text_column=cfg.text_column,
                     params={"source": "wikitext103", "hub_id": cfg.hub_id, "config": cfg.config_name,
                             "val_split": cfg.val_split, "read_from": "local copy" if hub.local else "hub"})


def load_pg19(cfg: PG19Config, seed: int) -> TaskData:
    tokenizer = _early_tokenizer(cfg)
    hub = resolve_parquet_files(cfg.hub_id, config_name=None, revision=cfg.revision, local_dir=cfg.local_dir,
                                source="pg19", what=cfg.hub_id)
    read = lambda files: ray.data.read_parquet(files, filesystem=hub.filesystem, columns=[cfg.text_column])  # noqa: E731
    if tokenizer is None:
        identity = {"source": "pg19", "hub_id": cfg.hub_id, "revision": cfg.revision}
        tokenizer = source_tokenizer(cfg, lambda: document_texts(read(hub.files("train", "source")), cfg.text_column),
                                     identity)
    train = read(_seeded_order(hub.files("train", "source"), seed))
    if cfg.max_train_documents:
        train = train.limit(cfg.max_train_documents)
    return text_task(cfg, train, read(hub.files(cfg.val_split, "val_split")), tokenizer=tokenizer,
                     text_column=cfg.text_column, docs_per_batch=BOOKS_PER_TASK,
                     params={"source": "pg19", "hub_id": cfg.hub_id, "val_split": cfg.val_split,
                             "read_from": "local copy" if hub.local else "hub"})


def _text_paths(path: str, field_name: str) -> tuple[list[str], str]:
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        files = sorted(
            os.path.join(d, f) for d, _, names in os.walk(path) for f in names if f.lower().endswith(TEXT_EXTENSIONS)
        )
    elif any(c in path for c in "*?["):
        files = sorted(glob.glob(path, recursive=True))
    else:
        files = [path] if os.path.isfile(path) else []
    if not files:
        raise UserError(f"dataset.{field_name}: no .txt, .jsonl or .parquet files at {path}")
    kinds = sorted({os.path.splitext(f)[1].lower() for f in files})
    if len(kinds) > 1 or kinds[0] not in TEXT_EXTENSIONS:
        raise UserError(f"dataset.{field_name}: expected one kind of .txt, .jsonl or .parquet files, "
                        f"found {', '.join(kinds)}")
    return files, kinds[0]


def _text_of_file(batch: dict) -> dict:
    return {"text": np.array([bytes(b).decode("utf-8", errors="replace") for b in batch["bytes"]], dtype=object)}


def _hash_side(batch: dict, column: str, seed: int, fraction: float, keep_val: bool) -> dict:
    keys = [(t if isinstance(t, str) else str(t)).encode("utf-8") for t in batch[column]]
    is_val = doc_hash_fraction(keys, seed) < fraction
    keep = is_val if keep_val else ~is_val
    return {name: values[keep] for name, values in batch.items()}


def _read_docs(files: list[str], kind: str, column: str):
    if kind == ".txt":
        return ray.data.read_binary_files(files).map_batches(_text_of_file, batch_format="numpy"), "text"
    if kind == ".jsonl":
        ds = ray.data.read_json(files, lines=True)
    else:
        ds = ray.data.read_parquet(files, columns=[column])
    return ds.select_columns([column]), column


def load_text_files(cfg: TextFilesConfig, seed: int) -> TaskData:
    """.txt: one document per file, split by a seeded permutation of the files; .jsonl/.parquet: one document per
    row, split by a seeded hash of the text (so the split streams); or the documents of val_path."""
    tokenizer = _early_tokenizer(cfg)
    files, kind = _text_paths(cfg.path, "path")
    if cfg.val_path:
        val_files, val_kind = _text_paths(cfg.val_path, "val_path")
        train_docs, column = _read_docs(_seeded_order(files, seed), kind, cfg.text_column)
        val_docs, _ = _read_docs(val_files, val_kind, cfg.text_column)
        in_order, _ = _read_docs(files, kind, cfg.text_column)
        split = "val_path"
    elif kind == ".txt":
        if len(files) < 2:
            raise UserError("dataset.path: a single .txt file cannot be split by document; add files or set val_path")
        order = np.random.default_rng(cfg.split_seed).permutation(len(files))
        num_val = max(1, int(round(cfg.val_fraction * len(files))))
        val_ids = set(order[:num_val].tolist())
        train_files = [f for i, f in enumerate(files) if i not in val_ids]
        val_files = [f for i, f in enumerate(files) if i in val_ids]
        train_docs, column = _read_docs(_seeded_order(train_files, seed), kind, cfg.text_column)
        val_docs, _ = _read_docs(val_files, kind, cfg.text_column)
        in_order, _ = _read_docs(train_files, kind, cfg.text_column)
        split = f"hold-out {num_val} of {len(files)} files"
    else:
        shuffled, column = _read_docs(_seeded_order(files, seed), kind, cfg.text_column)
        ordered, _ = _read_docs(files, kind, cfg.text_column)
        side = {"column": column, "seed": cfg.split_seed, "fraction": cfg.val_fraction}
        train_docs = shuffled.map_batches(_hash_side, fn_kwargs={**side, "keep_val": False}, batch_format="numpy")
        val_docs = ordered.map_batches(_hash_side, fn_kwargs={**side, "keep_val": True}, batch_format="numpy")
        in_order = ordered.map_batches(_hash_side, fn_kwargs={**side, "keep_val": False}, batch_format="numpy")
        split = f"hold-out {cfg.val_fraction} by document hash"
    if tokenizer is None:
        identity = {"source": "text_files", "files": [(f, os.path.getsize(f), os.path.getmtime(f)) for f in files],
                    "val_path": cfg.val_path, "split": split, "split_seed": cfg.split_seed}
        tokenizer = source_tokenizer(cfg, lambda: document_texts(in_order, column), identity)
    return text_task(
        cfg, train_docs, val_docs, tokenizer=tokenizer, text_column=column,
        params={"source": "text_files", "val_split": split},
    )
