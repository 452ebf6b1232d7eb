"""The two sources that ship with the installed packages and need no network: digits and pydoc_text."""

from __future__ import annotations

import hashlib

import numpy as np
import ray

from study.data.build import image_task, text_task
from study.data.config import DigitsConfig, PydocTextConfig
from study.data.task_data import TaskData
from study.data.text import source_tokenizer


def load_digits_task(cfg: DigitsConfig, seed: int) -> TaskData:
    """scikit-learn digits: 1797 8x8 grey images with values 0..16, scaled to 0..255 uint8; stratified seeded split
    (val_fraction 0.2 -> 1437 train / 360 val); normalised with the training split's pixel mean and std."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]  # N, 8, 8, 1
    labels = digits.target.astype(np.int64)
    index = np.arange(len(labels))
    train_idx, val_idx = train_test_split(
        index, test_size=cfg.val_fraction, random_state=cfg.split_seed, stratify=labels
    )
    train_idx, val_idx = np.sort(train_idx), np.sort(val_idx)
    pixels = images[train_idx].astype(np.float64) / 255.0
    rows = lambda idx: ray.data.from_items(  # noqa: E731
        [{"image": images[i], "label": int(labels[i])} for i in idx], override_num_blocks=4
    )
    return image_task(
        cfg,
        rows(train_idx),
        rows(val_idx),
        seed=seed,
        native_size=8,
        in_chans=1,
        num_classes=10,
        image_column="image",
        label_column="label",
        num_train=len(train_idx),
        num_val=len(val_idx),
        default_mean=(float(pixels.mean()),),
        default_std=(float(pixels.std()),),
        materialize=True,
        params={"source": "digits"},
    )


def pydoc_documents() -> list[tuple[str, str]]:
    """(topic, text) pairs of CPython's pydoc_data topics, sorted by topic (the text varies with the Python version)."""
    from pydoc_data.topics import topics

    return sorted(topics.items())


def load_pydoc_text_task(cfg: PydocTextConfig, seed: int) -> TaskData:
    """CPython's documentation topics as documents; a seeded split by document; packed on one block so that the
    sequence counts are exact."""
    docs = pydoc_documents()
    order = np.random.default_rng(cfg.split_seed).permutation(len(docs))
    num_val = max(1, int(round(cfg.val_fraction * len(docs))))
    val_ids, train_ids = sorted(order[:num_val]), sorted(order[num_val:])
    texts = [docs[i][1] for i in train_ids]
    identity = {"source": "pydoc_text", "text": hashlib.sha256("\0".join(texts).encode()).hexdigest()}
    tokenizer = source_tokenizer(cfg, lambda: texts, identity)
    rows = lambda ids: ray.data.from_items([{"text": docs[i][1]} for i in ids], override_num_blocks=1)  # noqa: E731
    return text_task(
        cfg,
        rows(train_ids),
        rows(val_ids),
        tokenizer=tokenizer,
        text_column="text",
        materialize=True,
        docs_per_batch=None,
        params={"source": "pydoc_text", "train_documents": len(train_ids), "val_documents": len(val_ids)},
    )
