"""Ray Data streams for the studies: one adapter per source, all behind `load_task_data`.

    from study.data import DatasetConfig, TaskData, load_task_data

Sources (the `source` field of a search space's `dataset:`): digits and pydoc_text ship offline; hf (CIFAR-10/100,
ImageNet-1k or any hub id), parquet and image_folder are image classification; fineweb_edu, wikitext103, pg19 and
text_files are language modelling; toy_translation (offline) and wmt14 are sentence pairs (docs/translation.md). See
docs/data.md.
"""

from importlib import import_module

__all__ = ["DatasetConfig", "TaskData", "check_dataset", "load_task_data", "parse_dataset_config"]
_HOMES = {"DatasetConfig": "study.data.config", "TaskData": "study.data.task_data", "check_dataset": "study.data.load",
          "load_task_data": "study.data.load", "parse_dataset_config": "study.data.load"}


def __getattr__(name: str):
    # Imported on first use: every Ray Data task imports this package on its way to the batch function it runs
    # (study.data.images, .text, ...), which needs numpy and PIL, not the loaders' torch, datasets and MLflow.
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
