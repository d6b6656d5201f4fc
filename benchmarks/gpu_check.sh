#!/usr/bin/env bash
# The GPU checks in one batched run (a lent GPU machine; results under $OUT, or ./gpu_out):
# CUDA tests, then the decode-step benchmark (backends, CUDA graphs on/off), then the other
# model-executor tests on CUDA. Each stage has its own time limit so a slow one cannot starve the rest.
#   bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
PY=${PY:-python3}
{
  nvidia-smi -L
  $PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
} 2>&1 | tee "$OUT/env.log"
timeout "${T_TESTS:-170}" $PY -m pytest -q -p no:cacheprovider \
  tests/test_gpu_backends.py tests/test_model_gpu.py tests/test_sampler.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -30
timeout "${T_BENCH:-170}" $PY benchmarks/bench_gpu_decode.py ${BENCH_ARGS:-} --out "$OUT/decode.json" 2>&1 \
  | grep -v "^INFO\|Warning" | tee "$OUT/bench_decode.log"
timeout "${T_MODEL:-80}" $PY -m pytest -q -p no:cacheprovider tests/test_model_runner.py \
  tests/test_model_equivalence.py tests/test_model_loader.py 2>&1 | tee "$OUT/pytest_model.log" | tail -15
