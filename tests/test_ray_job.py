"""A study submitted as a Ray job, as docs/cluster.md submits one (`ray job submit --runtime-env-json ... -- lapstudy
run ...`), through Ray's job API on a local cluster of its own. Ray used to refuse the driver's runtime environment
beside the job's when both set a variable (the documented HF_TOKEN): the study runs, and the token is in none of its
output.

The cluster is `simulated_cluster`'s, whose nodes' agents listen on free ports: an in-process `ray.init` gives its
agent Ray's fixed port 52365, which the other test worker's cluster may hold, and the job API (served by that
agent) then answers "No available agent to submit job" for as long as the test waits."""

from __future__ import annotations

import time

import pytest

from fault_fixtures import simulated_cluster, tiny_space, tune_results, write_space
from study_fixtures import LAPSTUDY

pytestmark = pytest.mark.slow(seconds=45)

TOKEN = "hf_jobToken0123456789"
JOB_TIMEOUT_S = 600


def test_a_ray_job_whose_runtime_environment_sets_hf_token_runs_a_study(tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    write_space(tmp_path / "job.yaml", tiny_space(name="job", epochs=1, num_samples=1,
                                                  points_to_evaluate=[{"lr": 1.0e-3, "k": 2}]))
    # A head with the dashboard and a worker node: the trial's Train worker needs a CPU of its own.
    with simulated_cluster("lsj", {}, {}) as cluster:
        client = JobSubmissionClient(f"http://{cluster.nodes[0].address_info['webui_url']}")
        job = client.submit_job(
            # $RAY_ADDRESS: the cluster's address, which Ray sets for every job's entrypoint.
            entrypoint=f"cd {tmp_path} && {LAPSTUDY} run job.yaml --storage studies --address $RAY_ADDRESS",
            runtime_env={"env_vars": {"HF_TOKEN": TOKEN, "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1"}})
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while (status := client.get_job_status(job)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED,
                                                               JobStatus.STOPPED}:
            if time.monotonic() > deadline:
                client.stop_job(job)
                pytest.fail(f"the job did not end in {JOB_TIMEOUT_S} s; its log:\n{client.get_job_logs(job)[-3000:]}")
            time.sleep(2)
        logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    assert "1 completed" in logs and TOKEN not in logs, logs[-3000:]
    [(_, rows)] = tune_results(tmp_path / "studies" / "job").items()
    assert rows[-1]["epoch"] == 1
