#!/usr/bin/env bash
# The GPU checks in one call, for a session lent a GPU machine (no internet there; its python3 holds a CUDA build of
# torch and Triton, which is all `models/` needs):
#   1. the model and kernel tests on the GPU: Triton kernels compiled for real, not through the interpreter, and the
#      sm_90 compile check of every launch variant (skipped, saying why, if this Triton lacks what it needs);
#   2. bench/stlt.py --device cuda (Triton against SDPA at 4k-32k tokens) and bench/attention.py on the GPU;
#   3. bench/d20.py: the paper's d20 at context 2048 in bf16, one training step without Laplacian heads, with the
#      paper's ramp and with STLT mixers: tokens/s and peak memory;
#   4. where the project's study stack is installed (Ray, MLflow, pydantic, Optuna: a cluster's GPU node, `make
#      setup`; the lent machine has none of them, and Ray's wheel alone is over what a call may carry), one short
#      epoch of search_spaces/gpu_check.yaml through `lapstudy run`: the d20 with the ramp and its STLT twin, bf16,
#      a one-GPU Ray Train worker per trial, MLflow's store in $OUT.
# Everything goes to $OUT (the device tool brings it back) or ./gpu_check; a failing step does not stop the others.
#
#   bash bench/gpu_check.sh          # about 6 minutes on an H200 (and 2 more for the study)
set -u -o pipefail
out=${OUT:-gpu_check}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0

step() {  # step NAME COMMAND...: run it, its output into $out/NAME.log, and say how it ended
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log"
    local code=$?
    echo "== $name: exit $code"
    [ "$code" -eq 0 ] || status=1
}

step environment python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
step tests python3 -m pytest -q -p no:cacheprovider tests/test_stlt_triton.py tests/test_stlt_op.py \
    tests/test_stlt_mixer.py tests/test_attention.py tests/test_models.py tests/test_geometry.py
step compile_stlt python3 -m pytest -q -p no:cacheprovider tests/test_stlt_compile.py
step bench_stlt sh -c "python3 bench/stlt.py --device cuda > '$out/bench_stlt_cuda.json'"
step bench_attention sh -c "python3 bench/attention.py --device cuda > '$out/bench_attention_cuda.json'"
step bench_d20 sh -c "python3 bench/d20.py --device cuda > '$out/bench_d20_cuda.json'"
if python3 -c "import ray, mlflow, pydantic, optuna" 2>/dev/null; then
    step study python3 -m study.cli run search_spaces/gpu_check.yaml --storage "$out/studies" \
        --gpus-per-worker 1 --cpus-per-worker 4
else
    echo "== study: skipped: Ray, MLflow, pydantic or Optuna missing here (install the project: make setup)"
fi
exit $status
