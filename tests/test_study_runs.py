"""Studies through `lapstudy run` for what the main end-to-end study does not exercise: the CMA-ES sampler, an
STLT space, and the local data adapters (parquet shards, an image folder, text files) on data generated here,
offline. Each is small; each checks what the study recorded against what it was asked for, and that the model
learned from the data the adapter delivered."""

from __future__ import annotations

import io

import numpy as np
import pytest
import yaml
from PIL import Image

from study_fixtures import lapstudy, metric_history, mlflow_runs, ray_address, searcher_study, tune_trials, write_yaml  # noqa: F401

pytestmark = pytest.mark.slow(seconds=165)

CLASSES, SIDE, IMAGES = 4, 16, 240
TINY_VIT = {"preset": "vit_tiny_digits", "depth": 2, "patch_size": 4, "batch_size": 32, "warmup_epochs": 0.5}


def _study(root, address, space: dict, *flags) -> dict:
    write_yaml(root / f"{space['name']}.yaml", space)
    run = lapstudy("run", f"{space['name']}.yaml", "--storage", "studies", "--address", address,
                   "--max-concurrent", "1", *flags, cwd=root)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    study_dir = root / "studies" / space["name"]
    runs = mlflow_runs(f"sqlite:///{study_dir / 'mlflow.db'}", space["name"])
    return {"dir": study_dir, "trials": tune_trials(study_dir), "uri": f"sqlite:///{study_dir / 'mlflow.db'}",
            "runs": {r.data.tags["lapstudy.trial_id"]: r for r in runs}}


def _space(name: str, dataset: dict, **changes) -> dict:
    return {"name": name, "task": "classification", "dataset": dataset, "metric": "val_acc", "mode": "max",
            "epochs": 3, "seed": 0, "num_samples": 1, "early_stopping": "none", "geometry": {"max_batches": 1,
            "pca_points": 100}, "fixed": TINY_VIT, "parameters": {"lr": {"type": "log_float", "low": 1e-3,
            "high": 1e-2}}, "points_to_evaluate": [{"lr": 3e-3}], **changes}


def test_cmaes_sampler_proposes_the_trials_after_its_startup(tmp_path, ray_address):
    space = _space("cmaes", {"source": "digits"}, epochs=2, num_samples=3,
                   sampler={"kind": "cmaes", "n_startup_trials": 1}, points_to_evaluate=[],
                   parameters={"lr": {"type": "log_float", "low": 1e-3, "high": 1e-2},
                               "weight_decay": {"type": "float", "low": 0.0, "high": 0.1}})
    study = _study(tmp_path, ray_address, {**space, "fixed": {**TINY_VIT, "patch_size": 2}})
    assert len(study["trials"]) == 3 and all(rows[-1]["epoch"] == 2 for rows in study["trials"].values())
    optuna_study, by_tune_id = searcher_study(study["dir"])
    assert type(optuna_study.sampler).__name__ == "CmaEsSampler"
    generations = sorted((t.number, "cma:generation" in t.system_attrs) for t in optuna_study.trials)
    # the first trial is the independent start-up sample; CMA-ES proposes every one after it
    assert generations == [(0, False), (1, True), (2, True)], generations
    assert len(study["runs"]) == 3


def test_stlt_space_runs_as_a_study(tmp_path, ray_address):
    """The shipped STLT space, shortened: its attention baseline and its STLT warm-start point, each logging what
    an STLT layer reports per epoch."""
    from pathlib import Path

    shipped = yaml.safe_load((Path(__file__).parents[1] / "search_spaces" / "stlt_vit_digits.yaml").read_text())
    space = {**shipped, "epochs": 2, "num_samples": 2, "early_stopping": "none", "geometry": {"max_batches": 1}}
    study = _study(tmp_path, ray_address, space)
    assert len(study["trials"]) == 2
    by_mixer = {rows[0]["config"]["mixer"]: trial for trial, rows in study["trials"].items()}
    assert set(by_mixer) == {"attention", "stlt"}
    stlt, attention = study["runs"][by_mixer["stlt"]], study["runs"][by_mixer["attention"]]
    assert stlt.data.params["stlt_nodes"] == "16" and stlt.data.tags["lapstudy.status"] == "completed"
    for layer in range(4):
        s_eff = metric_history(study["uri"], stlt.info.run_id, f"stlt_s_eff_l{layer}")
        window = metric_history(study["uri"], stlt.info.run_id, f"stlt_T_l{layer}")
        assert [step for step, _ in s_eff] == [step for step, _ in window] == [1, 2]
        assert all(0 <= value <= 16 for _, value in s_eff) and all(value >= 4 for _, value in window)
    assert not any(key.startswith("stlt_") for key in attention.data.metrics)
    assert "stlt_nodes" not in attention.data.params


def _picture(label: int, index: int) -> Image.Image:
    """A 16x16 picture whose class is its colour (one channel bright per class, noise on top)."""
    rng = np.random.default_rng(1000 * label + index)
    pixels = rng.integers(0, 80, (SIDE, SIDE, 3), dtype=np.uint8)
    pixels[..., label % 3] += 150 if label < 3 else 0
    if label == 3:
        pixels += 150  # the fourth class: bright everywhere
    return Image.fromarray(pixels)


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _learned_from(study: dict, source: str, count: int | None) -> None:
    """The study's one trial read `source` (`count` images, where the source can count them before reading) and
    learned from it."""
    [(trial, rows)] = study["trials"].items()
    run = study["runs"][trial]
    assert run.data.params["data.source"] == source
    if count is not None:
        assert int(run.data.params["data.num_train"]) + int(run.data.params["data.num_val"]) == count
    assert rows[-1]["val_acc"] > 0.9, rows[-1]  # the colours separate the classes: the labels came with them


def test_parquet_adapter_through_lapstudy_run(tmp_path, ray_address):
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = tmp_path / "shards"
    shards.mkdir()
    labels = [i % CLASSES for i in range(IMAGES)]
    for part in range(2):
        rows = range(part * IMAGES // 2, (part + 1) * IMAGES // 2)
        pq.write_table(pa.table({"image": [_png(_picture(labels[i], i)) for i in rows],
                                 "label": [labels[i] for i in rows]}), shards / f"part-{part}.parquet")
    # A hold-out of streamed shards has no known length: the space says how many steps an epoch is.
    study = _study(tmp_path, ray_address, _space("parquet", {"source": "parquet", "path": "shards",
                                                             "val_fraction": 0.25, "augment": "none"},
                                                 epochs=4, fixed={**TINY_VIT, "steps_per_epoch": 5}))
    assert study["runs"][next(iter(study["trials"]))].data.params["data.val_split"] == "hold-out 0.25"
    _learned_from(study, "parquet", None)  # a hash hold-out of streamed shards: sizes known only once read


def test_image_folder_adapter_through_lapstudy_run(tmp_path, ray_address):
    for i in range(IMAGES):
        folder = tmp_path / "pictures" / f"class_{i % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        _picture(i % CLASSES, i).save(folder / f"{i}.png")
    study = _study(tmp_path, ray_address, _space("folder", {"source": "image_folder", "path": "pictures",
                                                            "val_fraction": 0.25, "augment": "none"}))
    _learned_from(study, "image_folder", IMAGES)


def test_text_files_adapter_through_lapstudy_run(tmp_path, ray_address):
    """Text in 20 words; a byte-level GPT trained two epochs on it predicts far better than the 8 bits per byte
    of a uniform guess."""
    words = "the cat sat on a mat while the dog ran after the ball into the garden near an old tree".split()
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"doc_{i:02d}.txt").write_text(" ".join(rng.choice(words, size=200)) + "\n")
    space = {"name": "text", "task": "language_modeling", "metric": "val_bpb", "mode": "min", "epochs": 2, "seed": 0,
             "num_samples": 1, "early_stopping": "none", "geometry": {"max_batches": 1, "top_targets": 8,
             "pca_points": 100},
             "dataset": {"source": "text_files", "path": "corpus", "seq_len": 64, "tokenizer": "byte",
                         "val_fraction": 0.2},
             "fixed": {"preset": "gpt_tiny", "depth": 2, "batch_size": 16, "steps_per_epoch": 30},
             "parameters": {"lr": {"type": "log_float", "low": 1e-3, "high": 1e-2}},
             "points_to_evaluate": [{"lr": 3e-3}]}
    study = _study(tmp_path, ray_address, space)
    [(trial, rows)] = study["trials"].items()
    run = study["runs"][trial]
    assert run.data.params["data.source"] == "text_files" and run.data.params["data.tokenizer"] == "byte"
    assert rows[-1]["val_bpb"] < 3.0, rows[-1]
