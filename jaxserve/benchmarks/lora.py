"""What LoRA adapters cost a decode step: the same batch through the base engine (no
--enable-lora) and through one with --enable-lora, its rows using 0, 1 or N distinct random
adapters of rank --max-lora-rank on every projection, in one run on one machine.

Each case is `generate()` of --batch-size random prompts of --input-len tokens to exactly
--output-len tokens (greedy, ignore_eos), the prefix cache reset before each (not timed); the
decode step is (median latency - median latency at one output token) / (output_len - 1), as
bench_latency derives it. Both engines are up at once and the cases run interleaved, round
after round, so the machine's drift hits them alike. Each engine compiles into a cache of its
own: the start-up times are cold. Engine flags are `jaxserve serve`'s.

    .venv/bin/python scripts/bench_lora.py --batch-size 32 --max-loras 8 --max-lora-rank 16
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxserve.benchmarks.common import (
    add_benchmark_args,
    benchmark_parser,
    decode_step_seconds,
    git_commit,
    machine,
    random_prompt_ids,
    write_json,
)
from jaxserve.config import ModelConfig
from jaxserve.entrypoints.cli_args import engine_args_from
from jaxserve.lora_request import LORA_TARGETS, LoRARequest

_MODULE = {"o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_random_adapter(path: Path, config: ModelConfig, r: int, seed: int) -> Path:
    """A PEFT-format adapter of rank r on every projection of `config`'s model, A and B
    drawn from N(0, 0.02)."""
    from safetensors.numpy import save_file

    hd, d, f = config.head_dim, config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    dims = {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for name in LORA_TARGETS:
            d_in, d_out = dims[name]
            prefix = f"base_model.model.model.layers.{layer}.{_MODULE.get(name, 'self_attn')}"
            w = lambda *s: (rng.standard_normal(s) * 0.02).astype(np.float32)  # noqa: E731
            tensors[f"{prefix}.{name}.lora_A.weight"] = w(r, d_in)
            tensors[f"{prefix}.{name}.lora_B.weight"] = w(d_out, r)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config_json = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": list(LORA_TARGETS),
    }
    (path / "adapter_config.json").write_text(json.dumps(config_json))
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = benchmark_parser("lora", __doc__)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-iters", type=int, default=5)
    add_benchmark_args(parser)
    args = parser.parse_args(argv)
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    base_args = dataclasses.replace(engine_args_from(args), enable_lora=False)
    lora_args = dataclasses.replace(
        base_args, enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank
    )
    results = {
        "commit": git_commit(),
        "machine": machine(),
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_loras": args.max_loras,
        "rank": args.max_lora_rank,
    }

    def start(engine_args) -> tuple[LLM, float]:
        """An engine and its start-up seconds, compiled into a cache of its own (cold)."""
        os.environ["JAXSERVE_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="bench-lora-xla-")
        fields = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}
        begin = time.perf_counter()
        llm = LLM(**fields)
        return llm, time.perf_counter() - begin

    (base, base_start), (lora, lora_start) = start(base_args), start(lora_args)
    results["startup_s"] = {"base": base_start, "enable_lora": lora_start}
    config = base.llm_engine.config.model
    prompts = [
        {"prompt_token_ids": p}
        for p in random_prompt_ids(args.batch_size, args.input_len, config.vocab_size, args.seed)
    ]
    tmp = tempfile.mkdtemp(prefix="bench-lora-")
    adapters = [
        LoRARequest(
            f"a{i}",
            i + 1,
            str(write_random_adapter(Path(tmp) / f"a{i}", config, args.max_lora_rank, i)),
        )
        for i in range(args.max_loras)
    ]
    cases = {
        "base (no --enable-lora)": (base, None),
        "--enable-lora, no adapter in the batch": (lora, None),
        "--enable-lora, 1 adapter": (lora, adapters[0]),
        f"--enable-lora, {args.max_loras} adapters": (
            lora,
            [adapters[i % args.max_loras] for i in range(args.batch_size)],
        ),
    }

    def run(case: str, n: int) -> float:
        llm, loras = cases[case]
        llm.llm_engine.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        begin = time.perf_counter()
        llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return time.perf_counter() - begin

    for case in cases:  # warm-up (and each adapter's first load)
        run(case, args.output_len)
    full, one = {c: [] for c in cases}, {c: [] for c in cases}
    for _ in range(args.num_iters):  # the cases interleaved: drift hits them alike
        for case in cases:
            full[case].append(run(case, args.output_len))
            one[case].append(run(case, 1))
    steps = {
        c: decode_step_seconds(float(np.median(full[c])), float(np.median(one[c])), args.output_len)
        for c in cases
    }
    first = steps["base (no --enable-lora)"]
    for case, step in steps.items():
        print(f"{case:42s} decode step {step * 1e3:8.2f} ms  {step / first:5.2f}x base")
    print(
        f"start-up: base {base_start:.1f} s, --enable-lora {lora_start:.1f} s "
        f"({lora_start / base_start:.2f}x), each with a cold compile cache"
    )
    results["cases"] = {
        c: {"decode_step_ms": v * 1e3, "vs_base": v / first} for c, v in steps.items()
    }
    for llm in (base, lora):
        llm.llm_engine.shutdown()
    if args.output_json:
        write_json(args.output_json, results)
    return results
