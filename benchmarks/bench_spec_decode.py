"""Speculative decoding on the default model: output tokens/s with and without ngram drafts,
side by side in one process (engines alternated, medians), with acceptance rates.

  - grounded, batch 1: chat requests that edit or repeat a given text (the output copies the
    prompt, so drafts are often right), one request at a time, greedy, natural stops;
  - random, batch B: B random-token prompts generating a fixed number of tokens
    (temperature 1, ignore_eos), where drafts are seldom right and only cost.

    .venv/bin/python benchmarks/bench_spec_decode.py --output-json \\
        benchmarks/results/spec-decode-cpu-2026-11-24.json
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

import numpy as np  # noqa: E402

from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402

TEXTS = [
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. It was constructed as the centrepiece of the 1889 World's Fair.",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon "
    "dioxide and water. It takes place in the chloroplasts and releases oxygen as a by-product. "
    "Almost all life on Earth depends on it, directly or indirectly.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    total = 0\n    for v in values:\n        total += (v - m) ** 2\n"
    "    return total / len(values)\n",
]
TASKS = [
    "Rewrite the following text, replacing every 'the' with 'THE':\n\n{}",
    "Repeat the following text exactly:\n\n{}",
    "Fix any typos in the following text and return it in full:\n\n{}",
]


def grounded_chats() -> list[list[dict]]:
    return [[{"role": "user", "content": t.format(x)}] for t in TASKS for x in TEXTS]


class Acceptance:
    """Draft and accepted tokens summed over every step of an engine."""

    def __init__(self, llm: LLM):
        self.drafts = self.drafted = self.accepted = 0
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        make = sched.make_stats

        def counting():
            stats = make()
            if (spec := stats.spec_decoding) is not None:
                self.drafts += spec.num_drafts
                self.drafted += spec.num_draft_tokens
                self.accepted += spec.num_accepted_tokens
            return stats

        sched.make_stats = counting

    def snapshot(self) -> tuple[int, int, int]:
        return self.drafts, self.drafted, self.accepted


def timed(llm: LLM, prompts, params, chat: bool) -> tuple[float, int]:
    start = time.perf_counter()
    run = llm.chat if chat else llm.generate
    outs = run(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160, help="grounded task")
    parser.add_argument("--batch-size", type=int, default=32, help="random task")
    parser.add_argument("--input-len", type=int, default=128, help="random task")
    parser.add_argument("--output-len", type=int, default=64, help="random task")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", default="grounded,random")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
    }
    common = dict(max_model_len=1024, max_num_seqs=args.batch_size, max_num_batched_tokens=1024)
    engines = {"plain": LLM(**common), "ngram": LLM(**common, speculative_config=spec)}
    acceptance = Acceptance(engines["ngram"])

    chats = grounded_chats()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rng = np.random.default_rng(0)
    vocab = engines["plain"].get_tokenizer().vocab_size
    random_prompts = [
        {"prompt_token_ids": rng.integers(100, vocab - 100, args.input_len).tolist()}
        for _ in range(args.batch_size)
    ]
    sampled = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    for llm in engines.values():  # warm-up
        timed(llm, chats[:1], greedy, chat=True)
        timed(llm, random_prompts, sampled, chat=False)

    rows = {}
    for task in args.tasks.split(","):
        samples = {name: [] for name in engines}
        accepted_before = acceptance.snapshot()
        for _ in range(args.rounds):
            for name, llm in engines.items():  # alternated
                if task == "grounded":  # batch 1: one request at a time
                    runs = [timed(llm, [c], greedy, chat=True) for c in chats]
                    seconds, tokens = sum(r[0] for r in runs), sum(r[1] for r in runs)
                else:
                    seconds, tokens = timed(llm, random_prompts, sampled, chat=False)
                samples[name].append(tokens / seconds)
        drafts, drafted, accepted = (
            a - b for a, b in zip(acceptance.snapshot(), accepted_before, strict=True)
        )
        tok_s = {name: statistics.median(v) for name, v in samples.items()}
        rows[task] = {
            "batch_size": 1 if task == "grounded" else args.batch_size,
            "output_tok_s": tok_s,
            "all_tok_s": samples,
            "speedup": tok_s["ngram"] / tok_s["plain"],
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        }
        print(task, json.dumps(rows[task]), flush=True)
    result = {
        "command": shlex.join(["python", *sys.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "speculative_config": spec,
        "tasks": rows,
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
