"""Dataset configs: one pydantic model per source, a discriminated union on `source`.

The search-space schema embeds `DatasetConfig` as its `dataset:` field. Every field here is a plain value that can go
into MLflow params and exported configs: nothing secret lives in a config (gated hub datasets read `HF_TOKEN` from the
environment when the data is opened, see `hub.py`).

Split rule shared by all sources: `split_seed` fixes the train/validation split and is independent of the trial seed,
so every trial of a study is scored on the same validation rows; the trial seed only drives shuffling and augmentation.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

AugmentLevel = Literal["none", "basic", "three_augment"]
# The fields that name files or folders: relative ones are read from the folder of the space or config that says so.
PATH_FIELDS = ("path", "val_path", "local_dir", "tokenizer_file")
TokenizerName = Literal["gpt2", "byte", "auto"]

# What a source gives; a task names the kind it reads (`Task.data_kind`).
IMAGES, TEXT = "images", "text"


class _Source(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    split_seed: int = Field(0, description="seed of the train/validation hold-out split (not the trial seed)")

    def relative_to(self, base: Path):
        """This config with its relative paths (and `~`) made absolute, relative ones taken from `base`."""
        paths = {name: getattr(self, name, None) for name in PATH_FIELDS}
        resolved = {name: os.path.join(base, os.path.expanduser(value)) for name, value in paths.items() if value}
        return self.model_copy(update=resolved)


class _ImageSource(_Source):
    """Options every image source shares: the DeiT-III style training recipe and the evaluation transform."""

    kind: ClassVar[str] = IMAGES
    image_size: int | None = Field(None, ge=4, description="side of the square images fed to the model (None: the source's)")
    augment: AugmentLevel = Field(
        "basic",
        description="none: resize + centre crop as in evaluation; basic: random resized crop + horizontal flip; "
        "three_augment: basic + one of grayscale/solarize/blur + colour jitter (DeiT III)",
    )
    crop_scale: tuple[float, float] = Field((0.08, 1.0), description="area range of the random resized crop")
    crop_ratio: tuple[float, float] = Field((3 / 4, 4 / 3), description="aspect-ratio range of the random resized crop")
    hflip: bool = Field(True, description="random horizontal flip in basic/three_augment")
    color_jitter: float = Field(0.3, ge=0.0, le=1.0, description="three_augment: brightness, contrast and saturation "
                                "factors uniform in [1 - jitter, 1 + jitter], in a random order per image (DeiT III: 0.3)")
    mixup: float = Field(0.0, ge=0.0, description="Mixup Beta(alpha, alpha) parameter; 0 turns Mixup off")
    cutmix: float = Field(0.0, ge=0.0, description="CutMix Beta(alpha, alpha) parameter; 0 turns CutMix off")
    mix_prob: float = Field(1.0, ge=0.0, le=1.0, description="probability that a batch is mixed at all")
    switch_prob: float = Field(0.5, ge=0.0, le=1.0, description="probability of CutMix over Mixup when both are on")
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0, description="label smoothing of the soft targets")
    eval_crop_pct: float | None = Field(
        None, gt=0.0, le=1.0, description="evaluation: resize the short side to image_size / crop_pct (bicubic), centre "
        "crop (None: the source's; DeiT III evaluates at 1.0)"
    )
    mean: tuple[float, ...] | None = Field(None, description="per-channel normalisation mean (None: the source's)")
    std: tuple[float, ...] | None = Field(None, description="per-channel normalisation std (None: the source's)")
    shuffle_buffer: int = Field(4096, ge=1, description="rows in each worker's seeded local shuffle buffer")

    @model_validator(mode="after")
    def _check_ranges(self):
        for name in ("crop_scale", "crop_ratio"):
            low, high = getattr(self, name)
            if not 0 < low <= high:
                raise ValueError(f"{name} must be [low, high] with 0 < low <= high, got [{low}, {high}]")
        if self.crop_scale[1] > 1:
            raise ValueError(f"crop_scale must lie in (0, 1], got {list(self.crop_scale)}")
        if (self.mean is None) != (self.std is None):
            raise ValueError("mean and std must be given together")
        if self.std is not None and (len(self.std) != len(self.mean) or min(self.std) <= 0):
            raise ValueError("std must have one positive value per mean value")
        return self


class _TextSource(_Source):
    kind: ClassVar[str] = TEXT
    seq_len: int = Field(1024, ge=2, description="tokens per training sequence (the model's context_length)")
    tokenizer: TokenizerName = Field(
        "auto", description="gpt2: GPT-2 BPE via tiktoken (cache or tokenizer_file); byte: UTF-8 bytes; auto: gpt2 else byte"
    )
    tokenizer_file: str | None = Field(
        None, description="GPT-2 BPE file: a .tiktoken ranks file, or a folder with vocab.bpe and encoder.json"
    )
    shuffle_buffer: int = Field(1024, ge=1, description="sequences in each worker's seeded local shuffle buffer")


class DigitsConfig(_ImageSource):
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes): ships with scikit-learn, works offline."""

    source: Literal["digits"]
    augment: AugmentLevel = "none"
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="stratified seeded hold-out fraction")


class PydocTextConfig(_TextSource):
    """The English documentation of CPython's `pydoc_data.topics`, one document per topic: works offline."""

    source: Literal["pydoc_text"]
    seq_len: int = Field(128, ge=2)
    tokenizer: TokenizerName = "byte"
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="seeded hold-out fraction of the documents")


HubName = Literal["cifar10", "cifar100", "imagenet-1k"]


class HubImageConfig(_ImageSource):
    """An image-classification dataset on the Hugging Face hub, streamed from its parquet files."""

    source: Literal["hf"]
    name: str = Field(description="cifar10, cifar100, imagenet-1k, or any hub id 'owner/name' (then set the columns)")
    config_name: str | None = Field(None, description="the hub dataset's configuration (subset) name")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    local_dir: str | None = Field(
        None, description="a local copy of the hub repository (its parquet files): read instead of the hub"
    )
    train_split: str = "train"
    val_split: str | None = Field(None, description="the dataset's own validation split (None: the preset's)")
    val_fraction: float | None = Field(
        None, gt=0.0, lt=1.0, description="hold out this seeded fraction of train_split instead of using val_split"
    )
    image_column: str | None = None
    label_column: str | None = None
    num_classes: int | None = Field(None, ge=2)


class ParquetImageConfig(_ImageSource):
    """Local parquet shards with an encoded-image column and an integer label column."""

    source: Literal["parquet"]
    path: str = Field(description="a parquet file, a folder of shards, or a glob")
    val_path: str | None = Field(None, description="parquet of the validation split (else a seeded hold-out)")
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="hold-out fraction when val_path is not set")
    image_column: str = "image"
    label_column: str = "label"
    num_classes: int | None = Field(None, ge=2, description="None: 1 + the largest label in the data")
    in_chans: Literal[1, 3] | None = Field(None, description="None: from the first image (L -> 1, else 3)")


class ImageFolderConfig(_ImageSource):
    """A folder of class sub-folders, `root/<class>/<image file>`; classes are the sorted sub-folder names."""

    source: Literal["image_folder"]
    path: str
    val_path: str | None = Field(None, description="a folder with the same class sub-folders (else a seeded hold-out)")
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    extensions: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
    in_chans: Literal[1, 3] | None = None


class FineWebEduConfig(_TextSource):
    """FineWeb-Edu streamed from the hub's parquet files of one named sample."""

    source: Literal["fineweb_edu"]
    hub_id: str = "HuggingFaceFW/fineweb-edu"
    sample: str = Field("sample-10BT", description="the hub configuration: sample-10BT, sample-100BT, sample-350BT, default")
    revision: str | None = None
    local_dir: str | None = Field(None, description="a local copy of the hub repository: read instead of the hub")
    tokenizer: TokenizerName = "gpt2"
    text_column: str = "text"
    val_documents: int = Field(
        10_000, ge=1, description="validation documents, taken from the sample's last parquet file (never trained on)"
    )
    max_train_documents: int | None = Field(None, ge=1, description="cap on training documents (None: the whole sample)")


class TextFilesConfig(_TextSource):
    """Local text: .txt files (one document each), .jsonl or .parquet (one document per row in text_column)."""

    source: Literal["text_files"]
    path: str = Field(description="a file, a folder, or a glob of .txt / .jsonl / .parquet files")
    val_path: str | None = None
    val_fraction: float = Field(0.05, gt=0.0, lt=1.0, description="seeded hold-out fraction of the documents")
    text_column: str = "text"


SOURCE_CONFIGS = (DigitsConfig, PydocTextConfig, HubImageConfig, ParquetImageConfig, ImageFolderConfig,
                  FineWebEduConfig, TextFilesConfig)
DatasetConfig = Annotated[Union[SOURCE_CONFIGS], Field(discriminator="source")]
OFFLINE_SOURCES = "parquet (local shards), image_folder, text_files, digits, pydoc_text"
