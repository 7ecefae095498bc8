"""KV offloading (--kv-offloading-size): the time to first token of a long prompt repeated
after other prompts evicted its blocks from a small device KV cache, with the host tier and
without it, on the same engine settings. Greedy outputs are compared too.

    python benchmarks/bench_offload.py [--model M] [--prompt-len 1024] [--device-blocks 96]
        [--offload-gib 1] [--rounds 3] [--output-json F]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import numpy as np

os.environ.setdefault("JAXSERVE_ENABLE_MULTIPROCESSING", "0")

from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402


def ttft(llm: LLM, req_id: str, prompt: list[int], params: SamplingParams):
    """(seconds to the first token, the finished output) of one request run alone."""
    engine = llm.llm_engine
    start = time.perf_counter()
    engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    first, final = None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - start
            if out.finished:
                final = out
    return first, final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled default model")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--num-fillers", type=int, default=3)
    parser.add_argument("--device-blocks", type=int, default=96)
    parser.add_argument("--offload-gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    engine = dict(max_model_len=2048, max_num_seqs=4, enable_prefix_caching=True,
                  num_gpu_blocks_override=args.device_blocks)  # fmt: skip
    if args.model:
        engine["model"] = args.model
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = [rng.integers(100, 20000, args.prompt_len).tolist() for _ in range(args.rounds)]
    fillers = [
        [rng.integers(100, 20000, args.prompt_len).tolist() for _ in range(args.num_fillers)]
        for _ in range(args.rounds)
    ]
    results = {}
    for name, extra in (("no offload", {}), ("offload", {"kv_offloading_size": args.offload_gib})):
        llm = LLM(**engine, **extra)
        repeat_ttfts, first_ttfts, outputs, cached = [], [], [], []
        for r in range(args.rounds):
            prompt = prompts[r]
            t_first, out = ttft(llm, f"a{r}", prompt, params)
            first_ttfts.append(t_first)
            for i, filler in enumerate(fillers[r]):  # evict the prompt's blocks from the device
                ttft(llm, f"f{r}{i}", filler, params)
            t_again, again = ttft(llm, f"again{r}", prompt, params)
            repeat_ttfts.append(t_again)
            outputs.append((out.outputs[0].token_ids, again.outputs[0].token_ids))
            cached.append(again.num_cached_tokens)
        results[name] = {
            "first_ttft_s": first_ttfts, "repeat_ttft_s": repeat_ttfts,
            "median_repeat_ttft_s": statistics.median(repeat_ttfts),
            "repeat_cached_tokens": cached, "outputs": outputs,
        }  # fmt: skip
        print(f"{name}: first TTFT median {statistics.median(first_ttfts) * 1e3:.0f} ms, "
              f"repeated after eviction {statistics.median(repeat_ttfts) * 1e3:.0f} ms "
              f"(cached tokens {cached})")  # fmt: skip
        llm.llm_engine.engine_core.shutdown()
        del llm
    same = results["no offload"]["outputs"] == results["offload"]["outputs"]
    speedup = (
        results["no offload"]["median_repeat_ttft_s"] / results["offload"]["median_repeat_ttft_s"]
    )
    print(f"outputs identical: {same}; repeated-prompt TTFT {speedup:.2f}x faster with offload")
    if args.output_json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()  # fmt: skip
        with open(args.output_json, "w") as f:
            record = {"args": vars(args), "commit": commit, "outputs_identical": same,
                      "repeat_ttft_speedup": speedup, "results": results}  # fmt: skip
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
