#!/usr/bin/env bash
# The GPU suite: everything this project measures on a GPU, in one command that fits one
# device call (`bash scripts/gpu_suite.sh --budget 540`). Here first `bash scripts/gpu_wheels.sh`
# (wheels into .whl/), then the device tool's `run` with carry [".whl"] and that command.
#
# Steps, in the order they run, highest rank first (rank 0: always). Each runs under its own
# `timeout`, inside one time budget; a step that fails or times out is recorded and the next
# one runs. Model runs: Llama-3-8B shape, dummy bf16 weights, input 32 / output 128, one
# engine configuration for all (the first compiles, ~60-90 s; the rest read the persistent
# compilation cache).
#   rank step              what
#   0    wheels            install .whl/*.whl into WORK/site (the GPU machine has no registry)
#   1    env               nvidia-smi, jax version and devices, and that jaxserve imports
#   2    copy_rate         benchmarks/bench_copy_rate.py: device-to-device copy, GB/s counting
#                          read + write; every bandwidth fraction in the report is given against
#                          it and against the datasheet (H100 SXM 3.35 TB/s, H200 4.8 TB/s)
#   3    moe_gmm           benchmarks/kernels/bench_moe_gmm.py: the routed experts' grouped
#                          matmul at gpt-oss-20b and Qwen3-30B-A3B shapes, bf16 and packed
#                          (fp8, int4, MXFP4), tokamax's Mosaic kernel against XLA's ragged_dot
#   4    quant_linear      benchmarks/kernels/bench_quantized_linear.py: one 8B projection in each
#                          packed format against bf16 (Linear, XLA forms, the Mosaic kernel);
#                          quant_linear_subchannel: Linear under XLA's sub-channel fusion flag
#   4    sparse_mla        benchmarks/kernels/bench_sparse_mla.py: DeepSeek-V3.2's sparse attention
#                          (Mosaic kernel, XLA reference) against dense MLA (Triton) at 32k
#   4    moe_*             scripts/bench_latency.py on MoE presets with dummy weights: bf16
#                          gpt-oss-20b and qwen3-30b-a3b at batch 1, tokamax's grouped matmul
#                          (JAXSERVE_MOE_KERNEL=tokamax, _tokamax) against the engine's default,
#                          XLA's ragged_dot, in the same run; gpt-oss-20b with MXFP4
#                          experts (-q mxfp4) at batch 1, XLA's and jaxserve's Mosaic kernel
#                          (JAXSERVE_MOE_KERNEL=mosaic, _mosaic); the bf16 pairs at batch 32
#   4    q8b_*             scripts/bench_latency.py, the 8B model with packed dummy weights
#                          (-q int4: W4A16 group 128; -q fp8_block: W8A16 128x128) at batch 1
#                          and 32, against latency_b1 / _b32 (bf16) in the same run
#   4    pytest_gpu        python -m pytest -m gpu (the kernels' numerics on this GPU)
#   4    layer_kernels     benchmarks/count_kernels.py: the kernels one decoder layer of the 8B
#                          decode forward at 256 tokens launches (optimized HLO, by class)
#   4    gemm_backends     benchmarks/kernels/bench_gemm_backends.py: the 8B model's four GEMM
#                          shapes at T = 1, 32, 256 under XLA's Triton GEMMs, cuBLAS alone and
#                          no autotuning, a process each
#   5    latency_b1        scripts/bench_latency.py --repeats 3 (the decode step: median of 3)
#   6    kernel_bench      benchmarks/kernels/bench_paged_attention.py --kernels triton,mosaic
#                          (the end-to-end case, b=256 ctx 33-160, first; fractions of peak;
#                          the engine's kernel choice for this GPU comes from it)
#   7    throughput_256    benchmarks/bench_throughput.py, 256 prompts at once (one wave; the
#                          warm-up runs the same 256 untimed; median of 3 runs)
#   8    hf_peer           benchmarks/bench_hf_peer.py: HF transformers, generate with
#                          cache_implementation="static", batch 32, 1, 8, same GPU and shape
#   9    latency_b32       as latency_b1 (the HF comparison's batch: jaxserve >= 2x HF there)
#   10   pytest_lowering   python -m pytest -m cuda_lowering (every kernel variant lowered for
#                          CUDA by this jax; CPU work, CI runs it too on its own jax)
#   11   profile_b256      benchmarks/profile_decode.py --batch-sizes 256 --trace-dir: a
#                          jax.profiler trace of 10 decode steps, time by op class
#   12   throughput_1024   1024 prompts at 256 sequences (steady continuous batching)
#   13   latency_b8        as latency_b1
#   14   attn_agreement    benchmarks/bench_attention_agreement.py: the engine with each attention
#                          kernel (Triton, Mosaic) against the reference attention, logprobs
#                          and throughput at batch 1 and 256, a process each
#   15   tune_kernel       benchmarks/kernels/tune_paged_attention.py (tile, split and mixed
#                          sweeps; elastic: stops 30 s before its limit)
#   16   kv_transfer       benchmarks/bench_kv_transfer.py (KV connector copies, GB/s)
#   17   kernel_bench_mla  the kernel benchmark for DeepSeek-V3's latent attention (Triton only)
#   18   throughput_64     64 prompts
#   19   throughput_256_unfused   throughput_256 with JAXSERVE_FUSED_SAMPLING=0: the decode
#                          step's forward and sampling as two executables (fused's A/B)
# (--dry-run runs the same steps at tiny sizes: latency_b1/b2, throughput_2 (wave) and _8
# (steady, 2 sequences), profile_b2, HF peer at batch 2 and 1.)
#
# Budget: before each step, the steps not yet run are planned in rank order, each given its
# expected seconds (the first model run, its compile too) while they fit in the time left; a
# step that does not fit is dropped (recorded "dropped: ..."), so the lowest-ranked go first
# whatever their place in the order, and a step's limit is cut so that the higher-ranked steps
# after it keep their expected time (scripts/gpu_suite_report.py `plan`). The report lists the
# ranking, each step's expected and limit, and what was dropped. --rank moves steps up.
#
# Output: OUT_DIR holds suite.log (every step's output, as it runs), gpu-<device>.md (the
# report: versions, commit, each step's status and key figures, rewritten after every step),
# kernel_choice.json and gpu-suite-logs.tar.gz (per-step logs, JSON, the trace summary). The
# report also goes to benchmarks/results/ and the kernel choice into the engine's table
# (pallas_kernels/paged_attention/kernel_choice.json, choice.py), but only from a GPU run of
# an exact commit: with files changed or added (git status), the report's first line says so
# and nothing is copied; GPU_SUITE_COMMIT names the commit and vouches for the copy (a device
# copy without .git). OUT_DIR: --out DIR, else $OUT (the device tool's), else .gpu-suite/.
#
# kernel_choice.json (the engine reads "kernel"): {"format": 1, "devices": {"<jax device_kind>":
# {"kernel": "mosaic"|"triton", "decode": ..., "mixed": ..., "mosaic_speedup": {"decode": x,
# "mixed": y}, "cases": n, "reason": "...", "commit": "...", "jax": "...", "date": "..."}}}.
# mosaic_speedup[c] is the median over the kernel table's cases of class c (decode, e2e
# included; mixed) of triton us / mosaic us; "kernel" is mosaic when the geometric mean of the
# two is above 1, else triton (triton when mosaic is unavailable or failed, or when the
# pytest_gpu step did not pass). Other devices' entries in an existing file are kept.
#
# Options:
#   --dry-run      every step in smoke mode on CPU (JAX_PLATFORMS=cpu, the kernels interpreted,
#                  a tiny dummy model, HF on CPU, few iterations), no wheels; nothing copied
#                  out of OUT_DIR (1-2.5 minutes on 2 cores)
#   --out DIR      where the log, report, kernel choice and tarball go
#   --work DIR     scratch (logs, JSON, installed wheels, the trace); default a fresh /tmp dir
#   --budget S     seconds for all steps (default 540, 400 with --dry-run)
#   --steps A,B    run only these steps (names as above; prefixes work: latency,throughput;
#                  wheels always, unless skipped)
#   --skip A,B     run all but these (prefixes work)
#   --rank A,B     these steps first in the ranking, in this order (the rest keep theirs)
# Environment: PYTHON (default python3; .venv/bin/python with --dry-run when present),
# GPU_SUITE_MOE_ARGS (bench_moe_gmm.py's arguments on a GPU, default none: every case),
# GPU_SUITE_COMMIT (the commit to report; see above).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

DRY_RUN=0
OUT_DIR=${OUT:-}
WORK=""
BUDGET=""
ONLY=""
SKIP=""
RANK_FIRST=""
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --out) OUT_DIR=$2; shift ;;
        --work) WORK=$2; shift ;;
        --budget) BUDGET=$2; shift ;;
        --steps) ONLY=$2; shift ;;
        --skip) SKIP=$2; shift ;;
        --rank) RANK_FIRST=$2; shift ;;
        -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_suite.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[ -n "$OUT_DIR" ] || OUT_DIR=$ROOT/.gpu-suite
[ -n "$BUDGET" ] || BUDGET=$([ $DRY_RUN = 1 ] && echo 400 || echo 540)
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
rm -f "$OUT_DIR"/gpu-*.md "$OUT_DIR/gpu-suite-logs.tar.gz" "$OUT_DIR/kernel_choice.json"
: >"$LOG"
: >"$WORK/steps.tsv"
: >"$WORK/plan.tsv"
START=$(date +%s)
DEADLINE=$((START + BUDGET))
RESERVE=15 # seconds kept back for the report and the tarball
STEP_FAILED=0

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
if [ $DRY_RUN = 1 ]; then
    export JAX_PLATFORMS=cpu JAXSERVE_ENABLE_MULTIPROCESSING=0
fi

# ------------------------------------------------------------------- what each step runs
# Expected seconds (what the plan reserves) and limits (the timeout) per step; model runs
# add COMPILE_S to the first of them that runs.
if [ $DRY_RUN = 1 ]; then
    MODE=dry-run
    mkdir -p "$WORK/tiny-llama"
    cat >"$WORK/tiny-llama/config.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
 "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
 "rms_norm_eps": 1e-05, "bos_token_id": 1, "eos_token_id": 2}
EOF
    ENGINE_ARGS=(--model "$WORK/tiny-llama" --load-format dummy --dtype float32
        --max-model-len 32 --max-num-seqs 2 --max-num-batched-tokens 8
        --kv-cache-memory-bytes 1048576)
    BENCH_ARGS=(--input-len 4 --output-len 3)
    LAT_TOP=2 LAT_MID="" TP_WAVE=2 TP_STEADY=8 TP_SMALL="" PROFILE_B=2
    LATENCY_ITERS=(--num-iters-warmup 1 --num-iters 2 --repeats 3)
    TP_REPEATS=(--repeats 3)
    HF_ARGS=(--model "$WORK/tiny-llama" --dtype float32 --batch-sizes 2 1 --input-len 4
        --output-len 3 --iters 2)
    COPY_ARGS=(--smoke)
    PROFILE_ARGS=(--input-len 4 --iters 2 --trace-steps 3)
    # the GPU tests (skipped here) and one CUDA lowering: the suite runs the others anyway
    PYTEST_GPU_ARGS=(-m gpu tests/pallas_kernels/test_kernel.py)
    PYTEST_LOWERING_ARGS=(-m cuda_lowering tests/pallas_kernels/test_kernel.py
        -k "window_and_soft_cap")
    KERNEL_ARGS=(--smoke)
    MLA_ARGS=(--smoke --mla-latent 64)
    SPARSE_ARGS=(--smoke) E_SPARSE=15 L_SPARSE=90
    KV_TRANSFER_ARGS=(--blocks 1 8 --repeats 1)
    MOE_ARGS=(--shapes qwen3-30b-a3b --formats bf16 --impls xla --tokens 1 --iters 2)
    MOE_LAT_ARGS=(--dtype float32 --input-len 4 --output-len 3 --max-model-len 32
        --max-num-seqs 2 --max-num-batched-tokens 8 --num-iters-warmup 1 --num-iters 2
        --hf-overrides '{"num_hidden_layers": 1, "num_local_experts": 8, "num_experts": 8,
        "hidden_size": 256, "intermediate_size": 256, "vocab_size": 1024}')
    MOE_PRESETS=(gpt-oss-20b qwen3-30b-a3b) MOE_BATCHES=(1)
    TUNE_ARGS=(--smoke)
    COMPILE_S=0
    E_ENV=5 E_COPY=5 E_PYTEST=10 E_LOWERING=15 E_MODEL=20 E_HF=10 E_KERNEL=30 E_PROFILE=15
    E_TUNE=20 E_KV=5 E_MLA=15 E_STEADY=20 L_STEADY=120 E_MOE=20 L_MOE=120 E_MOE_LAT=60 L_MOE_LAT=150
    QL_ARGS=(--tokens 1 --iters 2) E_QL=30 L_QL=120 E_Q8B=20 L_Q8B=120
    AGREE_ARGS=(--batch-sizes 1 2 --input-len 4 --output-len 3) E_AGREE=25 L_AGREE=120
    LK_ARGS=(--model "$WORK/tiny-llama" --dtype float32 --tokens 2 --max-model-len 32 --cpu-ok)
    E_LK=15 L_LK=60
    GEMM_ARGS=(--smoke --settings default,cublas) E_GEMM=15 L_GEMM=60
    L_ENV=60 L_COPY=60 L_PYTEST=90 L_LOWERING=90 L_MODEL=120 L_HF=90 L_KERNEL=120
    L_PROFILE=90 L_TUNE=90 L_KV=90 L_MLA=60
else
    MODE=gpu
    # 256 sequences for the 256- and 1024-prompt runs, 1024-token prefill chunks and a fixed
    # 8 GiB KV cache (256 x 160 tokens need 5 GiB) keep the step shapes few.
    ENGINE_ARGS=(--model llama-3-8b --load-format dummy --dtype bfloat16 --max-model-len 512
        --max-num-seqs 256 --max-num-batched-tokens 1024 --kv-cache-memory-bytes 8589934592)
    BENCH_ARGS=(--input-len 32 --output-len 128)
    LAT_TOP=32 LAT_MID=8 TP_WAVE=256 TP_STEADY=1024 TP_SMALL=64 PROFILE_B=256
    LATENCY_ITERS=(--num-iters-warmup 2 --num-iters 3 --repeats 3)
    TP_REPEATS=(--repeats 3)
    HF_ARGS=(--model llama-3-8b --load-format dummy --dtype bfloat16 --batch-sizes 32 1 8
        --input-len 32 --output-len 128 --iters 3)
    COPY_ARGS=(--megabytes 4096)
    PROFILE_ARGS=(--input-len 96 --iters 5 --trace-steps 10) # context ~96-110: the runs' mean
    PYTEST_GPU_ARGS=(-m gpu)
    PYTEST_LOWERING_ARGS=(-m cuda_lowering) # lowering for CUDA on this machine's jax too
    KERNEL_ARGS=()
    # DeepSeek-V3's latent attention on a tp-8 rank (16 query heads over 512 + 64 values)
    MLA_ARGS=(--mla-latent 512 --head-dim 576 --num-q-heads 16 --num-kv-heads 1
        --batch-sizes 1 16 64 --contexts 4096)
    KV_TRANSFER_ARGS=(--layout llama-3-8b)
    SPARSE_ARGS=() E_SPARSE=60 L_SPARSE=150 # DeepSeek-V3.2 at 32k context (issue 72)
    read -r -a MOE_ARGS <<<"${GPU_SUITE_MOE_ARGS:-}" # e.g. "--formats bf16 --tokens 1,8"
    MOE_LAT_ARGS=(--dtype bfloat16 --input-len 32 --output-len 64 --max-model-len 256
        --max-num-seqs 32 --max-num-batched-tokens 256 --num-iters-warmup 1 --num-iters 3
        --kv-cache-memory-bytes 2000000000)
    MOE_PRESETS=(gpt-oss-20b qwen3-30b-a3b) MOE_BATCHES=(1 32)
    TUNE_ARGS=()
    # Seconds, from the H100 runs of 2026-11-27 (pytest 221 s for gpu + lowering together;
    # compile 87 s; throughput_256 25 s a run); HF's static-cache compile is a guess. The
    # compile: 87 s then, plus a guess for the fused decode steps since (18 more forwards of
    # the 19; on CPU a cold start took 40-70% longer with them).
    COMPILE_S=150
    E_ENV=10 E_COPY=15 E_PYTEST=130 E_LOWERING=120 E_MODEL=45 E_HF=120 E_KERNEL=120
    E_PROFILE=60 E_TUNE=45 E_KV=15 E_MLA=25 E_STEADY=80 L_STEADY=200 E_MOE=150 L_MOE=240 E_MOE_LAT=90 L_MOE_LAT=180
    QL_ARGS=(--tokens 1,8,32,256 --iters 30) E_QL=60 L_QL=150
    # a packed format's first run compiles its own executables (~100 s, as bf16's first)
    E_Q8B=150 L_Q8B=260
    # three engines (reference, Triton, Mosaic), each compiling what it does not share
    AGREE_ARGS=(--batch-sizes 1 256 --input-len 32 --output-len 128) E_AGREE=330 L_AGREE=480
    LK_ARGS=(--tokens 256 --list) E_LK=60 L_LK=150 # two compiles of a 3- and 4-layer forward
    GEMM_ARGS=(--tokens 1,32,256) E_GEMM=60 L_GEMM=150 # three processes, 12 shapes each
    L_ENV=90 L_COPY=60 L_PYTEST=240 L_LOWERING=200 L_MODEL=150 L_HF=240 L_KERNEL=240
    L_PROFILE=180 L_TUNE=150 L_KV=90 L_MLA=90
fi

COMMIT=${GPU_SUITE_COMMIT:-}
EXACT=1 # the report names an exact commit: it may go to benchmarks/results/
DIRTY=""
if [ -z "$COMMIT" ]; then
    if COMMIT=$(git rev-parse --short HEAD 2>/dev/null); then
        DIRTY=$(git status --porcelain 2>/dev/null | awk '{print $NF}' |
            tr '\n' ' ')
        [ -n "$DIRTY" ] && EXACT=0
    else
        COMMIT="unknown (no .git; set GPU_SUITE_COMMIT)"
        EXACT=0
    fi
fi
DEVICE_HINT=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)

write_suite_info() {
    cat >"$WORK/suite.txt" <<EOF
mode=$MODE
budget=$BUDGET
elapsed=$(($(date +%s) - START))
commit=$COMMIT
exact=$EXACT
dirty=$DIRTY
device_hint=${DEVICE_HINT:-cpu}
model_args=${ENGINE_ARGS[*]} ${BENCH_ARGS[*]}
EOF
}

report() { # the markdown, into OUT_DIR and any further directories given
    write_suite_info
    "$PYTHON" scripts/gpu_suite_report.py report "$WORK" "$OUT_DIR" "$@" >/dev/null 2>>"$LOG" ||
        echo "gpu_suite.sh: the report failed (see suite.log)" | tee -a "$LOG"
}

matches() { # NAME LIST: NAME starts with one of LIST's comma-separated prefixes
    local want
    for want in ${2//,/ }; do
        [[ $1 == "$want"* ]] && return 0
    done
    return 1
}

selected() {
    if [ -n "$ONLY" ] && ! matches "$1" "$ONLY"; then return 1; fi
    if [ -n "$SKIP" ] && matches "$1" "$SKIP"; then return 1; fi
    return 0
}

record() { # name status rc seconds limit command
    local command=${6//$'\n'/ }
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "${command//$'\t'/ }" \
        >>"$WORK/steps.tsv"
    echo "=== $1: $2 (exit $3, $4 s)" | tee -a "$LOG"
}

# ----------------------------------------------------------------------- the step table
NAMES=() KINDS=() EXPECTED=() LIMITS=() COMMANDS=()
step() { # NAME KIND EXPECTED LIMIT COMMAND...: a step, in the order they run
    local name=$1 kind=$2 expected=$3 limit=$4
    shift 4
    selected "$name" || return 0
    NAMES+=("$name") KINDS+=("$kind") EXPECTED+=("$expected") LIMITS+=("$limit")
    COMMANDS+=("$(printf '%q ' "$@")")
}
model() { # NAME EXPECTED LIMIT SCRIPT ARGS...: a model run (kind model: the first compiles)
    local name=$1 expected=$2 limit=$3
    shift 3
    step "$name" model "$expected" "$limit" "$PYTHON" "$@" "${ENGINE_ARGS[@]}" \
        "${BENCH_ARGS[@]}" --output-json "$WORK/$name.json"
}
lat() { model "latency_b$1" "$E_MODEL" "$L_MODEL" scripts/bench_latency.py --batch-size "$1" \
    "${LATENCY_ITERS[@]}"; }
tp() { # PROMPTS [EXPECTED LIMIT]
    model "throughput_$1" "${2:-$E_MODEL}" "${3:-$L_MODEL}" benchmarks/bench_throughput.py \
        --num-prompts "$1" --quiet "${TP_REPEATS[@]}"
}
PYTEST=("$PYTHON" -m pytest -o addopts= -p no:cacheprovider -q -rfEs)

step env other "$E_ENV" "$L_ENV" "$PYTHON" scripts/gpu_suite_report.py env "$WORK"
step copy_rate other "$E_COPY" "$L_COPY" "$PYTHON" benchmarks/bench_copy_rate.py \
    "${COPY_ARGS[@]}" --output-json "$WORK/copy_rate.json"
step moe_gmm other "$E_MOE" "$L_MOE" env COPY_RATE_JSON="$WORK/copy_rate.json" "$PYTHON" \
    benchmarks/kernels/bench_moe_gmm.py "${MOE_ARGS[@]}" --max-seconds @MAX_SECONDS@ \
    --output-json "$WORK/moe_gmm.json"
# one 8B projection per packed format against bf16: Linear as it is, XLA's fusion of the same
# with the sub-channel flag, and the Mosaic kernel that decodes inside the matmul (issue 67)
QL_FORMS=(--compiler-forms mosaic-int4,mosaic-fp8,mosaic-mxfp4,s4-bcast,f8-bcast)
step quant_linear other "$E_QL" "$L_QL" "$PYTHON" benchmarks/kernels/bench_quantized_linear.py \
    "${QL_ARGS[@]}" "${QL_FORMS[@]}" --output-json "$WORK/quant_linear.json"
step quant_linear_subchannel other "$E_QL" "$L_QL" env \
    XLA_FLAGS=--xla_gpu_experimental_enable_subchannel_dequantisation_fusion=true "$PYTHON" \
    benchmarks/kernels/bench_quantized_linear.py "${QL_ARGS[@]}" \
    --output-json "$WORK/quant_linear_subchannel.json"
# DeepSeek Sparse Attention: the Mosaic kernel's bandwidth over the chosen tokens' rows against
# dense MLA's over the whole 32k context (issue 72)
step sparse_mla other "$E_SPARSE" "$L_SPARSE" env COPY_RATE_JSON="$WORK/copy_rate.json" \
    "$PYTHON" benchmarks/kernels/bench_sparse_mla.py "${SPARSE_ARGS[@]}" \
    --max-seconds @MAX_SECONDS@ --output-json "$WORK/sparse_mla.json"
moe_pair() { # BATCH: each preset with tokamax's grouped matmul, then the default (XLA's)
    local b=$1 p k name
    for p in "${MOE_PRESETS[@]}"; do
        for k in tokamax ""; do
            name=moe_${p//[-.]/_}_b$b${k:+_$k}
            step "$name" other "$E_MOE_LAT" "$L_MOE_LAT" env JAXSERVE_MOE_KERNEL=$k \
                "$PYTHON" scripts/bench_latency.py --model "$p" --load-format dummy \
                --batch-size "$b" "${MOE_LAT_ARGS[@]}" --output-json "$WORK/$name.json"
        done
    done
}
moe_pair "${MOE_BATCHES[0]}"
# gpt-oss-20b with its experts packed as its checkpoints ship them (MXFP4), batch 1
step moe_gpt_oss_20b_mxfp4_b1 other "$E_MOE_LAT" "$L_MOE_LAT" "$PYTHON" scripts/bench_latency.py \
    --model "${MOE_PRESETS[0]}" --load-format dummy -q mxfp4 --batch-size 1 "${MOE_LAT_ARGS[@]}" \
    --output-json "$WORK/moe_gpt_oss_20b_mxfp4_b1.json"
# the same with jaxserve's own Mosaic kernel (the experts decoded inside the matmul, the routed
# ones read only): issue 66's must-show (>= 0.6 of the step's memory bound)
step moe_gpt_oss_20b_mxfp4_b1_mosaic other "$E_MOE_LAT" "$L_MOE_LAT" env JAXSERVE_MOE_KERNEL=mosaic \
    "$PYTHON" scripts/bench_latency.py --model "${MOE_PRESETS[0]}" --load-format dummy -q mxfp4 \
    --batch-size 1 "${MOE_LAT_ARGS[@]}" --output-json "$WORK/moe_gpt_oss_20b_mxfp4_b1_mosaic.json"
for moe_b in "${MOE_BATCHES[@]:1}"; do moe_pair "$moe_b"; done
# the dense model with packed dummy weights (issue 67): each format's decode step at batch 1
# and LAT_TOP, against latency_b1 / latency_b$LAT_TOP (bf16, the same engine arguments)
for q_b in 1 "$LAT_TOP"; do
    for q_fmt in int4 fp8_block; do
        step "q8b_${q_fmt}_b$q_b" other "$E_Q8B" "$L_Q8B" "$PYTHON" scripts/bench_latency.py \
            -q "$q_fmt" --batch-size "$q_b" "${LATENCY_ITERS[@]}" "${ENGINE_ARGS[@]}" \
            "${BENCH_ARGS[@]}" --output-json "$WORK/q8b_${q_fmt}_b$q_b.json"
    done
done
step pytest_gpu other "$E_PYTEST" "$L_PYTEST" "${PYTEST[@]}" "${PYTEST_GPU_ARGS[@]}"
step layer_kernels other "$E_LK" "$L_LK" "$PYTHON" benchmarks/count_kernels.py "${LK_ARGS[@]}" \
    --output-json "$WORK/layer_kernels.json"
step gemm_backends other "$E_GEMM" "$L_GEMM" "$PYTHON" benchmarks/kernels/bench_gemm_backends.py \
    "${GEMM_ARGS[@]}" --output-json "$WORK/gemm_backends.json"
lat 1
step kernel_bench other "$E_KERNEL" "$L_KERNEL" "$PYTHON" \
    benchmarks/kernels/bench_paged_attention.py "${KERNEL_ARGS[@]}" --kernels triton,mosaic \
    --output-json "$WORK/kernel_bench.json"
tp "$TP_WAVE"
step hf_peer other "$E_HF" "$L_HF" "$PYTHON" benchmarks/bench_hf_peer.py "${HF_ARGS[@]}" \
    --output-json "$WORK/hf_peer.json"
lat "$LAT_TOP"
step pytest_lowering other "$E_LOWERING" "$L_LOWERING" "${PYTEST[@]}" "${PYTEST_LOWERING_ARGS[@]}"
step "profile_b$PROFILE_B" model "$E_PROFILE" "$L_PROFILE" "$PYTHON" benchmarks/profile_decode.py \
    "${ENGINE_ARGS[@]}" --batch-sizes "$PROFILE_B" "${PROFILE_ARGS[@]}" \
    --trace-dir "$WORK/trace_b$PROFILE_B"
tp "$TP_STEADY" "$E_STEADY" "$L_STEADY"
[ -n "$LAT_MID" ] && lat "$LAT_MID"
# the engine with each attention kernel against the reference attention: logprobs and
# throughput at batch 1 and the wave's size, one process per kernel (issue 68)
step attn_agreement other "$E_AGREE" "$L_AGREE" "$PYTHON" benchmarks/bench_attention_agreement.py \
    "${ENGINE_ARGS[@]}" "${AGREE_ARGS[@]}" --kernels triton,mosaic \
    --output-json "$WORK/attn_agreement.json"
step tune_kernel other "$E_TUNE" "$L_TUNE" "$PYTHON" benchmarks/kernels/tune_paged_attention.py \
    "${TUNE_ARGS[@]}" --max-seconds @MAX_SECONDS@ --output-json "$WORK/tune_kernel.json"
step kv_transfer other "$E_KV" "$L_KV" "$PYTHON" benchmarks/bench_kv_transfer.py \
    "${KV_TRANSFER_ARGS[@]}" --output-json "$WORK/kv_transfer.json"
step kernel_bench_mla other "$E_MLA" "$L_MLA" "$PYTHON" benchmarks/kernels/bench_paged_attention.py \
    "${MLA_ARGS[@]}" --kernels triton --output-json "$WORK/kernel_bench_mla.json"
[ -n "$TP_SMALL" ] && tp "$TP_SMALL"
# the wave with the decode step's forward and sampling as two executables (fused's A/B)
step "throughput_${TP_WAVE}_unfused" model "$E_MODEL" "$L_MODEL" env JAXSERVE_FUSED_SAMPLING=0 \
    "$PYTHON" benchmarks/bench_throughput.py --num-prompts "$TP_WAVE" --quiet "${TP_REPEATS[@]}" \
    "${ENGINE_ARGS[@]}" "${BENCH_ARGS[@]}" --output-json "$WORK/throughput_${TP_WAVE}_unfused.json"

# The ranking: the step names in priority order (the order above is also the ranking's,
# except where --rank moves steps up); wheels, when it runs, comes before all.
RANKING=("${NAMES[@]}")
if [ -n "$RANK_FIRST" ]; then
    first=() rest=()
    for want in ${RANK_FIRST//,/ }; do
        for n in "${NAMES[@]}"; do [ "$n" = "$want" ] && first+=("$n"); done
    done
    for n in "${NAMES[@]}"; do matches "$n" "$RANK_FIRST" || rest+=("$n"); done
    RANKING=("${first[@]}" "${rest[@]}")
fi
for i in "${!NAMES[@]}"; do
    rank=0
    for r in "${!RANKING[@]}"; do [ "${RANKING[$r]}" = "${NAMES[$i]}" ] && rank=$((r + 1)); done
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "${NAMES[$i]}" "$rank" "${KINDS[$i]}" "${EXPECTED[$i]}" \
        "${LIMITS[$i]}" "${COMMANDS[$i]}" >>"$WORK/plan.tsv"
done
echo "compile_s=$COMPILE_S" >"$WORK/plan.txt"

# run_step INDEX: plan it against the time left (run, with its limit, or drop), then run it
# under timeout with its output in WORK/NAME.log and suite.log; records the status and
# refreshes the report.
run_step() {
    local i=$1 name=${NAMES[$1]} command=${COMMANDS[$1]}
    local left=$((DEADLINE - $(date +%s) - RESERVE)) decision limit
    decision=$("$PYTHON" scripts/gpu_suite_report.py plan "$WORK" "$name" "$left" 2>>"$LOG") ||
        decision="run ${LIMITS[$i]}" # the planner failed: run as declared
    if [ "${decision%% *}" != run ]; then
        record "$name" "dropped: ${decision#* }" - 0 "${LIMITS[$i]}" "$command"
        report
        return 0
    fi
    limit=${decision#run }
    command=${command//@MAX_SECONDS@/$((limit > 60 ? limit - 30 : limit / 2))}
    echo "=== $name (limit $limit s): $command" | tee -a "$LOG"
    local t0 rc status
    t0=$(date +%s)
    eval "timeout -k 10 $limit $command" 2>&1 | tee "$WORK/$name.log" >>"$LOG"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) status=ok ;;
        124 | 137) status=timeout ;;
        *) status=failed ;;
    esac
    [ $status = ok ] || STEP_FAILED=1
    record "$name" "$status" "$rc" "$(($(date +%s) - t0))" "$limit" "$command"
    report
}

echo "gpu_suite.sh: $MODE, budget $BUDGET s, out $OUT_DIR, work $WORK, python $PYTHON" | tee -a "$LOG"
[ $EXACT = 1 ] || echo "gpu_suite.sh: NOT AN EXACT COMMIT ($COMMIT${DIRTY:+; changed: $DIRTY}):" \
    "the report stays in $OUT_DIR" | tee -a "$LOG"

# ---------------------------------------------------------------------------------- steps
# (wheels whatever --steps says: the steps need them; --skip wheels leaves them out)
if [ $DRY_RUN = 0 ] && ! { [ -n "$SKIP" ] && matches wheels "$SKIP"; }; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        t0=$(date +%s)
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$WORK/site" .whl/*.whl >"$WORK/wheels.log" 2>&1
        rc=$?
        record wheels "$([ $rc = 0 ] && echo ok || echo failed)" $rc $(($(date +%s) - t0)) 120 \
            "pip install --target $WORK/site $(echo .whl/*.whl)"
        [ $rc = 0 ] || STEP_FAILED=1
    else
        record wheels "skipped: no .whl/ (run bash scripts/gpu_wheels.sh here first)" - 0 0 -
    fi
    export PYTHONPATH="$WORK/site:$PYTHONPATH"
fi
for i in "${!NAMES[@]}"; do
    run_step "$i"
done

# --------------------------------------------------------------------------------- report
"$PYTHON" scripts/gpu_suite_report.py kernel-choice "$WORK" "$OUT_DIR/kernel_choice.json" \
    >>"$LOG" 2>&1 || echo "gpu_suite.sh: no kernel choice (see suite.log)" | tee -a "$LOG"
if [ $DRY_RUN = 0 ] && [ $EXACT = 1 ]; then
    report "$ROOT/benchmarks/results"
    [ -f "$OUT_DIR/kernel_choice.json" ] &&
        "$PYTHON" scripts/gpu_suite_report.py kernel-choice "$WORK" \
            "$ROOT/pallas_kernels/paged_attention/kernel_choice.json" >>"$LOG" 2>&1
else
    report
    [ $DRY_RUN = 1 ] || echo "gpu_suite.sh: not an exact commit: nothing copied to" \
        "benchmarks/results/" | tee -a "$LOG"
fi
(cd "$WORK" && shopt -s nullglob && tar czf "$OUT_DIR/gpu-suite-logs.tar.gz" -- *.log *.json \
    steps.tsv plan.tsv suite.txt)
echo "=== $(($(date +%s) - START)) s; report: $(ls "$OUT_DIR"/gpu-*.md)" | tee -a "$LOG"
cat "$OUT_DIR"/gpu-*.md
exit $STEP_FAILED
