#!/usr/bin/env bash
# The GPU suite: everything this project measures on a GPU, in one command that fits one
# device call (10 minutes). Here first `bash scripts/gpu_wheels.sh` (wheels into .whl/), then
# the device tool's `run` with carry [".whl"] and the command `bash scripts/gpu_suite.sh`.
#
# Steps, in order, each under its own `timeout` and all inside one time budget (a step that
# fails or times out is recorded and the next one runs):
#   wheels        install .whl/*.whl into WORK/site (the GPU machine has no registry)
#   env           nvidia-smi, jax version and devices, and that jaxserve imports
#   pytest_gpu    python -m pytest -m "gpu or cuda_lowering" (GPU tests; every kernel variant
#                 lowered for CUDA by this jax)
#   kernel_bench  benchmarks/kernels/bench_paged_attention.py (HBM fraction of peak per case)
#   kv_transfer   benchmarks/bench_kv_transfer.py (KV connector copies, GB/s)
#   latency_bN    scripts/bench_latency.py, Llama-3-8B shape, dummy bf16 weights, batch 1 8 32
#   throughput_N  benchmarks/bench_throughput.py, the same model, 64 and 256 prompts
#   kernel_bench_mla  the kernel benchmark for DeepSeek-V3's latent attention (16 heads a rank)
#                 (order: latency_b1, throughput_256, kernel_bench_mla, latency_b8,
#                 latency_b32, throughput_64)
#   tune_kernel   benchmarks/kernels/tune_paged_attention.py (tile, split and mixed sweeps,
#                 most important first; last, in the time left; stops 30 s before its limit)
# All model runs share one engine configuration, so the first compiles and the rest read the
# persistent compilation cache.
#
# Output: OUT_DIR holds suite.log (every step's output, as it runs), gpu-<device>.md (the
# report: versions, commit, each step's status and key figures, rewritten after every step)
# and gpu-suite-logs.tar.gz (per-step logs and JSON); the report is also written to
# benchmarks/results/. OUT_DIR: --out DIR, else $OUT (the device tool's), else .gpu-suite/.
#
# Options:
#   --dry-run      every step in smoke mode on CPU (JAX_PLATFORMS=cpu, the kernel interpreted,
#                  a tiny dummy model, few iterations), no wheels; the report stays in OUT_DIR
#   --out DIR      where the log, report and tarball go
#   --work DIR     scratch (logs, JSON, installed wheels); default a fresh /tmp directory
#   --budget S     seconds for all steps (default 560, 300 with --dry-run); each step's
#                  limit is cut to what is left, and steps with nothing left are skipped
#   --steps A,B    run only these steps (names as above; prefixes work: latency,throughput)
# Environment: PYTHON (default python3; .venv/bin/python with --dry-run when present),
# GPU_SUITE_COMMIT (the commit to report when the copy has no .git).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

DRY_RUN=0
OUT_DIR=${OUT:-}
WORK=""
BUDGET=""
ONLY=""
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --out) OUT_DIR=$2; shift ;;
        --work) WORK=$2; shift ;;
        --budget) BUDGET=$2; shift ;;
        --steps) ONLY=$2; shift ;;
        -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_suite.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[ -n "$OUT_DIR" ] || OUT_DIR=$ROOT/.gpu-suite
[ -n "$BUDGET" ] || BUDGET=$([ $DRY_RUN = 1 ] && echo 300 || echo 560)
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
[ -n "$WORK" ] || WORK=$(mktemp -d /tmp/gpu-suite.XXXXXX)
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    [ $DRY_RUN = 1 ] && [ -x .venv/bin/python ] && PYTHON=$ROOT/.venv/bin/python
fi
LOG=$OUT_DIR/suite.log
rm -f "$OUT_DIR"/gpu-*.md "$OUT_DIR/gpu-suite-logs.tar.gz"
: >"$LOG"
: >"$WORK/steps.tsv"
START=$(date +%s)
DEADLINE=$((START + BUDGET))
RESERVE=15 # seconds kept back for the report and the tarball
STEP_FAILED=0

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
if [ $DRY_RUN = 1 ]; then
    export JAX_PLATFORMS=cpu JAXSERVE_ENABLE_MULTIPROCESSING=0
fi

# ------------------------------------------------------------------- what each step runs
if [ $DRY_RUN = 1 ]; then
    MODE=dry-run
    mkdir -p "$WORK/tiny-llama"
    cat >"$WORK/tiny-llama/config.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
 "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
 "rms_norm_eps": 1e-05, "bos_token_id": 1, "eos_token_id": 2}
EOF
    MODEL_ARGS=(--model "$WORK/tiny-llama" --load-format dummy --dtype float32
        --input-len 4 --output-len 3 --max-model-len 32 --max-num-seqs 2
        --max-num-batched-tokens 8 --kv-cache-memory-bytes 1048576)
    LATENCY_BATCHES=(1) # the GPU run's other batch sizes are the same script
    LATENCY_ITERS=(--num-iters-warmup 1 --num-iters 2)
    THROUGHPUT_PROMPTS=(2)
    # the GPU tests (skipped here) and one CUDA lowering: the suite runs the others anyway
    PYTEST_ARGS=(-m "gpu or cuda_lowering" tests/pallas_kernels/test_kernel.py
        -k "gpu or window_and_soft_cap")
    KERNEL_ARGS=(--smoke)
    MLA_ARGS=(--smoke --mla-latent 64)
    KV_TRANSFER_ARGS=(--blocks 1 8 --repeats 1)
    TUNE_ARGS=(--smoke)
    LIMIT_PYTEST=90 LIMIT_KERNEL=90 LIMIT_KERNEL_MLA=60 LIMIT_TUNE=90 LIMIT_KV=90 LIMIT_FIRST_MODEL=180
    LIMIT_MODEL=90
else
    MODE=gpu
    # One configuration for every model run (the compiled steps are shared through the
    # persistent cache): 256 sequences for the 256-prompt run, 1024-token prefill chunks and
    # a fixed 8 GiB KV cache (256 x 160 tokens need 5 GiB) keep the step shapes few.
    MODEL_ARGS=(--model llama-3-8b --load-format dummy --dtype bfloat16
        --input-len 32 --output-len 128 --max-model-len 512 --max-num-seqs 256
        --max-num-batched-tokens 1024 --kv-cache-memory-bytes 8589934592)
    LATENCY_BATCHES=(1 8 32)
    LATENCY_ITERS=(--num-iters-warmup 2 --num-iters 5)
    THROUGHPUT_PROMPTS=(64 256)
    PYTEST_ARGS=(-m "gpu or cuda_lowering") # lowering for CUDA on this machine's jax too
    KERNEL_ARGS=()
    # DeepSeek-V3's latent attention on a tp-8 rank (16 query heads over 512 + 64 values)
    # (4 cases, ~20 s: it runs in what the model runs before it leave of the budget)
    MLA_ARGS=(--mla-latent 512 --head-dim 576 --num-q-heads 16 --num-kv-heads 1
        --batch-sizes 1 16 64 --contexts 4096)
    KV_TRANSFER_ARGS=(--layout llama-3-8b)
    TUNE_ARGS=()
    LIMIT_PYTEST=240 LIMIT_KERNEL=180 LIMIT_KERNEL_MLA=90 LIMIT_TUNE=120 LIMIT_KV=90 LIMIT_FIRST_MODEL=300
    LIMIT_MODEL=150
fi

COMMIT=${GPU_SUITE_COMMIT:-}
if [ -z "$COMMIT" ]; then
    COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "unknown (no .git)")
    if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
        COMMIT="$COMMIT + uncommitted changes"
    fi
fi
DEVICE_HINT=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)

write_suite_info() {
    cat >"$WORK/suite.txt" <<EOF
mode=$MODE
budget=$BUDGET
elapsed=$(($(date +%s) - START))
commit=$COMMIT
device_hint=${DEVICE_HINT:-cpu}
model_args=${MODEL_ARGS[*]}
EOF
}

report() { # the markdown, into OUT_DIR and any further directories given
    write_suite_info
    "$PYTHON" scripts/gpu_suite_report.py report "$WORK" "$OUT_DIR" "$@" >/dev/null 2>>"$LOG" ||
        echo "gpu_suite.sh: the report failed (see suite.log)" | tee -a "$LOG"
}

selected() {
    [ -z "$ONLY" ] && return 0
    local want
    for want in ${ONLY//,/ }; do
        [[ $1 == "$want"* ]] && return 0
    done
    return 1
}

record() { # name status rc seconds limit command
    local command=${6//$'\n'/ }
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "${command//$'\t'/ }" \
        >>"$WORK/steps.tsv"
    echo "=== $1: $2 (exit $3, $4 s)" | tee -a "$LOG"
}

# run_step NAME LIMIT COMMAND...: under timeout (cut to the budget left), output to
# WORK/NAME.log and suite.log; records the status and refreshes the report.
run_step() {
    local name=$1 limit=$2
    shift 2
    selected "$name" || return 0
    local left=$((DEADLINE - $(date +%s) - RESERVE))
    if [ "$left" -lt 20 ]; then
        record "$name" "skipped: no time left in the ${BUDGET} s budget" - 0 "$limit" "$*"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit $limit s): $*" | tee -a "$LOG"
    local t0 rc status
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log" >>"$LOG"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) status=ok ;;
        124 | 137) status=timeout ;;
        *) status=failed ;;
    esac
    [ $status = ok ] || STEP_FAILED=1
    record "$name" "$status" "$rc" "$(($(date +%s) - t0))" "$limit" "$*"
    report
}

echo "gpu_suite.sh: $MODE, budget $BUDGET s, out $OUT_DIR, work $WORK, python $PYTHON" | tee -a "$LOG"

# ---------------------------------------------------------------------------------- steps
if [ $DRY_RUN = 0 ] && selected wheels; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        run_step wheels 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl
    else
        record wheels "skipped: no .whl/ (run bash scripts/gpu_wheels.sh here first)" - 0 0 -
    fi
    export PYTHONPATH="$WORK/site:$PYTHONPATH"
fi

run_step env 90 "$PYTHON" scripts/gpu_suite_report.py env "$WORK"
run_step pytest_gpu "$LIMIT_PYTEST" "$PYTHON" -m pytest -o addopts= -p no:cacheprovider -q -rfEs \
    "${PYTEST_ARGS[@]}"
run_step kernel_bench "$LIMIT_KERNEL" "$PYTHON" benchmarks/kernels/bench_paged_attention.py \
    "${KERNEL_ARGS[@]}" --output-json "$WORK/kernel_bench.json"
run_step kv_transfer "$LIMIT_KV" "$PYTHON" benchmarks/bench_kv_transfer.py \
    "${KV_TRANSFER_ARGS[@]}" --output-json "$WORK/kv_transfer.json"
# Model runs, the headline figures first: one latency (it compiles; the others read the
# cache), the most prompts, then the rest. A run that ends early leaves the top ones.
limit=$LIMIT_FIRST_MODEL
model_run() { # NAME SCRIPT ARGS...
    local name=$1
    run_step "$name" "$limit" "$PYTHON" "${@:2}" "${MODEL_ARGS[@]}" \
        --output-json "$WORK/$name.json"
    if selected "$name"; then limit=$LIMIT_MODEL; fi
}
last=$((${#THROUGHPUT_PROMPTS[@]} - 1))
model_run "latency_b${LATENCY_BATCHES[0]}" scripts/bench_latency.py \
    --batch-size "${LATENCY_BATCHES[0]}" "${LATENCY_ITERS[@]}"
model_run "throughput_${THROUGHPUT_PROMPTS[$last]}" benchmarks/bench_throughput.py \
    --num-prompts "${THROUGHPUT_PROMPTS[$last]}" --quiet
run_step kernel_bench_mla "$LIMIT_KERNEL_MLA" "$PYTHON" benchmarks/kernels/bench_paged_attention.py \
    "${MLA_ARGS[@]}" --output-json "$WORK/kernel_bench_mla.json"
for b in "${LATENCY_BATCHES[@]:1}"; do
    model_run "latency_b$b" scripts/bench_latency.py --batch-size "$b" "${LATENCY_ITERS[@]}"
done
for n in "${THROUGHPUT_PROMPTS[@]:0:$last}"; do
    model_run "throughput_$n" benchmarks/bench_throughput.py --num-prompts "$n" --quiet
done
# The tuning sweep last: it stops cleanly inside whatever time is left.
left=$((DEADLINE - $(date +%s) - RESERVE))
[ "$LIMIT_TUNE" -gt "$left" ] && LIMIT_TUNE=$left
run_step tune_kernel "$LIMIT_TUNE" "$PYTHON" benchmarks/kernels/tune_paged_attention.py \
    "${TUNE_ARGS[@]}" --max-seconds $((LIMIT_TUNE > 60 ? LIMIT_TUNE - 30 : LIMIT_TUNE / 2)) \
    --output-json "$WORK/tune_kernel.json"

# --------------------------------------------------------------------------------- report
if [ $DRY_RUN = 1 ]; then report; else report "$ROOT/benchmarks/results"; fi
(cd "$WORK" && shopt -s nullglob && tar czf "$OUT_DIR/gpu-suite-logs.tar.gz" -- *.log *.json \
    steps.tsv suite.txt)
echo "=== $(($(date +%s) - START)) s; report: $(ls "$OUT_DIR"/gpu-*.md)" | tee -a "$LOG"
cat "$OUT_DIR"/gpu-*.md
exit $STEP_FAILED
