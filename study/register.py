"""`lapstudy export --register`: the best trial's trained model logged to its own MLflow run with a signature, and
registered in MLflow's model registry under the study's name, so that `mlflow.pytorch.load_model("models:/NAME/V")`
gives it back anywhere. The model's code (the `models` package) travels with it; its weights are the trial's last
checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

import models
from models.gpt import GPTConfig
from models.vit import ViTConfig
from study.errors import UserError
from study.evals.load import resolve_run, trained_model
from study.folder import StudyFolder
from study.runspec import load_run_spec
from study.tracking.store import redact, short_error

MODELS_PACKAGE = Path(models.__file__).resolve().parent
# torch.export fixes a dimension of size 1 in the graph: two examples leave the batch free, as the signature says.
EXAMPLE_BATCH = 2


def example_input(model: torch.nn.Module) -> torch.Tensor:
    """Inputs of the shape and type the model reads: images for a ViT, token ids of its full context for a GPT (the
    exported graph and the signature take that length)."""
    config = getattr(model, "config", None)
    if isinstance(config, ViTConfig):
        return torch.zeros(EXAMPLE_BATCH, config.in_chans, config.image_size, config.image_size)
    if isinstance(config, GPTConfig):
        return torch.zeros(EXAMPLE_BATCH, config.context_length, dtype=torch.long)  # the graph's sequence length
    raise UserError(f"--register: registers ViT classifiers and GPT language models; this study's model is a "
                    f"{type(model).__name__}")


def register_best(folder: StudyFolder, trial_id: str, run_id: str | None, tracking_uri: str, name: str):
    """Log trial `trial_id`'s trained model to its MLflow run `run_id` and register it as `name`; the registered
    model version."""
    import mlflow
    import mlflow.pytorch
    from mlflow.models import infer_signature

    if not run_id:
        raise UserError(f"--register: trial {trial_id} has no MLflow run to log its model to "
                        f"(`lapstudy sync {folder.location}` creates it)")
    config_path, state_path = resolve_run(folder.path / "train" / f"trial_{trial_id}")
    model = trained_model(load_run_spec(config_path), config_path, state_path)
    example = example_input(model)
    with torch.no_grad():
        output = model(example)
    signature = infer_signature(example.numpy(), output.numpy())
    try:
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_registry_uri(tracking_uri)
        with mlflow.start_run(run_id=run_id):
            # pt2: MLflow's default, a torch.export graph traced on the example (with the batch dimension left
            # free, as the signature says), which loads without unpickling code
            logged = mlflow.pytorch.log_model(model, name="model", signature=signature, input_example=example.numpy(),
                                              registered_model_name=name, code_paths=[str(MODELS_PACKAGE)],
                                              pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "numpy"])
        return mlflow.MlflowClient(tracking_uri).get_model_version(name, str(logged.registered_model_version))
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - the registry refused or the server is away: say so in one line
        raise UserError(f"--register: MLflow at {redact(tracking_uri)} could not register the model "
                        f"({short_error(exc)})") from None
