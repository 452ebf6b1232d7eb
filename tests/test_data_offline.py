"""The two offline sources (digits, pydoc_text) through real Ray Data pipelines: shapes, dtypes, labels, split sizes,
packing, determinism."""

import numpy as np
import pytest
import torch

from data_fixtures import ray_local  # noqa: F401
from study.data import TaskData, load_task_data, parse_dataset_config
from study.data.offline import pydoc_documents
from study.errors import UserError


def _epoch(task_data, split="train", **kwargs):
    if split == "train":
        return list(task_data.train_batches(task_data.datasets["train"], device="cpu", **kwargs))
    return list(task_data.val_batches(task_data.datasets["val"], device="cpu", **kwargs))


def test_digits_shapes_labels_split_and_normalisation(ray_local):
    from sklearn.datasets import load_digits

    data = load_task_data(parse_dataset_config({"source": "digits"}), seed=0)
    assert (data.num_train, data.num_val) == (1437, 360)
    assert data.model_overrides == {"num_classes": 10, "image_size": 8, "in_chans": 1}
    train = _epoch(data, batch_size=64, epoch=0, seed=0)
    assert len(train) == 1437 // 64  # the last partial batch is dropped
    for batch in train:
        assert batch["image"].shape == (64, 1, 8, 8) and batch["image"].dtype == torch.float32
        assert batch["label"].dtype == torch.int64
    val = _epoch(data, "val", batch_size=100)
    val_labels = torch.cat([b["label"] for b in val])
    assert len(val_labels) == 360 and int(val_labels.min()) == 0 and int(val_labels.max()) == 9
    assert np.bincount(val_labels.numpy(), minlength=10).min() >= 35  # stratified: ~36 per class
    images = torch.cat([b["image"] for b in train])
    # normalised with the training split's statistics
    assert abs(float(images.mean())) < 0.05 and abs(float(images.std()) - 1) < 0.05
    # every validation image is a digits image, pixel for pixel (0..16 -> normalised), with its own label
    raw = load_digits()
    mean, std = data.batch_steps.mean[0], data.batch_steps.std[0]
    expected = {
        (np.round(img * 255 / 16).astype(np.uint8).tobytes()): int(y) for img, y in zip(raw.images, raw.target)
    }
    for batch in val:
        pixels = np.round((batch["image"].numpy()[:, 0] * std + mean) * 255).astype(np.uint8)
        for img, y in zip(pixels, batch["label"].tolist()):
            assert expected[img.tobytes()] == y


def test_digits_train_and_val_are_disjoint_and_split_is_fixed_by_split_seed(ray_local):
    def keys(data, split):
        batches = _epoch(data, split, batch_size=1437) if split == "val" else [
            b for b in data.val_batches(data.datasets["train"], batch_size=2000, device="cpu")
        ]
        return {b.numpy().tobytes() for batch in batches for b in batch["image"]}

    a = load_task_data(parse_dataset_config({"source": "digits"}), seed=0)
    b = load_task_data(parse_dataset_config({"source": "digits"}), seed=7)
    c = load_task_data(parse_dataset_config({"source": "digits", "split_seed": 1}), seed=0)
    assert keys(a, "val") == keys(b, "val")  # the trial seed does not move the split
    assert keys(a, "val") != keys(c, "val")
    assert not keys(a, "val") & keys(a, "train")


def test_digits_shuffle_is_seeded_per_epoch(ray_local):
    data = load_task_data(parse_dataset_config({"source": "digits"}), seed=0)
    labels = lambda **kw: torch.cat([b["label"] for b in _epoch(data, batch_size=32, **kw)])  # noqa: E731
    first = labels(epoch=0, seed=3)
    assert torch.equal(first, labels(epoch=0, seed=3))
    assert not torch.equal(first, labels(epoch=1, seed=3))
    assert not torch.equal(first, labels(epoch=0, seed=4))


def test_pydoc_text_packing_split_and_bytes(ray_local):
    cfg = parse_dataset_config({"source": "pydoc_text", "seq_len": 64})
    data = load_task_data(cfg, seed=0)
    assert data.model_overrides == {"vocab_size": 257, "context_length": 64}
    docs = pydoc_documents()
    total_tokens = sum(len(text.encode("utf-8")) + 1 for _, text in docs)  # one separator per document
    # no padding: the windows tile each split's token stream, at most one partial window lost per split
    assert data.num_train + data.num_val == pytest.approx(total_tokens / 64, abs=2)
    assert data.params["val_documents"] == round(0.1 * len(docs))  # 8 of CPython 3.11's 79 topics
    val = _epoch(data, "val", batch_size=50)
    assert sum(len(b["input_ids"]) for b in val) == data.num_val  # the last partial batch is kept
    for batch in val:
        ids, targets, nbytes = batch["input_ids"], batch["targets"], batch["target_bytes"]
        assert ids.dtype == targets.dtype == nbytes.dtype == torch.int64 and ids.shape[1] == 64
        assert torch.equal(ids[:, 1:], targets[:, :-1])  # targets are inputs shifted by one
        assert torch.equal(nbytes, (targets != 256).long())  # a byte is one byte, the separator none
        assert int(ids.max()) <= 256
    # consecutive validation windows continue each other: the stream is packed, not padded per document
    first, second = val[0]["input_ids"][0], val[0]["input_ids"][1]
    assert int(val[0]["targets"][0][-1]) == int(second[0]) and len(first) == 64
    text = bytes(t for t in torch.cat([b["input_ids"] for b in val]).flatten().tolist() if t != 256).decode()
    val_docs = [t for _, t in docs if t in text or t[:200] in text]
    assert len(val_docs) >= data.params["val_documents"] - 1  # held-out documents appear whole in the stream
    separators = int(sum((b["input_ids"] == 256).sum() for b in val))
    assert separators in (data.params["val_documents"] - 1, data.params["val_documents"])


def test_pydoc_text_is_deterministic_for_a_seed(ray_local):
    cfg = parse_dataset_config({"source": "pydoc_text", "seq_len": 32})
    data = load_task_data(cfg, seed=0)
    run = lambda **kw: torch.cat([b["input_ids"] for b in _epoch(data, batch_size=16, **kw)])  # noqa: E731
    assert torch.equal(run(epoch=2, seed=1), run(epoch=2, seed=1))
    assert not torch.equal(run(epoch=2, seed=1), run(epoch=3, seed=1))


def test_task_data_pickles_without_datasets(ray_local):
    import pickle

    data = load_task_data(parse_dataset_config({"source": "digits"}), seed=0)
    copy = pickle.loads(pickle.dumps(data))
    assert isinstance(copy, TaskData) and copy.datasets == {} and copy.model_overrides == data.model_overrides


def test_digits_splits_run_once_only_when_training_starts(ray_local):
    """Loading reads nothing (the study driver's pre-flight wants the sizes only); `materialize`, which a trainer
    calls, runs the splits whose epochs are all the same once (the augmented training split stays a pipeline)."""
    from ray.data.dataset import MaterializedDataset

    plain = load_task_data(parse_dataset_config({"source": "digits"}), seed=0)
    augmented = load_task_data(parse_dataset_config({"source": "digits", "augment": "basic"}),
                               seed=0)
    assert (plain.deterministic, augmented.deterministic) == (("val", "train"), ("val",))
    assert not any(isinstance(ds, MaterializedDataset) for ds in plain.datasets.values())
    before = _epoch(plain, "val", batch_size=2000)
    plain.materialize()
    augmented.materialize()
    assert all(isinstance(plain.datasets[name], MaterializedDataset) for name in ("val", "train"))
    assert isinstance(augmented.datasets["val"], MaterializedDataset)
    assert not isinstance(augmented.datasets["train"], MaterializedDataset)
    assert plain.deterministic == () and plain.datasets["val"].count() == 360
    after = _epoch(plain, "val", batch_size=2000)
    assert torch.equal(before[0]["image"], after[0]["image"])


def test_bad_fields_are_user_errors():
    with pytest.raises(UserError, match="dataset.source: 'mnist' is not one of digits, pydoc_text, hf"):
        parse_dataset_config({"source": "mnist"})
    with pytest.raises(UserError, match="dataset.seq_len"):
        parse_dataset_config({"source": "pydoc_text", "seq_len": 1})
    with pytest.raises(UserError, match="dataset.augment"):
        parse_dataset_config({"source": "digits", "augment": "strong"})
