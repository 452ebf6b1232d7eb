"""`load_task_data`: the one entry point the study system calls on each trial driver."""

from __future__ import annotations

import os

import ray
from pydantic import TypeAdapter, ValidationError

from study.data.config import CLASSIFICATION, LANGUAGE_MODELING, SOURCES, DatasetConfig
from study.data.task_data import TaskData
from study.errors import UserError

TASKS = (CLASSIFICATION, LANGUAGE_MODELING)


def parse_dataset_config(value) -> DatasetConfig:
    """A DatasetConfig from a plain dict (YAML), with pydantic's errors as one UserError line."""
    try:
        return TypeAdapter(DatasetConfig).validate_python(value)
    except ValidationError as error:
        first = error.errors()[0]
        if first["type"] in ("union_tag_invalid", "union_tag_not_found"):
            got = value.get("source") if isinstance(value, dict) else None
            raise UserError(f"dataset.source: {got!r} is not one of {', '.join(SOURCES)}") from None
        loc = first["loc"][1:] if first["loc"] and first["loc"][0] in SOURCES else first["loc"]
        where = ".".join(str(p) for p in ("dataset", *loc))
        raise UserError(f"{where}: {first['msg']}") from None


def preflight(task: str, config: DatasetConfig) -> DatasetConfig:
    """The checks that need neither Ray nor data: the task fits the source, local paths exist, a hub source has a
    local copy or a reachable hub (a few seconds at most), a gpt2 tokenizer can be found. Call it before starting
    Ray so that a wrong or offline dataset fails at once; `load_task_data` runs it too."""
    if task not in TASKS:
        raise UserError(f"task: {task!r} is not one of {', '.join(TASKS)}")
    if isinstance(config, dict):
        config = parse_dataset_config(config)
    if config.task != task:
        raise UserError(
            f"dataset.source: {config.source} is a {config.task} source but the study's task is {task}; "
            f"{task} sources: {', '.join(_sources_for(task))}"
        )
    for field_name in ("path", "val_path", "local_dir", "tokenizer_file"):
        value = getattr(config, field_name, None)
        if value and not any(c in value for c in "*?[") and not os.path.exists(os.path.expanduser(value)):
            raise UserError(f"dataset.{field_name}: {value} does not exist")
    if config.source in ("hf", "fineweb_edu"):
        from study.data.hub import local_copy, require_hub

        hub_id = config.hub_id if config.source == "fineweb_edu" else _hub_id(config.name)
        if local_copy(hub_id, config.local_dir) is None:
            require_hub(config.source, hub_id)
    if getattr(config, "tokenizer", None) == "gpt2" and not config.tokenizer_file:
        from study.data.text import gpt2_available

        gpt2_available(raise_if_not=True)
    return config


def _hub_id(name: str) -> str:
    from study.data.image_sources import HUB_PRESETS

    preset = HUB_PRESETS.get(name)
    if preset is None and "/" not in name:
        raise UserError(f"dataset.name: {name!r} is not one of {', '.join(HUB_PRESETS)} nor a hub id 'owner/name'")
    return preset.hub_id if preset else name


def load_task_data(task: str, config: DatasetConfig, *, seed: int) -> TaskData:
    """Build the trial's Ray datasets lazily (nothing is read yet, except the two small offline sets).

    Also sets the driver's Ray Data execution order to deterministic (`preserve_order`), which Ray Train carries
    to the dataset shards of the trainer built afterwards on this driver."""
    config = preflight(task, config)
    if not ray.is_initialized():
        raise RuntimeError("load_task_data needs ray to be initialised (ray.init) on the trial driver")
    ray.data.DataContext.get_current().execution_options.preserve_order = True

    from study.data import offline

    if config.source == "digits":
        return offline.load_digits_task(config, seed)
    if config.source == "pydoc_text":
        return offline.load_pydoc_text_task(config, seed)
    from study.data import image_sources, text_sources

    loaders = {
        "hf": image_sources.load_hub_images,
        "parquet": image_sources.load_parquet_images,
        "image_folder": image_sources.load_image_folder,
        "fineweb_edu": text_sources.load_fineweb_edu,
        "text_files": text_sources.load_text_files,
    }
    return loaders[config.source](config, seed)


def _sources_for(task: str) -> list[str]:
    from study.data import config as cfg

    models = (cfg.DigitsConfig, cfg.PydocTextConfig, cfg.HubImageConfig, cfg.ParquetImageConfig,
              cfg.ImageFolderConfig, cfg.FineWebEduConfig, cfg.TextFilesConfig)
    return [m.model_fields["source"].annotation.__args__[0] for m in models if m.task == task]
