"""Load time and peak host memory of loading a model, against the size of its weights.

Runs the load in a fresh subprocess so ru_maxrss is the load's own peak, measured from a
baseline taken after jax and transformers are imported. On CPU the "device" arrays live in host
memory too, so the peak includes the placed weights themselves: a ratio of 1.0 would mean no
overhead at all, 2.0 a full second copy.

    .venv/bin/python benchmarks/bench_load.py [MODEL] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import json, resource, sys, time
import jax
from flax import nnx
from jaxserve.models import loader

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

model, dtype, tok = sys.argv[1] or None, sys.argv[2], sys.argv[3] == "1"
# Fixed process costs before the baseline: the XLA client, and transformers (which imports
# torch when it is installed, +330 MiB, as in the test environment).
jax.devices()
import transformers.models.llama.configuration_llama
base = rss_mb()
t = time.perf_counter()
loaded = loader.load_model(model, dtype=dtype, load_tokenizer=tok)
jax.block_until_ready(jax.tree.leaves(nnx.state(loaded.model)))
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
size = sum(x.nbytes for x in jax.tree.leaves(nnx.state(loaded.model))) / 2**20
print(json.dumps(dict(seconds=seconds, base_mb=base, peak_mb=peak, weights_mb=size)))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", nargs="?", default="", help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-tokenizer", action="store_true", help="weights only")
    args = parser.parse_args()
    tok = "0" if args.no_tokenizer else "1"
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, args.model, args.dtype, tok],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    r = json.loads(out.strip().splitlines()[-1])
    extra = r["peak_mb"] - r["base_mb"]
    print(f"load time        {r['seconds']:.1f} s")
    print(f"weights          {r['weights_mb']:.0f} MiB ({args.dtype})")
    print(f"peak RSS growth  {extra:.0f} MiB = {extra / r['weights_mb']:.2f}x the weights")


if __name__ == "__main__":
    main()
