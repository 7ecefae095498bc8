"""Weight-only quantization and the fp8 KV cache on the default model: memory, agreement,
quality and speed against full precision, each mode in its own engine in this process.
Modes: none, int8, fp8 (weights), kv-fp8 (full-precision weights, `kv_cache_dtype="fp8"`).

  - weights: bytes of the model's parameters on the device; KV cache bytes per token;
  - greedy agreement: 64 greedy tokens on each of 4 chat prompts, tokens equal to full
    precision's at the same position (counted up to the first difference, and in total);
  - mean logprob of a fixed ~330-token text (its prompt logprobs: a perplexity-style check),
    and its change against full precision;
  - decode speed: output tokens/s of a batch of 8 generating 64 tokens (ignore_eos), median of
    --iters runs after a warm-up (--iters 0: quality only).

    .venv/bin/python benchmarks/bench_quantization.py --output-json \\
        benchmarks/results/quantization-cpu-2026-11-23.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time

os.environ.setdefault("JAXSERVE_ENABLE_MULTIPROCESSING", "0")  # the core in this process

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "List three colours.", "Explain what a CPU does in two sentences."]  # fmt: skip
TEXT = (  # ~330 tokens of plain English on several subjects: the quality check's sample
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed 'La dame de fer', it was constructed as the "
    "centrepiece of the 1889 World's Fair.\n\n"
    "Bread is one of the oldest prepared foods. A simple loaf needs only flour, water, salt and "
    "yeast. The dough is kneaded until it becomes smooth and elastic, then left to rise in a "
    "warm place for an hour or two. After shaping, it rises again before it is baked in a hot "
    "oven until the crust turns golden brown and the loaf sounds hollow when tapped.\n\n"
    "A computer program is a list of instructions that a machine follows one after another. "
    "Programmers write these instructions in a programming language, which a compiler or an "
    "interpreter turns into something the processor can run. Good programs are easy to read, "
    "because people spend far more time reading code than writing it.\n\n"
    "The water cycle moves water between the oceans, the air and the land. The sun heats the "
    "surface of the sea, and water evaporates into the atmosphere. As the moist air rises it "
    "cools, and the vapour condenses into clouds. When the droplets grow heavy enough they fall "
    "as rain or snow, which flows back through rivers and streams to the sea.\n\n"
    "Many people enjoy walking in the mountains during the summer. Before setting out, it is "
    "wise to check the weather forecast, to carry enough water and warm clothes, and to tell a "
    "friend which path you plan to take and when you expect to return."
)


def run(mode: str, iters: int, max_num_batched_tokens: int | None = None) -> dict:
    quantization = None if mode in ("none", "kv-fp8") else mode
    kv_cache_dtype = "fp8" if mode == "kv-fp8" else "auto"
    llm = LLM(
        max_num_seqs=8, max_model_len=512, quantization=quantization,
        kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=max_num_batched_tokens,
    )  # fmt: skip
    core = llm.llm_engine.engine_core.engine_core
    weights = sum(x.nbytes for x in jax.tree.leaves(core.runner.params))
    kv_per_token = core.runner.kv_bytes_per_block() / core.runner.kv.block_size
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                tokenize=False)
        for c in CHATS
    ]  # fmt: skip
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                          use_tqdm=False)  # fmt: skip
    scored = llm.generate(TEXT, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logprobs = [next(iter(p.values())).logprob for p in scored[0].prompt_logprobs[1:]]
    batch = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    if iters:
        llm.generate(prompts * 2, batch, use_tqdm=False)  # warm-up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        llm.generate(prompts * 2, batch, use_tqdm=False)
        times.append(time.perf_counter() - start)
    result = {
        "mode": mode,
        "weight_mib": weights / 2**20,
        "kv_bytes_per_token": kv_per_token,
        "tokens": [o.outputs[0].token_ids for o in greedy],
        "mean_logprob": float(np.mean(logprobs)),
        "decode_tok_s": 8 * 64 / statistics.median(times) if times else None,
    }
    del llm, core
    return result


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="none,int8,fp8,kv-fp8")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    rows = [run(m, args.iters, args.max_num_batched_tokens) for m in args.modes.split(",")]
    base = rows[0]
    for r in rows:
        same, prefix = 0, 0
        for mine, ref in zip(r["tokens"], base["tokens"], strict=True):
            equal = [a == b for a, b in zip(mine, ref, strict=True)]
            same += sum(equal)
            prefix += equal.index(False) if False in equal else len(equal)
        r["greedy_tokens_equal"] = f"{same}/{64 * len(CHATS)}"
        r["greedy_prefix_equal"] = f"{prefix}/{64 * len(CHATS)}"
        r["mean_logprob_change"] = r["mean_logprob"] / base["mean_logprob"] - 1
        if r["decode_tok_s"] is not None:
            r["speed_vs_full"] = r["decode_tok_s"] / base["decode_tok_s"]
    for r in rows:
        del r["tokens"]
    result = {
        "command": shlex.join(["python", *sys.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "rows": rows,
    }
    for r in rows:
        print(json.dumps(r))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
