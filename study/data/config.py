"""Dataset configs: one pydantic model per source, a discriminated union on `source`.

The search-space schema embeds `DatasetConfig` as its `dataset:` field. Every field here is a plain value that can go
into MLflow params and exported configs: nothing secret lives in a config (gated hub datasets read `HF_TOKEN` from the
environment when the data is opened, see `hub.py`).

Split rule shared by all sources: `split_seed` fixes the train/validation split and is independent of the trial seed,
so every trial of a study is scored on the same validation rows; the trial seed only drives shuffling and augmentation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, ValidationInfo, field_validator, model_serializer, model_validator

from study.data.nanochat_bpe import NANOCHAT_DOC_CAP, NANOCHAT_MAX_CHARS, NANOCHAT_VOCAB_SIZE
from study.data.spelling import WORD_LIST_PATH, WORD_LIST_URL
from study.schema import StrictModel

AugmentLevel = Literal["none", "basic", "three_augment", "dino_multicrop"]
# The fields that name files or folders: relative ones are read from the folder of the space or config that says so.
PATH_FIELDS = ("path", "val_path", "local_dir", "tokenizer_file")
TokenizerName = Literal["gpt2", "nanochat", "byte", "auto"]

# What a source gives; a task names the kind it reads (`Task.data_kind`).
IMAGES, TEXT = "images", "text"
SEGMENTATION = "segmentation"  # images with a per-pixel class mask each
TRANSLATION = "translation"  # sentence pairs (source, target)


class _ReadFields(StrictModel):
    """A config some of whose fields only some settings read: what its records hold is the fields it reads, and a
    field it does not read, set to other than its default, is refused naming the settings that would read it."""

    def read_when(self) -> dict[str, tuple[bool, str | None]]:
        """The fields read under some settings only (their loader's code path): field -> (whether these settings
        read it, the settings that would, in words; None where none would). Every other field is always read."""
        return {}

    def read_fields(self) -> frozenset[str]:
        """The fields a run of this config reads: what its records hold (trial YAML, export, MLflow's dataset)."""
        return frozenset(name for name in type(self).model_fields if self.read_when().get(name, (True,))[0])

    @model_serializer(mode="wrap")
    def _dump_read_fields(self, handler):
        # An unread field is at its default (a set one is refused below): validating the dump gives this config back.
        read = self.read_fields()
        return {name: value for name, value in handler(self).items() if name in read}

    @model_validator(mode="after")
    def _set_fields_are_read(self):
        # A field at its default changes nothing, so a dump that holds every field (older exports) still loads.
        for name, (read, readers) in sorted(self.read_when().items()):
            default = type(self).model_fields[name].default
            if read or name not in self.model_fields_set or getattr(self, name) == default:
                continue
            raise ValueError(f"{name}: is read only with {readers}; leave it out" if readers else
                             f"{name}: is not read by {self.described()}; leave it out")
        return self

    def described(self) -> str:
        return type(self).__name__


class _Source(_ReadFields):
    split_seed: int = Field(0, description="seed of the train/validation hold-out split (not the trial seed)")

    def described(self) -> str:
        return f"source {self.source}"

    def relative_to(self, base: Path):
        """This config with its relative paths (and `~`) made absolute, relative ones taken from `base`."""
        paths = {name: getattr(self, name, None) for name in PATH_FIELDS}
        resolved = {name: os.path.join(base, os.path.expanduser(value)) for name, value in paths.items() if value}
        return self.model_copy(update=resolved)


class _ImageSource(_Source):
    """Options every image source shares: the DeiT-III style training recipe and the evaluation transform."""

    kind: ClassVar[str] = IMAGES
    image_size: int | None = Field(None, ge=4, description="side of the square images fed to the model "
                                   "(None: the source's)")
    augment: AugmentLevel = Field(
        "basic",
        description="none: resize + centre crop as in evaluation; basic: random resized crop + horizontal flip; "
        "three_augment: basic + one of grayscale/solarize/blur + colour jitter (DeiT III); dino_multicrop: DINO's "
        "2 global and `local_crops` local views of each image (self-supervised tasks; the source then also gives "
        "its training images as evaluated, the k-NN bank)",
    )
    local_crops: int = Field(8, ge=0, description="dino_multicrop: local views per image (main_dino.py: 8)")
    local_size: int = Field(96, ge=4, description="dino_multicrop: side of the local views (global: image_size)")
    global_crop_scale: tuple[float, float] = Field((0.4, 1.0), description="dino_multicrop: area range of the "
                                                   "global views (main_dino.py:118)")
    local_crop_scale: tuple[float, float] = Field((0.05, 0.4), description="dino_multicrop: area range of the "
                                                  "local views (main_dino.py:124)")
    crop_scale: tuple[float, float] = Field((0.08, 1.0), description="area range of the random resized crop")
    crop_ratio: tuple[float, float] = Field((3 / 4, 4 / 3), description="aspect-ratio range of the random resized crop")
    hflip: bool = Field(True, description="random horizontal flip in basic/three_augment")
    color_jitter: float = Field(0.3, ge=0.0, le=1.0, description="three_augment: brightness, contrast and saturation "
                                "factors uniform in [1 - jitter, 1 + jitter], in a random order per image "
                                "(DeiT III: 0.3)")
    mixup: float = Field(0.0, ge=0.0, description="Mixup Beta(alpha, alpha) parameter; 0 turns Mixup off")
    cutmix: float = Field(0.0, ge=0.0, description="CutMix Beta(alpha, alpha) parameter; 0 turns CutMix off")
    mix_prob: float = Field(1.0, ge=0.0, le=1.0, description="probability that a batch is mixed at all")
    switch_prob: float = Field(0.5, ge=0.0, le=1.0, description="probability of CutMix over Mixup when both are on")
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0, description="label smoothing of the soft targets")
    eval_crop_pct: float | None = Field(
        None, gt=0.0, le=1.0, description="evaluation: resize the short side to image_size / crop_pct (bicubic), "
        "centre crop (None: the source's; DeiT III evaluates at 1.0)"
    )
    mean: tuple[float, ...] | None = Field(None, description="per-channel normalisation mean (None: the source's)")
    std: tuple[float, ...] | None = Field(None, description="per-channel normalisation std (None: the source's)")
    shuffle_buffer: int = Field(4096, ge=1, description="rows in each worker's seeded local shuffle buffer")
    repeated_aug: int = Field(
        1, ge=1, description="repeated augmentation (DeiT's --repeated-aug, its RASampler: 3): each epoch a random "
        "1/r of the training images, each r times with augmentations of its own, the copies next to each other in the "
        "batches, so an epoch stays as long; 1: off")

    def read_when(self) -> dict[str, tuple[bool, str | None]]:
        """build.image_task and images.py: the random resized crop and the flip are basic's and three_augment's
        (DINO's views draw their own), the colour jitter three_augment's, the views' settings dino_multicrop's;
        Mixup/CutMix and label smoothing are the batch mixer's, which passes multi-crop views through unmixed."""
        def augment(*levels: str) -> tuple[bool, str]:
            return self.augment in levels, f"augment: {' or '.join(levels)} (here {self.augment})"

        crop, multicrop = augment("basic", "three_augment"), augment("dino_multicrop")
        mixer = augment("none", "basic", "three_augment")
        here = f"(here mixup {self.mixup}, cutmix {self.cutmix})"
        # mix_prob decides whether a batch is mixed at all, switch_prob which of the two mixes it (images.BatchMixer)
        mixing = (self.mixup > 0 or self.cutmix > 0, f"mixup or cutmix > 0 {here}") if mixer[0] else mixer
        switching = (self.mixup > 0 and self.cutmix > 0, f"mixup and cutmix > 0 {here}") if mixer[0] else mixer
        return {"crop_scale": crop, "crop_ratio": crop, "hflip": crop, "repeated_aug": crop,
                "color_jitter": augment("three_augment"),
                **dict.fromkeys(("local_crops", "local_size", "global_crop_scale", "local_crop_scale"), multicrop),
                "mixup": mixer, "cutmix": mixer, "label_smoothing": mixer, "mix_prob": mixing, "switch_prob": switching}

    @model_validator(mode="after")
    def _check_ranges(self):
        return _check_crop_and_normalisation(self)


def _check_crop_and_normalisation(cfg):
    """The random resized crop's ranges and the normalisation of an image source (classification or segmentation)."""
    for name in ("crop_scale", "crop_ratio"):
        low, high = getattr(cfg, name)
        if not 0 < low <= high:
            raise ValueError(f"{name} must be [low, high] with 0 < low <= high, got [{low}, {high}]")
    if cfg.crop_scale[1] > 1:
        raise ValueError(f"crop_scale must lie in (0, 1], got {list(cfg.crop_scale)}")
    if (cfg.mean is None) != (cfg.std is None):
        raise ValueError("mean and std must be given together")
    if cfg.std is not None and (len(cfg.std) != len(cfg.mean) or min(cfg.std) <= 0):
        raise ValueError("std must have one positive value per mean value")
    return cfg


def _hold_out(cfg) -> dict[str, tuple[bool, str | None]]:
    """A source with a val_path reads its validation split from there; without, a seeded hold-out makes it."""
    held_out = (cfg.val_path is None, f"no val_path (here {cfg.val_path})")
    return {"split_seed": held_out, "val_fraction": held_out}


class BPETraining(StrictModel):
    """How `tokenizer: nanochat` trains its BPE (scripts/tok_train.py's arguments, speedrun.sh's max_chars)."""

    vocab_size: int = Field(NANOCHAT_VOCAB_SIZE, ge=256 + 9,  # the 256 bytes and the 9 special tokens at least
                            description="tokens, nanochat's 9 special tokens included (nanochat: 2**16 = 65536)")
    max_chars: int = Field(NANOCHAT_MAX_CHARS, ge=1, description="training characters read, at most (speedrun.sh: 2B)")
    doc_cap: int = Field(NANOCHAT_DOC_CAP, ge=1, description="characters of each document read, at most (10,000)")


class _TextSource(_Source):
    kind: ClassVar[str] = TEXT
    seq_len: int = Field(1024, ge=2, description="tokens per training sequence (the model's context_length)")
    tokenizer: TokenizerName = Field(
        "auto", description="gpt2: GPT-2 BPE via tiktoken (cache or tokenizer_file); nanochat: nanochat's BPE, "
        "trained on the training documents (`bpe`) and cached, or read from tokenizer_file; byte: UTF-8 bytes; "
        "auto: gpt2 else byte"
    )
    tokenizer_file: str | None = Field(
        None, description="gpt2: a .tiktoken ranks file, or a folder with vocab.bpe and encoder.json; nanochat: a "
        ".tiktoken ranks file of the merges (a trained BPE, as cached)"
    )
    bpe: BPETraining = Field(BPETraining(), description="tokenizer: nanochat: how its BPE is trained")
    shuffle_buffer: int = Field(1024, ge=1, description="sequences in each worker's seeded local shuffle buffer")
    chat_tokens: bool = Field(False, description="the vocabulary also holds nanochat's chat special tokens (ids after "
                                                 "end-of-text): pre-training for later chat stages")
    eval_contexts: tuple[int, ...] = Field(
        (), description="also evaluate perplexity at these context lengths (tokens), longer or shorter than seq_len: "
                        "each validation document alone in sliding windows of each length (eval_stride), logged "
                        "per token and per word as val_ppl_token_ctx<length> and val_ppl_word_ctx<length>")
    eval_stride: int | None = Field(
        None, ge=1, description="eval_contexts: windows after a document's first score their last eval_stride "
                                "targets, so every target sees its whole document before it or at least "
                                "length - eval_stride + 1 tokens; at most the shortest context (None: half of "
                                "each length)")

    def model_keys(self) -> dict:
        """The model keys this source fixes that are known before its data is read (a trained nanochat BPE has
        bpe.vocab_size tokens; GPT-2's and bytes' counts are fixed; a GPT-2 file's is only known once read)."""
        from study.data.text import BYTE_VOCAB, CHAT_SPECIAL_TOKENS, GPT2_MERGES

        known = {"context_length": self.seq_len}
        extra = len(CHAT_SPECIAL_TOKENS) if self.chat_tokens else 1
        if self.tokenizer == "nanochat":
            known["vocab_size"] = self.bpe.vocab_size
        elif self.tokenizer == "byte":
            known["vocab_size"] = BYTE_VOCAB - 1 + extra
        elif self.tokenizer == "gpt2" and not self.tokenizer_file:
            known["vocab_size"] = GPT2_MERGES + extra
        return known

    def read_when(self) -> dict[str, tuple[bool, str | None]]:
        """text.source_tokenizer and resolve_tokenizer: `bpe` trains nanochat's BPE, bytes need no file;
        build.text_task: eval_stride strides the windows of eval_contexts."""
        return {"bpe": (self.tokenizer == "nanochat", f"tokenizer: nanochat (here {self.tokenizer})"),
                "tokenizer_file": (self.tokenizer != "byte", "tokenizer: gpt2, nanochat or auto (here byte)"),
                "eval_stride": (bool(self.eval_contexts), "eval_contexts (here none)")}

    @field_validator("eval_contexts")
    @classmethod
    def _distinct_lengths(cls, lengths: tuple[int, ...]) -> tuple[int, ...]:
        if any(length < 2 for length in lengths) or len(set(lengths)) != len(lengths):
            raise ValueError(f"distinct context lengths of at least 2 tokens, got {list(lengths)}")
        return tuple(sorted(lengths))

    @field_validator("eval_stride")
    @classmethod
    def _stride_fits_every_context(cls, stride: int | None, info: ValidationInfo) -> int | None:
        contexts = info.data.get("eval_contexts") or ()
        if stride is not None and contexts and stride > contexts[0]:
            raise ValueError(f"at most the shortest of eval_contexts ({contexts[0]}), got {stride}")
        return stride

    def context_stride(self, length: int) -> int:
        """The stride of the windows at a length of eval_contexts: eval_stride, or half the length."""
        return self.eval_stride or length // 2


class DigitsConfig(_ImageSource):
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes): ships with scikit-learn, works offline."""

    source: Literal["digits"]
    augment: AugmentLevel = Field(
        "none", description="training augmentation (none, basic, three_augment, dino_multicrop)"
    )
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="stratified seeded hold-out fraction")


class PydocTextConfig(_TextSource):
    """The English documentation of CPython's `pydoc_data.topics`, one document per topic: works offline."""

    source: Literal["pydoc_text"]
    seq_len: int = Field(128, ge=2, description="tokens per training sequence (the model's context_length)")
    tokenizer: TokenizerName = Field("byte", description="gpt2, byte, or auto (gpt2 if found, else byte)")
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="seeded hold-out fraction of the documents")


@dataclass(frozen=True)
class HubPreset:
    """A hub image dataset known by a short name: where it lives, its columns, splits and sizes, its statistics."""

    hub_id: str
    image_column: str
    label_column: str
    num_classes: int
    val_split: str
    image_size: int
    num_train: int
    num_val: int
    crop_pct: float = 1.0
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None


# The catalogue of hub image datasets `source: hf` knows by name (any other is named by its hub id).
HUB_PRESETS = {
    "cifar10": HubPreset("uoft-cs/cifar10", "img", "label", 10, "test", 32, 50_000, 10_000,
                         mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616)),
    "cifar100": HubPreset("uoft-cs/cifar100", "img", "fine_label", 100, "test", 32, 50_000, 10_000,
                          mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762)),
    "imagenet-1k": HubPreset("ILSVRC/imagenet-1k", "image", "label", 1000, "validation", 224, 1_281_167, 50_000,
                             crop_pct=0.875),
}


class HubImageConfig(_ImageSource):
    """An image-classification dataset on the Hugging Face hub, streamed from its parquet files."""

    source: Literal["hf"]
    name: str = Field(description=f"{', '.join(HUB_PRESETS)}, or any hub id 'owner/name' (then set the columns)")
    config_name: str | None = Field(None, description="the hub dataset's configuration (subset) name")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    local_dir: str | None = Field(
        None, description="a local copy of the hub repository (its parquet files): read instead of the hub"
    )
    train_split: str = Field("train", description="the dataset's training split")
    val_split: str | None = Field(None, description="the dataset's own validation split (None: the preset's)")
    val_fraction: float | None = Field(
        None, gt=0.0, lt=1.0, description="hold out this seeded fraction of train_split instead of using val_split"
    )
    image_column: str | None = Field(None, description="column of encoded images (None: the preset's, else image)")
    label_column: str | None = Field(None, description="column of integer labels (None: the preset's, else label)")
    num_classes: int | None = Field(None, ge=2, description="None: the preset's, else 1 + the largest label")

    @field_validator("name")
    @classmethod
    def _known_or_hub_id(cls, name: str) -> str:
        if name not in HUB_PRESETS and "/" not in name:
            raise ValueError(f"{name!r} is not one of {', '.join(HUB_PRESETS)} nor a hub id 'owner/name'")
        return name

    def read_when(self) -> dict[str, tuple[bool, str | None]]:
        """image_sources.load_hub_images: val_fraction holds out part of train_split instead of val_split."""
        held_out = self.val_fraction is not None
        return {**super().read_when(), "split_seed": (held_out, f"val_fraction (here {self.val_fraction})"),
                "val_split": (not held_out, f"no val_fraction (here {self.val_fraction})")}

    @property
    def preset(self) -> HubPreset | None:
        return HUB_PRESETS.get(self.name)

    @property
    def hub_id(self) -> str:
        return self.preset.hub_id if self.preset else self.name


class ParquetImageConfig(_ImageSource):
    """Local parquet shards with an encoded-image column and an integer label column."""

    source: Literal["parquet"]
    path: str = Field(description="a parquet file, a folder of shards, or a glob")
    val_path: str | None = Field(None, description="parquet of the validation split (else a seeded hold-out)")
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="hold-out fraction when val_path is not set")
    image_column: str = Field("image", description="column of encoded images")
    label_column: str = Field("label", description="column of integer labels")
    num_classes: int | None = Field(None, ge=2, description="None: 1 + the largest label in the data")
    in_chans: Literal[1, 3] | None = Field(None, description="None: from the first image (L -> 1, else 3)")

    def read_when(self) -> dict[str, tuple[bool, str | None]]:
        return {**super().read_when(), **_hold_out(self)}


class ImageFolderConfig(_ImageSource):
    """A folder of class sub-folders, `root/<class>/<image file>`; classes are the sorted sub-folder names."""

    source: Literal["image_folder"]
    path: str = Field(description="the folder of class sub-folders")
    val_path: str | None = Field(None, description="a folder with the same class sub-folders (else a seeded hold-out)")
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="hold-out fraction when val_path is not set")
    extensions: tuple[str, ...] = Field(
        (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"), description="file endings read as images"
    )
    in_chans: Literal[1, 3] | None = Field(None, description="None: from the first image (L -> 1, else 3)")

    def read_when(self) -> dict[str, tuple[bool, str | None]]:
        return {**super().read_when(), **_hold_out(self)}


class _HubTextSource(_TextSource):
    """Text streamed from a hub repository's parquet files, or from a local copy of it."""

    hub_id: str = Field(description="the hub repository (owner/name)")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    local_dir: str | None = Field(None, description="a local copy of the hub repository: read instead of the hub")
    tokenizer: TokenizerName = Field("gpt2", description="gpt2, byte, or auto (gpt2 if found, else byte)")
    text_column: str = Field("text", description="column of the documents' text")

    def read_when(self) -> dict[str, tuple[bool, str | None]]:
        """The hub's own splits: nothing is held out."""
        return {**super().read_when(), "split_seed": (False, None)}


class FineWebEduConfig(_HubTextSource):
    """FineWeb-Edu streamed from the hub's parquet files of one named sample."""

    source: Literal["fineweb_edu"]
    hub_id: str = Field("HuggingFaceFW/fineweb-edu", description="the hub repository (owner/name)")
    sample: str = Field("sample-10BT", description="the hub configuration: sample-10BT, sample-100BT, sample-350BT, "
                        "default")
    val_documents: int = Field(
        10_000, ge=1, description="validation documents, taken from the sample's last parquet file (never trained on)"
    )
    max_train_documents: int | None = Field(None, ge=1, description="cap on training documents "
                                            "(None: the whole sample)")


class WikiText103Config(_HubTextSource):
    """WikiText-103 (raw), the long-context benchmark: the hub's rows are lines; articles (from one level-1 heading
    to the next) are the documents, trained on and evaluated as the benchmark's splits give them."""

    source: Literal["wikitext103"]
    hub_id: str = Field("Salesforce/wikitext", description="the hub repository (owner/name)")
    config_name: str = Field("wikitext-103-raw-v1", description="the hub configuration (raw: untokenised text)")
    val_split: Literal["validation", "test"] = Field("validation", description="the split evaluated on")


class PG19Config(_HubTextSource):
    """PG-19 (Project Gutenberg books before 1919), one book per row: the long-context benchmark at 100k tokens."""

    source: Literal["pg19"]
    hub_id: str = Field("emozilla/pg19", description="a parquet copy of deepmind/pg19 (whose own repository is a "
                                                     "loading script, which cannot be streamed)")
    val_split: Literal["validation", "test"] = Field("validation", description="the split evaluated on")
    max_train_documents: int | None = Field(None, ge=1, description="cap on training books (None: all 28,602)")


class TextFilesConfig(_TextSource):
    """Local text: .txt files (one document each), .jsonl or .parquet (one document per row in text_column)."""

    source: Literal["text_files"]
    path: str = Field(description="a file, a folder, or a glob of .txt / .jsonl / .parquet files")
    val_path: str | None = Field(
        None, description="text files of the validation split (else a seeded hold-out of documents)"
    )
    val_fraction: float = Field(0.05, gt=0.0, lt=1.0, description="seeded hold-out fraction of the documents")
    text_column: str = Field("text", description="column of the text (parquet and JSONL files)")

    def read_when(self) -> dict[str, tuple[bool, str | None]]:
        return {**super().read_when(), **_hold_out(self)}


class _SegmentationSource(_Source):
    """Images with per-pixel class masks: the same crop and flip move image and mask together (the mask resampled
    nearest-neighbour); batches carry "image" (float, normalised) and "mask" (int64, 255 where unlabelled)."""

    kind: ClassVar[str] = SEGMENTATION
    augment: Literal["none", "basic"] = Field(
        "basic", description="none: the evaluation transform; basic: random resized crop + horizontal flip"
    )
    # mmseg's ADE20K pipeline resizes by 0.5-2x and crops 512 of the 512-short-side image: crops of ~0.2-1 of its area
    crop_scale: tuple[float, float] = Field((0.25, 1.0), description="area range of the random resized crop")
    crop_ratio: tuple[float, float] = Field((3 / 4, 4 / 3), description="aspect-ratio range of the random resized crop")
    hflip: bool = Field(True, description="random horizontal flip in basic")
    mean: tuple[float, ...] | None = Field(None, description="per-channel normalisation mean (None: ImageNet's)")
    std: tuple[float, ...] | None = Field(None, description="per-channel normalisation std (None: ImageNet's)")
    shuffle_buffer: int = Field(1024, ge=1, description="rows in each worker's seeded local shuffle buffer")

    def read_when(self) -> dict[str, tuple[bool, str | None]]:
        """segmentation.segmentation_task: the crop and flip are basic's (none trains on the evaluation transform)."""
        return dict.fromkeys(("crop_scale", "crop_ratio", "hflip"),
                             (self.augment == "basic", f"augment: basic (here {self.augment})"))

    @model_validator(mode="after")
    def _check_ranges(self):
        return _check_crop_and_normalisation(self)


class ADE20KConfig(_SegmentationSource):
    """ADE20K's SceneParse150 benchmark (20 210 training, 2 000 validation images, 150 classes) from the parquet files
    of a hub repository, or of a local copy of it."""

    source: Literal["ade20k"]
    # The benchmark's own hub repository (MIT CSAIL's SceneParse150). Its main branch holds a loading script, which
    # `datasets` no longer runs; the hub's parquet converter keeps its parquet files on refs/convert/parquet, one
    # folder per configuration and split: scene_parsing/{train,validation,test}/NNNN.parquet.
    hub_id: str = Field("zhoubolei/scene_parse_150", description="the hub repository (owner/name)")
    revision: str | None = Field("refs/convert/parquet", description="hub revision (branch, tag or commit)")
    split_files: str = Field(
        "scene_parsing/{split}/*.parquet", description="glob of a split's parquet files in the repository, {split} "
        "standing for the split's name"
    )
    local_dir: str | None = Field(
        None, description="a local copy of the hub repository (its parquet files): read instead of the hub"
    )
    train_split: str = Field("train", description="the dataset's training split")
    val_split: str = Field("validation", description="the split evaluated on")
    image_column: str = Field("image", description="encoded images (the hub's {bytes, path} struct, or bytes)")
    mask_column: str = Field("annotation", description="encoded single-channel masks, one class index per pixel")
    num_classes: int = Field(150, ge=2, description="classes after reduce_zero_label")
    reduce_zero_label: bool = Field(
        True, description="mmseg's rule for ADE20K: 0 (other) becomes the ignore index 255, every other label k "
        "becomes k - 1"
    )
    image_size: int = Field(
        224, ge=4, description="side of the square crops fed to the model (DINO's ViT-S/16 is trained at 224)"
    )

    def read_when(self) -> dict[str, tuple[bool, str | None]]:
        """The benchmark's own splits: nothing is held out."""
        return {**super().read_when(), "split_seed": (False, None)}

    @field_validator("split_files")
    @classmethod
    def _check_split_files(cls, value: str) -> str:
        if "{split}" not in value:
            raise ValueError(f"must contain {{split}} (where the split's name goes), got {value!r}")
        return value


class ShapesSegmentationConfig(_SegmentationSource):
    """Generated offline from split_seed: discs, squares and triangles on a textured background, with their masks
    (0 background, 1 disc, 2 square, 3 triangle); images 0..num_train-1 train, the next num_val validation."""

    source: Literal["shapes_segmentation"]
    image_size: int = Field(64, ge=8, description="side of the generated square images (and of the model input)")
    num_train: int = Field(2000, ge=1, description="training images generated")
    num_val: int = Field(500, ge=1, description="validation images generated")
    shapes_per_image: tuple[int, int] = Field((1, 4), description="[fewest, most] shapes drawn in an image")
    palette: Literal["random", "by_class"] = Field(
        "random", description="random: any colour for any shape; by_class: red discs, green squares, blue triangles "
        "on a grey background (a task a colour alone solves)"
    )

    @model_validator(mode="after")
    def _check_shapes(self):
        low, high = self.shapes_per_image
        if not 0 <= low <= high:
            raise ValueError(f"shapes_per_image must be [low, high] with 0 <= low <= high, got [{low}, {high}]")
        return self


class _TranslationSource(_Source):
    """Sentence pairs with one shared byte-level BPE vocabulary trained on the training split's two sides
    (study/data/translation.py); batches carry src, tgt_in, tgt_out."""

    kind: ClassVar[str] = TRANSLATION
    vocab_size: int = Field(8000, ge=300, description="entries of the shared BPE vocabulary (specials and the 256 "
                                                      "byte symbols included)")
    tokenizer_file: str | None = Field(None, description="a `tokenizers` JSON file to use instead of training the BPE "
                                                         "(ids 0-3 must be <pad> <s> </s> <unk>)")
    max_tokens: int = Field(256, ge=4, description="training pairs with a side longer than this (EOS included) are "
                                                   "left out (fairseq's max-positions filter); validation pairs never")
    shuffle_buffer: int = Field(4096, ge=1, description="pairs in each worker's seeded local shuffle buffer")

    def read_when(self) -> dict[str, tuple[bool, str | None]]:
        """translation_sources._vocabulary: a tokenizer_file is read instead of training the BPE."""
        return {"vocab_size": (self.tokenizer_file is None, "no tokenizer_file (the BPE trained)")}


class ToyTranslationConfig(_TranslationSource):
    """A generated language pair (offline): SVO source with number-marked nouns, SOV target whose verb agrees with a
    subject several phrases away (study/data/translation.py `ToyLanguage`); the lexicon and the pairs follow
    split_seed."""

    source: Literal["toy_translation"]
    vocab_size: int = Field(640, ge=300, description="about one token per word of the toy pair")
    max_tokens: int = Field(128, ge=4, description="longest sentence, in tokens")
    num_train: int = Field(4000, ge=1, description="training pairs generated")
    num_val: int = Field(200, ge=1, description="validation pairs (sources also in the training pairs are redrawn)")
    max_modifiers: int = Field(4, ge=0, description="prepositional phrases between subject and verb, at most")
    max_adjectives: int = Field(2, ge=0, description="adjectives per noun phrase, at most")


class WMT14Config(_TranslationSource):
    """WMT14 (wmt/wmt14 on the hub, one config per language pair) from its parquet files, or a local copy of the
    repository; `translation` holds {source_lang: ..., target_lang: ...} per row."""

    source: Literal["wmt14"]
    hub_id: str = Field("wmt/wmt14", description="the hub repository (owner/name)")
    config_name: str = Field("de-en", description="the hub configuration (language pair)")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    local_dir: str | None = Field(None, description="a local copy of the hub repository: read instead of the hub")
    source_lang: str = Field("en", description="language translated from")
    target_lang: str = Field("de", description="language translated into")
    vocab_size: int = Field(37000, ge=300, description="Transformer-base's shared English-German BPE: 37 000")
    val_split: str = Field("validation", description="validation (newstest2013, chosen on) or test (newstest2014, "
                                                     "the paper's table)")
    tokenizer_pairs: int = Field(1_000_000, ge=1, description="training pairs the BPE is learnt on (the first ones)")
    max_train_pairs: int | None = Field(None, ge=1, description="cap on training pairs (None: all 4.5M)")

    def read_when(self) -> dict[str, tuple[bool, str | None]]:
        """load_wmt14: the BPE's training pairs with the BPE; the split is the hub's own."""
        trained = super().read_when()["vocab_size"]
        return {"vocab_size": trained, "tokenizer_pairs": trained, "split_seed": (False, None)}


# Conversation sets (study/data/chat_sources.py): nanochat's mid-training and SFT data, local JSONL, or generated.
SPELLING_PARTS = ("spelling_bee", "simple_spelling")
CHAT_HUB_PARTS = {  # name: (hub id, hub configuration, default training split)
    "smoltalk": ("HuggingFaceTB/smol-smoltalk", None, "train"),
    "mmlu_auxiliary_train": ("cais/mmlu", "auxiliary_train", "train"),
    "mmlu": ("cais/mmlu", "all", "test"),
    "gsm8k": ("openai/gsm8k", "main", "train"),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "train"),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "train"),
}


class ChatPart(_ReadFields):
    """One set of conversations in a chat mixture: a hub dataset nanochat trains on (tasks/*.py), local JSONL, or one of
    nanochat's spelling tasks generated from a word list (study/data/spelling.py)."""

    name: Literal["smoltalk", "mmlu_auxiliary_train", "mmlu", "gsm8k", "arc_easy", "arc_challenge", "jsonl",
                  "spelling_bee", "simple_spelling"] = Field(
        description="a hub dataset nanochat trains on, jsonl (a local file: `path`), or a spelling task")
    split: str | None = Field(None, description="hub split (None: the part's training split); spelling parts: train "
                                                "or test")
    path: str | None = Field(None, description="jsonl: a file of conversations, one per line: a list of "
                                               "{role, content} messages (nanochat's CustomJSON) or {messages: [...]}; "
                                               "spelling parts: the word list, one word per line (default: "
                                               "nanochat's, fetched from `url` when missing)")
    url: str | None = Field(None, description="jsonl and spelling parts: where `path` is fetched from, once, when it "
                                              "is missing (nanochat's identity conversations, its word list)")
    size: int | None = Field(None, ge=1, description="spelling parts: rows generated (nanochat's size=)")
    local_dir: str | None = Field(None, description="a local copy of the hub repository: read instead of the hub")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    stop: int | None = Field(None, ge=1, description="only the first rows (chat_sft: SmolTalk stop=10_000)")
    repeat: int = Field(1, ge=1, description="times the part enters the mixture (nanochat lists a part twice)")

    @model_validator(mode="before")
    @classmethod
    def _default_word_list(cls, data):
        """Spelling parts read nanochat's word list where nanochat keeps it, fetched from where nanochat fetches it."""
        if isinstance(data, dict) and data.get("name") in SPELLING_PARTS and data.get("path") is None:
            data = {**data, "path": WORD_LIST_PATH, "url": data.get("url") or WORD_LIST_URL}
        return data

    def read_when(self) -> dict[str, tuple[bool, str | None]]:
        """study/data/chat_sources.py: a hub part reads its split, revision and local copy; jsonl and spelling parts
        read a file (fetched from `url`); spelling parts their split (train or test) and size too."""
        hub, spelling = self.name in CHAT_HUB_PARTS, self.name in SPELLING_PARTS

        def names(*names) -> str:
            return f"name: {', '.join(names)} (here {self.name})"

        return {"local_dir": (hub, names(*CHAT_HUB_PARTS)), "revision": (hub, names(*CHAT_HUB_PARTS)),
                "split": (hub or spelling, names(*CHAT_HUB_PARTS, *SPELLING_PARTS)),
                "path": (not hub, names("jsonl", *SPELLING_PARTS)), "url": (not hub, names("jsonl", *SPELLING_PARTS)),
                "size": (spelling, names(*SPELLING_PARTS))}

    @model_validator(mode="after")
    def _check_fields(self):
        if self.name == "jsonl" and self.path is None:
            raise ValueError("path is for name: jsonl, which needs it")
        if self.name in SPELLING_PARTS and self.size is None:
            raise ValueError(f"size is for name: {', '.join(SPELLING_PARTS)}, which need it")
        if self.name in SPELLING_PARTS and self.split not in (None, "train", "test"):
            raise ValueError(f"split: {self.name} has train and test, got {self.split!r}")
        return self

    @property
    def hub(self) -> tuple[str, str | None, str] | None:
        return CHAT_HUB_PARTS.get(self.name)


class ChatConfig(_TextSource):
    """Conversations rendered with nanochat's chat template and special tokens (its render_conversation), mixed from
    parts and shuffled with split_seed (nanochat's TaskMixture). loss_on: assistant: one conversation per row,
    padded, targets only on the assistant's tokens (chat_sft); all: conversations packed into windows, every token a
    target (mid_train)."""

    source: Literal["chat"]
    train: list[ChatPart] = Field(min_length=1, description="the training mixture")
    val: list[ChatPart] = Field(min_length=1, description="the validation mixture")
    loss_on: Literal["assistant", "all"] = Field("assistant", description="assistant: SFT's mask; all: mid-training")
    chat_tokens: Literal[True] = Field(
        True, description="always true: the vocabulary holds nanochat's chat special tokens"
    )

    def model_keys(self) -> dict:
        """With nanochat's tokenizer and no file, the BPE (so the vocabulary) is the stage before's."""
        known = super().model_keys()
        if self.tokenizer == "nanochat" and not self.tokenizer_file:
            known.pop("vocab_size")
        return known

    def read_when(self) -> dict[str, tuple[bool, str | None]]:
        """chat_sources.load_chat: no BPE is trained (tokenizer: nanochat reads the pre-training's, or
        tokenizer_file), and the conversations are not evaluated in long-context windows."""
        return {**super().read_when(), **dict.fromkeys(("bpe", "eval_contexts", "eval_stride"), (False, None))}

    def relative_to(self, base: Path):
        def part(p: ChatPart) -> ChatPart:
            return p.model_copy(update={name: os.path.join(base, os.path.expanduser(value))
                                        for name in ("path", "local_dir") if (value := getattr(p, name))})
        return self.model_copy(update={"train": [part(p) for p in self.train], "val": [part(p) for p in self.val]})


SOURCE_CONFIGS = (DigitsConfig, PydocTextConfig, HubImageConfig, ParquetImageConfig, ImageFolderConfig,
                  FineWebEduConfig, WikiText103Config, PG19Config, TextFilesConfig, ADE20KConfig,
                  ShapesSegmentationConfig, ToyTranslationConfig, WMT14Config, ChatConfig)
DatasetConfig = Annotated[Union[SOURCE_CONFIGS], Field(discriminator="source")]
