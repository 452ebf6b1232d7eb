"""A study submitted as a Ray job, as docs/cluster.md submits one (`ray job submit --runtime-env-json ... -- lapstudy
run ...`), through Ray's job API on a local cluster of its own. Ray used to refuse the driver's runtime environment
beside the job's when both set a variable (the documented HF_TOKEN): the study runs, and the token is in none of its
output."""

from __future__ import annotations

import time

import pytest

from fault_fixtures import tiny_space
from study_fixtures import LAPSTUDY, ray_address, tune_trials, write_yaml  # noqa: F401

pytestmark = pytest.mark.slow(seconds=35)

TOKEN = "hf_jobToken0123456789"
JOB_TIMEOUT_S = 600
AGENT_WAIT_S = 60


def test_a_ray_job_whose_runtime_environment_sets_hf_token_runs_a_study(ray_address, tmp_path):  # noqa: F811
    import ray
    from ray.job_submission import JobStatus, JobSubmissionClient

    write_yaml(tmp_path / "job.yaml", tiny_space(name="job", epochs=1, num_samples=1,
                                                 points_to_evaluate=[{"lr": 1.0e-3, "k": 2}]))
    client = JobSubmissionClient(f"http://{ray._private.worker.get_dashboard_url()}")
    job = _submit_when_an_agent_answers(
        client,
        # $RAY_ADDRESS: the cluster's address, which Ray sets for every job's entrypoint.
        entrypoint=f"cd {tmp_path} && {LAPSTUDY} run job.yaml --storage studies --address $RAY_ADDRESS",
        runtime_env={"env_vars": {"HF_TOKEN": TOKEN, "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1"}})
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (status := client.get_job_status(job)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        if time.monotonic() > deadline:
            client.stop_job(job)
            pytest.fail(f"the job did not end in {JOB_TIMEOUT_S} s; its log:\n{client.get_job_logs(job)[-3000:]}")
        time.sleep(2)
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    assert "1 completed" in logs and TOKEN not in logs, logs[-3000:]
    [(_, rows)] = tune_trials(tmp_path / "studies" / "job").items()
    assert rows[-1]["epoch"] == 1


def _submit_when_an_agent_answers(client, **job) -> str:
    """Submit `job`; on a cluster just started, the node's job agent may not have registered yet (Ray answers "No
    available agent to submit job, please try again later"): try again, as Ray asks, for up to a minute."""
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(2)
