"""The engine end to end with each attention kernel: its logprobs against the reference
attention's (jnp, `--attention-backend reference`) on the same weights and prompts, and its
decode throughput, in one run (issue 68: the kernel table's choice confirmed by the engine,
not by the kernel benchmark alone).

    python benchmarks/bench_attention_agreement.py --model llama-3-8b --load-format dummy \\
        --dtype bfloat16 --batch-sizes 1 256 --input-len 32 --output-len 128 \\
        --kernels triton,mosaic [engine flags] [--output-json F]

Each kernel runs in its own process (`--attention-backend pallas` with $JAXSERVE_PALLAS_KERNEL
set, or `cpu`: the C++ kernel of XLA:CPU; the reference first), greedy, every batch size in
turn: one untimed generate, then one timed. Dummy weights give near-tied logits, so tokens
may part ways: compared are the prompt tokens' logprobs (prefill, teacher-forced) and the
chosen tokens' logprobs up to and including the first step where the kernel's token differs
from the reference's (decode; each such step's logprob is its top logprob, so a tie that
flips the token still compares equal). Prints, per kernel and batch size,

    # agreement KERNEL batch B: prompt max |dlogprob| X, decode max |dlogprob| Y over N steps
      (tokens equal at Z% of steps), T tok/s (reference R tok/s)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from jaxserve.benchmarks.common import random_prompt_ids


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default="triton,mosaic")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # KERNEL:JSON_PATH
    return parser.parse_known_args(argv)  # the rest: engine flags (jaxserve serve's)


def worker(args: argparse.Namespace, engine_argv: list[str], kernel: str, out: str) -> None:
    """One kernel's runs: per batch size, prompt and output logprobs of a timed generate."""
    from jaxserve.entrypoints.cli_args import add_engine_args, engine_args_from
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    backend = kernel if kernel in ("reference", "cpu") else "pallas"
    parser = add_engine_args(argparse.ArgumentParser())
    parser.add_argument("--model", default=None)
    engine = engine_args_from(parser.parse_args([*engine_argv, "--attention-backend", backend]))
    llm = LLM(**vars(engine))
    vocab = llm.llm_engine.config.model.vocab_size
    params = SamplingParams(
        temperature=0, max_tokens=args.output_len, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    runs = {}
    for b in args.batch_sizes:
        prompts = [{"prompt_token_ids": p} for p in random_prompt_ids(b, args.input_len, vocab)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        runs[b] = dict(
            seconds=seconds,
            prompt=[
                [
                    lp[t].logprob
                    for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)
                ]
                for o in outs
            ],
            tokens=[list(o.outputs[0].token_ids) for o in outs],
            decode=[
                [
                    lp[t].logprob
                    for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
                ]
                for o in outs
            ],
        )
    with open(out, "w") as f:
        json.dump({"kernel": kernel, "runs": runs}, f)


def compare(ref: dict, got: dict, batch: int, output_len: int) -> dict:
    """Max |logprob difference| of the prompt tokens and of the decode steps up to each
    request's first differing token (included), the share of steps with equal tokens."""
    prompt = max(
        (
            abs(a - b)
            for r, g in zip(ref["prompt"], got["prompt"], strict=True)
            for a, b in zip(r, g, strict=True)
        ),
        default=0.0,
    )
    decode, compared, equal = 0.0, 0, 0
    for rt, gt, rl, gl in zip(
        ref["tokens"], got["tokens"], ref["decode"], got["decode"], strict=True
    ):
        for i in range(len(rt)):
            decode = max(decode, abs(rl[i] - gl[i]))
            compared += 1
            if rt[i] != gt[i]:
                break
            equal += 1
    tokens = batch * output_len
    return dict(
        prompt_max_abs=prompt,
        decode_max_abs=decode,
        decode_steps=compared,
        tokens_equal=equal / compared if compared else 1.0,
        tok_s=tokens / got["seconds"],
        reference_tok_s=tokens / ref["seconds"],
    )


def main(argv: list[str] | None = None) -> dict:
    args, engine_argv = parse_args(argv)
    if args.worker:
        kernel, out = args.worker.split(":", 1)
        worker(args, engine_argv, kernel, out)
        return {}
    kernels = ["reference", *args.kernels.split(",")]
    forwarded = argv if argv is not None else sys.argv[1:]  # (a worker writes no --output-json)
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for kernel in kernels:
            out = os.path.join(tmp, f"{kernel}.json")
            env = dict(os.environ)
            if kernel not in ("reference", "cpu"):
                env["JAXSERVE_PALLAS_KERNEL"] = kernel
            command = [
                sys.executable,
                os.path.abspath(__file__),
                *forwarded,
                "--worker",
                f"{kernel}:{out}",
            ]
            proc = subprocess.run(command, env=env)
            if proc.returncode != 0 or not os.path.exists(out):
                print(f"# agreement {kernel}: failed (exit {proc.returncode})", flush=True)
                continue
            with open(out) as f:
                results[kernel] = json.load(f)["runs"]
    ref = results.get("reference")
    for kernel in kernels[1:]:
        if ref is None or kernel not in results:
            continue
        for b in args.batch_sizes:
            row = dict(
                kernel=kernel,
                batch=b,
                **compare(ref[str(b)], results[kernel][str(b)], b, args.output_len),
            )
            rows.append(row)
            print(
                f"# agreement {kernel} batch {b}: prompt max |dlogprob| "
                f"{row['prompt_max_abs']:.2e}, decode max |dlogprob| {row['decode_max_abs']:.2e}"
                f" over {row['decode_steps']} steps (tokens equal at {row['tokens_equal']:.0%} "
                f"of steps), {row['tok_s']:.1f} tok/s (reference {row['reference_tok_s']:.1f} "
                "tok/s)",
                flush=True,
            )
    summary = {"rows": rows, "args": vars(args), "engine_args": engine_argv}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=1)
    if ref is None or len(results) < len(kernels):
        raise SystemExit(1)
    return summary


if __name__ == "__main__":
    main()
