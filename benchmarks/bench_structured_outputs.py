"""What structured outputs cost: output tokens/s of one batch with and without a JSON schema.

Both runs generate exactly the same number of tokens per request: the constrained run goes
first (each request stops when its JSON is complete), then the free run asks each request for
that many tokens with ignore_eos, so the batch shrinks the same way in both. Same prompts,
temperature 1.0, seeded. Also reports the host time spent building the token bitmasks per step
(StructuredOutputManager.bitmask_seconds / bitmask_steps).

    .venv/bin/python benchmarks/bench_structured_outputs.py --batch-size 32 --rounds 3 \\
        --output-json benchmarks/results/structured-outputs-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("JAXSERVE_ENABLE_MULTIPROCESSING", "0")  # the core in this process

from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "student": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
    },
    "required": ["name", "age", "height", "student", "color", "hobbies"],
    "additionalProperties": False,
}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    llm = LLM(max_num_seqs=args.batch_size, max_model_len=1024)
    manager = llm.llm_engine.engine_core.engine_core.structured_output_manager
    prompts = [
        [{"role": "user", "content": f"Describe person number {i} as JSON."}]
        for i in range(args.batch_size)
    ]
    so = StructuredOutputsParams(json=SCHEMA)

    def constrained(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens,
                              structured_outputs=so)  # fmt: skip

    llm.chat(prompts, [constrained(i) for i in range(len(prompts))], use_tqdm=False)  # warm-up
    rows = []
    for _ in range(args.rounds):  # alternated: constrained, then free with the same lengths
        manager.bitmask_seconds, manager.bitmask_steps = 0.0, 0
        start = time.perf_counter()
        outs = llm.chat(prompts, [constrained(i) for i in range(len(prompts))], use_tqdm=False)
        t_constrained = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        valid = sum(_valid(o.outputs[0].text) for o in outs)
        mask_ms = 1e3 * manager.bitmask_seconds / max(manager.bitmask_steps, 1)
        free = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
            for i, n in enumerate(lengths)
        ]
        start = time.perf_counter()
        outs = llm.chat(prompts, free, use_tqdm=False)
        t_free = time.perf_counter() - start
        assert [len(o.outputs[0].token_ids) for o in outs] == lengths
        tokens = sum(lengths)
        rows.append({
            "tokens": tokens, "constrained_s": t_constrained, "free_s": t_free,
            "constrained_tok_s": tokens / t_constrained, "free_tok_s": tokens / t_free,
            "bitmask_ms_per_step": mask_ms, "valid_json": valid,
        })  # fmt: skip
        print(json.dumps(rows[-1]))
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "batch_size": args.batch_size,
        "rounds": rows,
        "median_constrained_tok_s": statistics.median(r["constrained_tok_s"] for r in rows),
        "median_free_tok_s": statistics.median(r["free_tok_s"] for r in rows),
        "median_bitmask_ms_per_step": statistics.median(r["bitmask_ms_per_step"] for r in rows),
    }
    result["slowdown"] = 1 - result["median_constrained_tok_s"] / result["median_free_tok_s"]
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


if __name__ == "__main__":
    main()
