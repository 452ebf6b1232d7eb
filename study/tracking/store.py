"""The MLflow store: whether it answers, the study's experiment in it, and the credentials a tracking URI may carry
(masked wherever a URI is printed or kept)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

from mlflow.tracking import MlflowClient

from study.data.hub import probe_url
from study.errors import UserError
from study.folder import local_store

# The MLflow UI opens an experiment in the layout its kind names: model training, not GenAI.
EXPERIMENT_KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
# How MLflow clients authenticate (https://mlflow.org/docs/latest/auth): handed to the Train workers in memory.
MLFLOW_CREDENTIAL_VARIABLES = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                               "MLFLOW_TRACKING_INSECURE_TLS", "MLFLOW_TRACKING_SERVER_CERT_PATH")
_CREDENTIALS = re.compile(r"(\w+://)[^/\s@]+@")
# Once a call to a tracking server has failed, each later one first checks that the server accepts a connection
# within this long: a server that is away then costs a refused connection, not a call's retries and back-off.
SERVER_PROBE_S = 2.0


def server_answers(tracking_uri: str) -> bool:
    """Whether an http(s) tracking server accepts a connection within SERVER_PROBE_S (any other store: True)."""
    url = urlparse(tracking_uri)
    if url.scheme not in ("http", "https") or not url.hostname:
        return True
    return probe_url(tracking_uri, timeout=SERVER_PROBE_S)[0]


def check_store(tracking_uri: str, name: str, *, must_be_new: bool) -> str | None:
    """Read only: the id of the study's experiment if the store has it, None if not yet. Raises UserError if the
    store cannot be used (unreachable, unknown scheme) or, for a new study, if an experiment of that name already
    holds runs (of another study)."""
    try:
        client = MlflowClient(tracking_uri)
        experiment = client.get_experiment_by_name(name)
        has_runs = bool(experiment is not None and client.search_runs([experiment.experiment_id], max_results=1))
    except Exception as exc:  # noqa: BLE001 - any failure here means the store is unusable
        raise UserError(f"--tracking-uri {redact(tracking_uri)}: cannot use the MLflow store "
                        f"({short_error(exc)})") from None
    if experiment is None:
        return None
    if experiment.lifecycle_stage == "deleted":
        raise UserError(f"--name {name}: an MLflow experiment of that name is deleted but still in the store; "
                        "pick another --name")
    if must_be_new and has_runs:
        raise UserError(
            f"--name {name}: the MLflow store {redact(tracking_uri)} already has an experiment {name!r} with runs; "
            "pick another --name (or --resume the study that owns it)"
        )
    return experiment.experiment_id


def ensure_experiment(tracking_uri: str, name: str, artifact_location: str | None, *, must_be_new: bool) -> str:
    """The experiment's id, created if needed and marked as model training (same errors as `check_store`)."""
    experiment_id = check_store(tracking_uri, name, must_be_new=must_be_new)
    try:
        client = MlflowClient(tracking_uri)
        if experiment_id is None:
            experiment_id = client.create_experiment(name, artifact_location=artifact_location)
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
        return experiment_id
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"--tracking-uri {redact(tracking_uri)}: cannot use the MLflow store "
                        f"({short_error(exc)})") from None


def open_experiment(tracking_uri: str | None, folder: Path, name: str, *, must_be_new: bool) -> tuple[str, str]:
    """(tracking URI, experiment id): experiment `name` on the tracking server `tracking_uri`, or, for None, in the
    embedded default (a SQLite store and its artifacts in `folder`, which must exist); created if needed."""
    if tracking_uri:
        return tracking_uri, ensure_experiment(tracking_uri, name, None, must_be_new=must_be_new)
    uri, artifacts = local_store(folder)
    return uri, ensure_experiment(uri, name, artifacts, must_be_new=False)


def redact(text: str) -> str:
    """`text` with the password (and user) of any URL in it masked: what may be printed or stored."""
    return _CREDENTIALS.sub(r"\1***@", text)


def without_credentials(uri: str) -> str:
    """The tracking URI as study.json keeps it: no user or password (pass them again, or through the
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD variables)."""
    return _CREDENTIALS.sub(r"\1", uri)


def credentials_to_environment(uri: str) -> str:
    """The URI without the basic-auth user and password written into it (http://user:password@host), which go to this
    process's MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD instead (MLflow's client reads them at each call):
    MLflow's own warnings quote the URL they failed on, and a Train worker's output reaches the driver's and
    `ray job logs`."""
    parsed = urlparse(uri)
    if parsed.username is None:
        return uri
    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(parsed.username)
    os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(parsed.password or "")
    return without_credentials(uri)


def short_error(exc: Exception) -> str:
    text = redact(" ".join(str(exc).split()))
    return f"{type(exc).__name__}: {text[:300]}"
