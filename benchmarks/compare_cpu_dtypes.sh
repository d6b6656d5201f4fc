#!/usr/bin/env bash
# W1 and W2 through the HTTP server (32 concurrent chats x 64 tokens) on a CPU, for issue 49's
# comparison in one run: the bf16 HF folder of SmolLM2-135M-Instruct with --dtype bfloat16,
# float32 and auto; the default model (the bundled GGUF) with its defaults and float32; and
# transformers' batched generate of the same prompts in float32 and bfloat16.
#
#   benchmarks/compare_cpu_dtypes.sh [avx512|avx2] [LIMIT]
#
# avx2: this CPU as an AVX2 CPU sees it: the native kernels' AVX2 build (RADIXENGINE_CPU_ISA),
# oneDNN and ATen capped to AVX2 (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY), for transformers too.
# LIMIT: the first LIMIT requests of each workload (a smoke run). Results in bench_results/.
set -euo pipefail
cd "$(dirname "$0")/.."
ISA=${1:-avx512}
LIMIT=${2:-}
PY=${PYTHON:-python}
export PYTHONPATH=${PYTHONPATH:-$PWD}
if [ "$ISA" = avx2 ]; then
  export RADIXENGINE_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
elif [ "$ISA" != avx512 ]; then
  echo "usage: $0 [avx512|avx2] [LIMIT]" >&2
  exit 2
fi
WORKLOADS=${WORKLOADS_DIR:-../shared/workloads}  # W1, W2 (set WORKLOADS_DIR where they live elsewhere)
DATASET=$WORKLOADS/W1.jsonl,$WORKLOADS/W2.jsonl
OUT=bench_results/cpu_dtypes_$ISA
HF=${HF_BF16_FOLDER:-bench_results/smollm2_135m_bf16}
LIMIT_FLAG=()
[ -n "$LIMIT" ] && LIMIT_FLAG=(--limit "$LIMIT")
mkdir -p bench_results

if [ ! -f "$HF/config.json" ]; then  # the bundled GGUF, converted, saved in bf16
  "$PY" - "$HF" <<'PYEOF'
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from radixengine.model_loader import default_model_path, resolve_model_path
src, out = Path(resolve_model_path(default_model_path())), sys.argv[1]
AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(out)
AutoTokenizer.from_pretrained(src).save_pretrained(out)
for extra in src.glob("chat_template.jinja"):
    shutil.copy(extra, out)
PYEOF
fi

uptime
"$PY" benchmarks/bench_serving.py --server-flags "--model-path $HF" --dataset "$DATASET" "${LIMIT_FLAG[@]}" \
    --request-rates inf --max-concurrency 32 --dtypes bfloat16,float32,auto \
    --output "${OUT}_hf.json" --markdown
"$PY" benchmarks/bench_serving.py --dataset "$DATASET" "${LIMIT_FLAG[@]}" \
    --request-rates inf --max-concurrency 32 --dtypes auto,float32 \
    --output "${OUT}_default.json" --markdown
"$PY" benchmarks/bench_offline.py --model-path "$HF" --workloads W1,W2 --workloads-dir "$WORKLOADS" \
    "${LIMIT_FLAG[@]}" --policies "" --peers transformers --dtypes float32,bfloat16 \
    --output "${OUT}_transformers.json"
uptime
