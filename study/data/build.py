"""Turn raw Ray datasets (source rows) into a `TaskData`: the transform stages every source shares."""

from __future__ import annotations

import dataclasses

import ray

from study.data.epoch import EpochSource
from study.data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BatchMixer,
    ImageSpec,
    MultiCropSpec,
    multicrop_batch,
    transform_batch,
)
from study.data.task_data import TaskData, context_split
from study.data.text import Tokenizer, TokenTargets, document_windows, tokenize_and_pack
from study.errors import UserError

IMAGE_MAP_BATCH = 128  # rows per decode/augment task batch
# Output blocks of the decode tasks: small enough that a task streams its first rows out while it works on the rest
# (with Ray's 128 MiB default a task over a 50 000-image CIFAR shard emits nothing until it is done, which stalls
# the start of every epoch by seconds), large enough to keep per-block overhead low.
IMAGE_BLOCK_BYTES = 8 * 1024 * 1024
TEXT_MAP_BATCH = 256  # documents per tokenize/pack task batch


def image_task(
    cfg,
    train_rows: "ray.data.Dataset",
    val_rows: "ray.data.Dataset",
    *,
    seed: int,
    native_size: int,
    in_chans: int,
    num_classes: int,
    image_column: str,
    label_column: str,
    num_train: int | None,
    num_val: int | None,
    default_mean=None,
    default_std=None,
    default_crop_pct: float = 1.0,
    materialize: bool = False,
    params: dict | None = None,
) -> TaskData:
    """Decode + augment (train) and decode + resize + centre crop (val) inside Ray Data map_batches tasks.

    materialize: for small in-memory sources, run the deterministic stages once, before training
    (TaskData.materialize), instead of every epoch."""
    size = cfg.image_size or native_size
    spec = ImageSpec(
        image_size=size,
        in_chans=in_chans,
        augment=cfg.augment,
        crop_scale=tuple(cfg.crop_scale),
        crop_ratio=tuple(cfg.crop_ratio),
        hflip=cfg.hflip,
        color_jitter=cfg.color_jitter,
        eval_crop_pct=cfg.eval_crop_pct or default_crop_pct,
        image_column=image_column,
        label_column=label_column,
    )
    mean = cfg.mean or default_mean or (IMAGENET_MEAN if in_chans == 3 else (0.5,))
    std = cfg.std or default_std or (IMAGENET_STD if in_chans == 3 else (0.5,))
    if len(mean) != in_chans:
        raise UserError(f"dataset.mean/std: need {in_chans} values (one per channel), got {len(mean)}")
    random_train = cfg.augment != "none"
    clock = EpochSource() if random_train else None
    multicrop = cfg.augment == "dino_multicrop"
    views = MultiCropSpec(size, cfg.local_size, cfg.local_crops, tuple(cfg.global_crop_scale),
                          tuple(cfg.local_crop_scale)) if multicrop else None
    train = train_rows.map_batches(
        multicrop_batch if multicrop else transform_batch,
        fn_kwargs={"spec": spec, "train": True, "seed": seed, "epoch_clock": clock,
                   **({"views": views} if views else {"repeats": cfg.repeated_aug})},
        batch_size=IMAGE_MAP_BATCH,
        batch_format="numpy",
    )
    evaluated = {"val": val_rows}
    if multicrop:  # the training images as evaluated: the bank a k-NN evaluation votes with
        evaluated["bank"] = train_rows
    evaluated = {name: rows.map_batches(transform_batch, fn_kwargs={"spec": spec, "train": False},
                                        batch_size=IMAGE_MAP_BATCH, batch_format="numpy")
                 for name, rows in evaluated.items()}
    for ds in (train, *evaluated.values()):
        ds.context.target_max_block_size = IMAGE_BLOCK_BYTES
    batch_steps = BatchMixer(
        num_classes=num_classes,
        mean=tuple(mean),
        std=tuple(std),
        mixup=cfg.mixup,
        cutmix=cfg.cutmix,
        mix_prob=cfg.mix_prob,
        switch_prob=cfg.switch_prob,
        label_smoothing=cfg.label_smoothing,
        views=cfg.local_crops + 2 if multicrop else 0,
    )
    return TaskData(
        datasets={"train": train, **evaluated},
        model_overrides={"num_classes": num_classes, "image_size": size, "in_chans": in_chans},
        num_train=num_train,
        num_val=num_val,
        batch_steps=batch_steps,
        params={**(params or {}), "num_train": num_train, "num_val": num_val},
        shuffle_buffer=cfg.shuffle_buffer,
        epoch_clock=clock,
        repeats=cfg.repeated_aug,
        deterministic=(*evaluated, *(() if random_train else ("train",))) if materialize else (),
    )


def text_task(
    cfg,
    train_docs: "ray.data.Dataset",
    val_docs: "ray.data.Dataset",
    *,
    tokenizer: Tokenizer,
    text_column: str,
    num_train: int | None = None,
    num_val: int | None = None,
    materialize: bool = False,
    docs_per_batch: int | None = TEXT_MAP_BATCH,
    params: dict | None = None,
) -> TaskData:
    """Tokenise and pack documents into (seq_len + 1)-token windows inside Ray Data map_batches tasks, and the
    validation documents into their rolling windows at each length of `eval_contexts` (text.document_windows). With
    `chat_tokens` the vocabulary holds nanochat's chat special tokens too (a model pre-trained on it keeps its
    vocabulary in later chat stages)."""
    tokenizer = dataclasses.replace(tokenizer, chat=tokenizer.chat or cfg.chat_tokens)
    kwargs = {"tokenizer": tokenizer, "seq_len": cfg.seq_len, "text_column": text_column}
    train, val = (
        docs.map_batches(tokenize_and_pack, fn_kwargs=kwargs, batch_size=docs_per_batch, batch_format="numpy")
        for docs in (train_docs, val_docs)
    )
    # Each context length: every validation document alone in its rolling windows, made once (a validation split is
    # small, and every epoch reads it again).
    contexts = {context_split(length): val_docs.map_batches(
        document_windows, fn_kwargs={"tokenizer": tokenizer, "context": length, "stride": cfg.context_stride(length),
                                     "text_column": text_column},
        batch_size=docs_per_batch, batch_format="numpy"
    ).materialize() for length in cfg.eval_contexts}
    if materialize:
        train, val = train.materialize(), val.materialize()
        num_train, num_val = train.count(), val.count()
    return TaskData(
        datasets={"train": train, "val": val, **contexts},
        eval_batch_scale={context_split(length): min(1.0, cfg.seq_len / length) for length in cfg.eval_contexts},
        model_overrides={"vocab_size": tokenizer.vocab_size, "context_length": cfg.seq_len},
        num_train=num_train,
        num_val=num_val,
        batch_steps=TokenTargets(tokenizer.token_bytes()),
        params={**(params or {}), "tokenizer": tokenizer.name, "chat_tokens": tokenizer.chat, "num_train": num_train,
                "num_val": num_val, **({"tokenizer_file": tokenizer.file} if tokenizer.file else {}),
                **{f"eval_stride_ctx{length}": cfg.context_stride(length) for length in cfg.eval_contexts}},
        shuffle_buffer=cfg.shuffle_buffer,
        tokenizer=tokenizer,
    )
