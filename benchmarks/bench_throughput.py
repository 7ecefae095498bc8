"""Offline throughput, vLLM `bench throughput` style, with HF transformers as the peer.

Random prompt token ids of --input-len, --output-len tokens each (ignore_eos), all submitted
at once; prints `Throughput: X requests/s, Y total tokens/s, Z output tokens/s`.
`--backend hf` runs the same prompts through transformers' `generate` (one padded-free batch of
--num-prompts, since all prompts have the same length) in fp32, for a same-run comparison.

    .venv/bin/python benchmarks/bench_throughput.py --num-prompts 32 --input-len 32 \
        --output-len 128 --backend jaxserve
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np


def run_jaxserve(args, prompts: list[list[int]]) -> float:
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    llm = LLM(
        args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
    )  # fmt: skip
    params = SamplingParams(
        n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len
    )
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=not args.quiet)
    return time.perf_counter() - start


def run_hf(args, prompts: list[list[int]]) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.models.loader import default_model_path

    if args.model is None:
        path = default_model_path()
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    kwargs = dict(
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
        max_new_tokens=args.output_len, min_new_tokens=args.output_len,
        num_return_sequences=args.n, pad_token_id=0,
    )  # fmt: skip
    with torch.no_grad():
        model.generate(torch.tensor(prompts[:1]), **{**kwargs, "max_new_tokens": 2,
                                                      "min_new_tokens": 2})  # fmt: skip
        start = time.perf_counter()
        out = model.generate(torch.tensor(prompts), **kwargs)
    assert out.shape[1] == args.input_len + args.output_len
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=["jaxserve", "hf"], default="jaxserve")
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(100, 20000, (args.num_prompts, args.input_len)).tolist()
    elapsed = (run_hf if args.backend == "hf" else run_jaxserve)(args, prompts)
    requests = args.num_prompts
    out_tokens = requests * args.n * args.output_len
    total_tokens = requests * args.input_len + out_tokens
    print(
        f"Throughput: {requests / elapsed:.2f} requests/s, {total_tokens / elapsed:.2f} total "
        f"tokens/s, {out_tokens / elapsed:.2f} output tokens/s"
    )
    print(f"({args.backend}, {platform.processor() or platform.machine()}, {elapsed:.1f} s)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                dict(backend=args.backend, elapsed_time=elapsed, num_requests=requests,
                     total_num_tokens=total_tokens, requests_per_second=requests / elapsed,
                     tokens_per_second=total_tokens / elapsed,
                     output_tokens_per_second=out_tokens / elapsed, args=vars(args)),
                f, indent=2,
            )  # fmt: skip


if __name__ == "__main__":
    main()
