"""vLLM (CPU build) peer of jaxserve's scripts/bench_lora.py: what LoRA adapters cost a decode
step. One engine per process (two vLLM CPU engines at once do not fit this 24 GiB machine):

    VLLM_CPU_KVCACHE_SPACE=2 python vllm_lora_bench.py base --out base.json
    VLLM_CPU_KVCACHE_SPACE=2 python vllm_lora_bench.py lora --adapters DIR --out lora.json
    VLLM_CPU_KVCACHE_SPACE=2 python vllm_lora_bench.py base-eager --out base-eager.json
    python vllm_lora_bench.py combine base.json lora.json base-eager.json --out vllm.json

vLLM's CPU platform sets compilation mode NONE whenever LoRA is enabled (vllm/platforms/cpu.py):
base-eager is the base engine with that mode alone, a control for how much of the LoRA
engine's cost is the lost torch.compile.

Method as bench_lora's: --batch-size random prompts (numpy default_rng(seed) integers in
[100, min(vocab, 20000)), as jaxserve.benchmarks.common.random_prompt_ids) of --input-len
tokens, generated to exactly --output-len tokens greedy (temperature 0, ignore_eos); prefix
caching off (and the cache reset before each run, untimed); one warm-up per case, then
--num-iters rounds with the engine's cases interleaved, each round timing output_len and 1
output token; decode step = (median latency(output_len) - median latency(1)) / (output_len - 1).
LoRA cases: no adapter in the batch, adapter a0 on every row, and max_loras adapters spread
over the rows (row i gets adapter i % max_loras).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time


def prompt_ids(num, length, vocab_size, seed):
    import numpy as np

    low = 100 if vocab_size > 1000 else 0
    rng = np.random.default_rng(seed)
    return rng.integers(low, min(vocab_size, 20000), (num, length)).tolist()


def bench(args):
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=args.model, dtype="float32", max_model_len=args.max_model_len,
        max_num_seqs=args.batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False, seed=args.seed,
    )  # fmt: skip
    if args.mode == "base-eager":  # what enable_lora does to compilation on CPU, alone
        kwargs.update(compilation_config={"mode": 0})
    if args.mode == "lora":
        kwargs.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank,
                      max_cpu_loras=args.max_loras)  # fmt: skip
    begin = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - begin
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts = [{"prompt_token_ids": p}
               for p in prompt_ids(args.batch_size, args.input_len, vocab, args.seed)]  # fmt: skip

    if args.mode == "base":
        cases = {"base (enable_lora=False)": None}
    elif args.mode == "base-eager":
        cases = {"base, compilation mode NONE (control)": None}
    else:
        from vllm.lora.request import LoRARequest

        adapters = [LoRARequest(f"a{i}", i + 1, os.path.join(args.adapters, f"a{i}"))
                    for i in range(args.max_loras)]  # fmt: skip
        cases = {
            "enable_lora, no adapter in the batch": None,
            "enable_lora, 1 adapter": adapters[0],
            f"enable_lora, {args.max_loras} adapters": [
                adapters[i % args.max_loras] for i in range(args.batch_size)],
        }  # fmt: skip

    def run(case, n):
        llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=cases[case], use_tqdm=False)
        dt = time.perf_counter() - t
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        assert got == n * len(prompts), (got, n)
        return dt

    for case in cases:  # warm-up (and each adapter's first load)
        run(case, args.output_len)
    full, one = {c: [] for c in cases}, {c: [] for c in cases}
    for _ in range(args.num_iters):
        for case in cases:
            full[case].append(run(case, args.output_len))
            one[case].append(run(case, 1))
    out = {
        "vllm": vllm.__version__, "torch": torch.__version__,
        "torch_num_threads_in_driver": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "engine_kwargs": kwargs, "startup_s": startup,
        "batch_size": args.batch_size, "input_len": args.input_len,
        "output_len": args.output_len, "num_iters": args.num_iters, "cases": {},
    }  # fmt: skip
    for case in cases:
        step = (statistics.median(full[case]) - statistics.median(one[case])) / (
            args.output_len - 1
        )
        out["cases"][case] = {
            "decode_step_ms": step * 1e3,
            "latency_full_s": full[case],
            "latency_1_s": one[case],
        }
        print(f"{case:42s} decode step {step * 1e3:8.2f} ms", file=sys.stderr, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"start-up {startup:.1f} s", file=sys.stderr, flush=True)


def combine(args):
    loaded = []
    for path in args.files:
        with open(path) as f:
            loaded.append(json.load(f))
    base, lora, *extra = loaded
    base_step = base["cases"]["base (enable_lora=False)"]["decode_step_ms"]
    out = {k: base[k] for k in ("vllm", "torch", "machine", "batch_size", "input_len",
                                "output_len", "num_iters")}  # fmt: skip
    out["startup_s"] = {"base": base["startup_s"], "enable_lora": lora["startup_s"]}
    out["engine_kwargs"] = {"base": base["engine_kwargs"], "enable_lora": lora["engine_kwargs"]}
    for e in extra:
        out["startup_s"]["base, compilation mode NONE"] = e["startup_s"]
        out["engine_kwargs"]["base, compilation mode NONE"] = e["engine_kwargs"]
    out["cases"] = {}
    for src in (base, lora, *extra):
        for case, v in src["cases"].items():
            out["cases"][case] = dict(v, vs_base=v["decode_step_ms"] / base_step)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    for case, v in out["cases"].items():
        print(f"{case:42s} decode step {v['decode_step_ms']:8.2f} ms  {v['vs_base']:5.2f}x base")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["base", "base-eager", "lora", "combine"])
    p.add_argument("files", nargs="*")
    p.add_argument("--model", default="/tmp/vllm-peer/smollm2-hf")
    p.add_argument("--adapters", default="/tmp/vllm-peer/adapters")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    combine(a) if a.mode == "combine" else bench(a)
