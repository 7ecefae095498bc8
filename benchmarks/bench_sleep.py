"""Sleep / wake and weight updates on a real model: device memory before, asleep and after
(live JAX array bytes; on a GPU also the allocator's bytes in use), the time each takes, and
whether greedy output survives. The engine core runs in this process (the zero-copy update
needs it).

    python benchmarks/bench_sleep.py [--model PATH] [--out results.json]

Prints a markdown table; --out writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAXSERVE_ENABLE_MULTIPROCESSING", "0")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.models.loader import load_model  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def memory() -> dict:
    live = sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())
    stats = jax.devices()[0].memory_stats() or {}
    return {"live_array_bytes": live, "device_bytes_in_use": stats.get("bytes_in_use")}


def texts(llm: LLM) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = LLM(args.model, enable_sleep_mode=True, max_model_len=args.max_model_len)
    want = texts(llm)
    rows = []
    for level in (1, 2):
        before = memory()
        _, sleep_s = timed(llm.sleep, level)
        asleep = memory()
        _, wake_s = timed(llm.wake_up)
        after = memory()
        same = texts(llm) == want
        rows.append({"what": f"sleep level {level}", "before": before, "asleep": asleep,
                     "after": after, "sleep_s": sleep_s, "wake_s": wake_s,
                     "same_output": same})  # fmt: skip
    trainer = load_model(args.model, load_tokenizer=False)  # a JAX trainer: our layout
    counts, adopt_s = timed(llm.update_weights, nnx.state(trainer.model))
    rows.append({"what": "update_weights, engine layout (zero-copy)", "counts": counts,
                 "seconds": adopt_s, "same_output": texts(llm) == want})  # fmt: skip
    _, reload_s = timed(llm.reload_weights)
    rows.append({"what": "reload_weights (the model's checkpoint)", "seconds": reload_s,
                 "same_output": texts(llm) == want})  # fmt: skip
    print(f"model: {args.model or 'SmolLM2-135M-Instruct (bundled GGUF)'}, "
          f"device: {jax.devices()[0].device_kind}\n")  # fmt: skip
    print("| what | live bytes before | asleep | after | sleep s | wake s | same output |")
    print("|---|---|---|---|---|---|---|")
    for r in rows[:2]:
        print(f"| {r['what']} | {r['before']['live_array_bytes']:,} | "
              f"{r['asleep']['live_array_bytes']:,} | {r['after']['live_array_bytes']:,} | "
              f"{r['sleep_s']:.2f} | {r['wake_s']:.2f} | {r['same_output']} |")  # fmt: skip
    for r in rows[2:]:
        print(f"\n{r['what']}: {r['seconds']:.2f} s, {r.get('counts', '')}, "
              f"same output: {r['same_output']}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
