"""HF transformers as the decode-step peer, on the same device as jaxserve, in the GPU suite.

The model built from its config (`--load-format dummy`: HF's random init, on the device) in
--dtype; for each batch size (--batch-sizes, in that order: the headline first, so a run cut
off by its time limit still reports it), --batch-size prompts of --input-len random ids, then
`generate(..., cache_implementation="static")` (transformers compiles the static-cache decode
forward itself on a GPU; nothing else is compiled) sampling exactly --output-len tokens, and
the same at one token. After one untimed run at each length (the compile), --iters runs at
each, alternating; the decode step is (median latency at --output-len - median at one token)
/ (output_len - 1), as scripts/bench_latency.py derives jaxserve's. Prints a line a batch:

    HF peer: batch B: decode step X ms, Y tokens/s (latency Z s at N tokens, W s at 1)

    python benchmarks/bench_hf_peer.py --model llama-3-8b --load-format dummy \\
        --dtype bfloat16 --batch-sizes 32 1 8 --output-json hf.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from jaxserve.benchmarks.common import decode_step_seconds, random_prompt_ids
from jaxserve.benchmarks.hf_peer import hf_generate, load_hf_model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 1, 8])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=3, help="timed runs at each length")
    parser.add_argument("--cache-implementation", default="static",
                        help='"static" (compiled decode on a GPU); "dynamic": eager')  # fmt: skip
    parser.add_argument("--device", default=None, help="default: cuda when torch sees one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    import torch
    import transformers

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    model = load_hf_model(args.model, dtype=args.dtype, load_format=args.load_format,
                          device=device)  # fmt: skip
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"# HF transformers {transformers.__version__}, torch {torch.__version__} on {name}; "
          f"{args.model} ({args.load_format}) {args.dtype}, cache {args.cache_implementation}; "
          f"built in {time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
    cache = None if args.cache_implementation == "dynamic" else args.cache_implementation
    results = dict(device=name, transformers=transformers.__version__, torch=torch.__version__,
                   args=vars(args), batches=[])  # fmt: skip
    for batch in args.batch_sizes:
        prompts = random_prompt_ids(batch, args.input_len, model.config.vocab_size, args.seed)

        def latency(output_len: int, prompts=prompts) -> float:
            t0 = time.perf_counter()
            hf_generate(model, prompts, output_len, cache_implementation=cache)
            return time.perf_counter() - t0

        t0 = time.perf_counter()
        latency(args.output_len), latency(1)  # the compile, untimed
        warmup_s = time.perf_counter() - t0
        long, short = [], []
        for _ in range(args.iters):
            long.append(latency(args.output_len))
            short.append(latency(1))
        step = decode_step_seconds(float(np.median(long)), float(np.median(short)),
                                   args.output_len)  # fmt: skip
        row = dict(batch=batch, decode_step_ms=1e3 * step, tokens_per_s=batch / step,
                   latency_s=long, one_token_s=short, warmup_s=warmup_s)  # fmt: skip
        results["batches"].append(row)
        print(f"HF peer: batch {batch}: decode step {1e3 * step:.2f} ms, {batch / step:.1f} "
              f"tokens/s (latency {np.median(long):.4f} s at {args.output_len} tokens, "
              f"{np.median(short):.4f} s at 1; warm-up {warmup_s:.1f} s)", flush=True)  # fmt: skip
        if args.output_json:  # after every batch: a run cut short keeps what it measured
            with open(args.output_json, "w") as f:
                json.dump(results, f, indent=2)
                f.write("\n")
    return results


if __name__ == "__main__":
    main()
