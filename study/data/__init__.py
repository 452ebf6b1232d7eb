"""Ray Data streams for the studies: one adapter per source, all behind `load_task_data`.

    from study.data import DatasetConfig, TaskData, load_task_data

Sources (the `source` field of a search space's `dataset:`): digits and pydoc_text ship offline; hf (CIFAR-10/100,
ImageNet-1k or any hub id), parquet and image_folder are image classification; fineweb_edu, wikitext103, pg19 and
text_files are language modelling; toy_translation (offline) and wmt14 are sentence pairs (docs/translation.md). See docs/data.md.
"""

from study.data.config import DatasetConfig
from study.data.load import check_dataset, load_task_data, parse_dataset_config
from study.data.task_data import TaskData

__all__ = ["DatasetConfig", "TaskData", "check_dataset", "load_task_data", "parse_dataset_config"]
