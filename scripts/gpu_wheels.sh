#!/usr/bin/env bash
# Download, here (where PyPI is reachable), the wheels jaxserve needs at run time and the GPU
# machine lacks, into the ignored .whl/ folder: Python 3.12, manylinux x86_64, no dependencies
# resolved (each package's needs are listed explicitly below). scripts/gpu_suite.sh installs
# them there (`run` with carry [".whl"]).
#
#   bash scripts/gpu_wheels.sh            # then: device run, carry [".whl"], bash scripts/gpu_suite.sh
#
# The GPU machine (Python 3.12, jax 0.11.2 + CUDA 13) has numpy, pyyaml, requests, tqdm, anyio,
# typing-extensions, click, h11, httpx, jinja2, prometheus-client, tokenizers, transformers,
# flax and orbax. It lacks the seven below; their Requires-Dist (METADATA) are all among those:
#   pyzmq      (cffi on PyPy only)           msgspec     (none)
#   starlette  anyio, typing-extensions      uvicorn     click, h11
#   gguf       numpy, pyyaml, requests, tqdm llguidance  (none)
#   pillow     (none; image inputs: the OpenAI server imports it, and the image tests)
# openai and jsonschema (tests only) are not carried: their test modules skip without them.
# For the GPU grouped-matmul measurements (benchmarks/kernels/bench_moe_gmm.py): tokamax, a
# Pallas kernel library that needs jax >= 0.11 (the GPU machine's, not yet the CPU pin), with
# its needs the machine lacks (qwix, einshape, jaxtyping, pydantic, xprof and its fire: tokamax
# imports its profiler tools at import time, 31 MB of the wheels' 42), pinned below.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(pyzmq msgspec starlette uvicorn gguf llguidance pillow
    tokamax qwix einshape jaxtyping wadler_lindig pydantic pydantic_core annotated-types
    typing-inspection typing_extensions immutabledict opt_einsum absl-py xprof fire termcolor)
# NAME==VERSION for a package constraints.txt does not pin
FALLBACK_VERSIONS=(tokamax==0.0.17 qwix==0.1.8 einshape==1.0 jaxtyping==0.3.11
    wadler_lindig==0.1.8 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
    typing-inspection==0.4.5 typing_extensions==4.16.0 immutabledict==4.3.1 opt_einsum==3.4.0
    absl-py==2.5.1 xprof==2.24.2 fire==0.7.1 termcolor==3.3.0)
DEST=.whl
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

# Versions: constraints.txt's pins (what CI proved), so the GPU machine runs the same code.
specs=()
for name in "${PACKAGES[@]}"; do
    pin=$(grep -i -m1 "^${name}==" constraints.txt || true)
    if [ -z "$pin" ]; then
        for fb in "${FALLBACK_VERSIONS[@]}"; do [[ ${fb%%==*} == "$name" ]] && pin=$fb; done
    fi
    [ -n "$pin" ] || { echo "no version for $name in constraints.txt" >&2; exit 1; }
    specs+=("$pin")
done

rm -rf "$DEST"
mkdir -p "$DEST"
# pip matches each manylinux_2_N exactly: the N these packages publish (llguidance: 2_31,
# pyzmq: 2_26/2_28). The machine's glibc is newer than all of them.
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
    manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
    manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
    platforms+=(--platform "$tag")
done
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$DEST" "${specs[@]}"

count=$(find "$DEST" -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#specs[@]}" ]; then
    echo "expected ${#specs[@]} wheels in $DEST, found $count" >&2
    exit 1
fi
ls -l "$DEST"
echo "$count wheels, $(du -sk "$DEST" | cut -f1) KiB in $DEST (the device call carries up to 64 MiB)"
