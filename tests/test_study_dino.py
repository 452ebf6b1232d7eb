"""A DINO study through the `lapstudy` command line on a local Ray cluster: self-supervised pre-training of a tiny
ViT on digits, then a linear probe and a segmentation probe on the frozen teacher backbone as later stages of the
same trial. The k-NN accuracy of the trained teacher beats the same network's at initialisation (logged at step 0),
and the metrics, the patch-token spectrum and the pictures reach the trial's one MLflow run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from study_fixtures import metric_history, one_trial_study, ray_address  # noqa: F401

pytestmark = pytest.mark.slow(seconds=90)

SHIPPED = yaml.safe_load((Path(__file__).resolve().parents[1] / "search_spaces" / "dino_digits.yaml").read_text())
DINO, LINEAR, SEGMENTATION = 4, 2, 2
# Two local crops, not four, and short stages: the whole trial is one of the slower tests of CI.
SPACE = {**SHIPPED, "name": "dino", "epochs": DINO, "dataset": {**SHIPPED["dataset"], "local_crops": 2},
         "geometry": {"every": 2, "max_batches": 2, "pca_points": 200},
         "parameters": {"k": [2]},
         "stages": [{**SHIPPED["stages"][0], "epochs": LINEAR},
                    {**SHIPPED["stages"][1], "epochs": SEGMENTATION,
                     "dataset": {**SHIPPED["stages"][1]["dataset"], "num_train": 128, "num_val": 32}}]}


@pytest.fixture(scope="module")
def dino_study(tmp_path_factory, ray_address):
    return one_trial_study(tmp_path_factory.mktemp("dino"), SPACE, ray_address, timeout=900)


def history(study, key):
    return metric_history(study["uri"], study["run"].info.run_id, key)


def test_the_teachers_knn_accuracy_beats_its_own_at_initialisation(dino_study):
    knn = history(dino_study, "knn_acc")
    assert [step for step, _ in knn] == list(range(DINO + 1))  # step 0: the untrained network, on the same split
    at_init, trained = knn[0][1], knn[-1][1]
    assert trained > at_init, knn


def test_the_probes_ran_as_later_stages_on_the_frozen_backbone(dino_study):
    final = dino_study["rows"][-1]
    assert final["epoch"] == DINO + LINEAR + SEGMENTATION and final["stage"] == "segmentation"
    probe = history(dino_study, "linear/val_acc")
    assert [step for step, _ in probe] == list(range(DINO + 1, DINO + LINEAR + 1))
    miou = history(dino_study, "segmentation/val_miou")
    assert [step for step, _ in miou] == [DINO + LINEAR + 1, DINO + LINEAR + SEGMENTATION]
    assert 0 <= probe[-1][1] <= 1 and 0 < miou[-1][1] <= 1
    # Each head learns on its frozen features (at this scale the tiny backbone's class token barely varies with
    # the image, so the digits probe stays near chance: its loss, not its accuracy, shows the learning).
    for stage in ("linear", "segmentation"):
        loss = [value for _, value in history(dino_study, f"{stage}/val_loss")]
        assert loss[-1] < loss[0], (stage, loss)
    assert dino_study["run"].data.tags["lapstudy.status"] == "completed"


def test_geometry_spectrum_and_pictures_reach_mlflow(dino_study):
    from mlflow.tracking import MlflowClient

    for key in ("geom_pcs99_per_image", "geom_pcs99_patches", "geom_between_class_frac", "geom_l0_nc1",
                "segmentation/geom_pcs99_per_image", "segmentation/geom_between_class_frac"):
        assert history(dino_study, key), key
    steps = [step for step, _ in history(dino_study, "geom_pcs99_patches")]
    assert steps == [2, 4]
    client = MlflowClient(dino_study["uri"])
    run_id = dino_study["run"].info.run_id
    for folder in ("geometry", "segmentation/geometry"):
        names = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run_id, folder)}
        assert {"pca.png", "variance.png", "patch_pca.png"} <= names, (folder, names)
