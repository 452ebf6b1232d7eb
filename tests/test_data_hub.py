"""Hub sources offline: fast, one clear line naming the offline alternatives; exit code 2 from the CLI; the token
stays out of configs."""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from data_fixtures import ray_local  # noqa: F401
from study.data import check_dataset, load_task_data, parse_dataset_config
from study.data.hub import MIRROR_ENV
from study.errors import UserError

ALTERNATIVES = "parquet (local shards), image_folder, text_files, digits, pydoc_text"


@pytest.mark.parametrize("dataset", [
    {"source": "hf", "name": "cifar100"},
    {"source": "hf", "name": "imagenet-1k"},
    {"source": "fineweb_edu", "tokenizer": "byte"},
    {"source": "wikitext103", "tokenizer": "byte"},
    {"source": "pg19", "tokenizer": "byte", "eval_contexts": [100_000]},
])
def test_hub_source_offline_fails_within_seconds_naming_the_alternatives(ray_local, monkeypatch, dataset):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    start = time.monotonic()
    with pytest.raises(UserError) as error:
        load_task_data(parse_dataset_config(dataset), seed=0)
    assert time.monotonic() - start < 5
    message = str(error.value)
    assert "\n" not in message and message.startswith("dataset.source: ") and ALTERNATIVES in message


def test_unreachable_hub_without_the_offline_flag_also_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    start = time.monotonic()
    with pytest.raises(UserError, match="not reachable.*127.0.0.1"):
        check_dataset(parse_dataset_config({"source": "hf", "name": "cifar10"}))
    assert time.monotonic() - start < 5


def test_wrong_names_and_missing_paths_are_one_line_user_errors():
    with pytest.raises(UserError, match="dataset.name: 'cifar1000' is not one of cifar10, cifar100, imagenet-1k"):
        check_dataset(parse_dataset_config({"source": "hf", "name": "cifar1000"}))
    with pytest.raises(UserError, match="dataset.path: /no/such/shards does not exist"):
        check_dataset(parse_dataset_config({"source": "parquet", "path": "/no/such/shards"}))


def test_hf_token_never_enters_the_config(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    cfg = parse_dataset_config({"source": "hf", "name": "imagenet-1k"})
    assert "hf_secret_value" not in repr(cfg.model_dump())
    with pytest.raises(UserError, match="dataset.token|Extra inputs|token"):
        parse_dataset_config({"source": "hf", "name": "imagenet-1k", "token": "x"})


def test_cli_exits_2_on_an_offline_hub_dataset_before_ray_starts(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(
        "name: offline_cifar\ntask: classification\ndataset: {source: hf, name: cifar100}\nmetric: val_acc\n"
        "mode: max\nepochs: 1\nnum_samples: 1\nfixed: {preset: vit_tiny, batch_size: 32}\n"
        "parameters:\n  lr: {type: log_float, low: 5.0e-4, high: 3.0e-3}\n"
    )
    ray_tmp = Path(tempfile.mkdtemp(prefix="lsh", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_TMPDIR": str(ray_tmp)}
    env.pop(MIRROR_ENV, None)
    cli = [sys.executable, "-c", "import sys; from study.cli import main; sys.exit(main())"]
    result = subprocess.run(cli + ["run", str(space), "--storage", str(tmp_path / "studies")], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("lapstudy: error:")]
    assert len(errors) == 1 and ALTERNATIVES in errors[0] and "Traceback" not in result.stderr
    started_ray = list(ray_tmp.iterdir())
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not started_ray, "the dataset is checked before Ray starts"
    assert not (tmp_path / "studies").exists()
