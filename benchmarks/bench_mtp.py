"""Speculative method `mtp` on CPU: output tokens/s of a DeepSeek-V3-shaped model with and
without its MTP layer drafting, and with it under async scheduling (the next step scheduled
while one runs, its drafts read on the devices), side by side in one process (engines
alternated, medians), and the share of drafts accepted.

The model is random (transformers' DeepseekV3ForCausalLM, saved by it) with one decoder layer
and an MTP layer built to reproduce the target's next token: its block a copy of layer 0,
eh_proj = [I | small], enorm ones, shared_head.norm the final norm, embeddings of rms 1 (so
enorm keeps them). Acceptance is high by construction and the speed-up is the method's: a
draft step costs one layer where the target costs one layer plus the LM head, so the gain is
bounded by how much cheaper a verify step of k + 1 tokens is than k + 1 steps of one.

    .venv/bin/python benchmarks/bench_mtp.py --output-json \\
        benchmarks/results/mtp-async-cpu-2026-12-05.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAXSERVE_ENABLE_MULTIPROCESSING", "0")  # the core in this process

import numpy as np  # noqa: E402
import torch  # noqa: E402

from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
             first_k_dense_replace=0, routed_scaling_factor=2.5,
             max_position_embeddings=1024)  # fmt: skip


def make_model(out_dir: Path) -> Path:
    """A 1-layer DeepSeek-V3 with an MTP layer that predicts its next token (module doc)."""
    import transformers
    from safetensors.torch import load_file, save_file

    config = transformers.DeepseekV3Config(**SHAPE, num_hidden_layers=2)
    config.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.08)
    model.save_pretrained(out_dir)
    weights = load_file(str(out_dir / "model.safetensors"))
    d, prefix = SHAPE["hidden_size"], "model.layers.1."
    emb = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
    for name in [n for n in weights if n.startswith(prefix)]:
        weights[name] = weights[name.replace(prefix, "model.layers.0.")].clone()
    # the target's feature counts a little (about 0.4 of the embedding's rms)
    small = torch.randn(d, d, generator=torch.Generator().manual_seed(2)) * 0.4 / d**0.5
    weights.update(
        {
            prefix + "enorm.weight": torch.ones(d),
            prefix + "hnorm.weight": torch.ones(d),
            prefix + "eh_proj.weight": torch.cat([torch.eye(d), small], dim=1),
            prefix + "shared_head.norm.weight": weights["model.norm.weight"].clone(),
            prefix + "shared_head.head.weight": weights["lm_head.weight"].clone(),
        }
    )
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg.update(num_hidden_layers=1, num_nextn_predict_layers=1)
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return out_dir


def accepted_share(llm: LLM) -> list[int]:
    """[drafted, accepted] summed over the engine's steps from now on (its stats hook)."""
    counts = [0, 0]
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    make = sched.make_stats

    def counting():
        stats = make()
        if (spec := stats.spec_decoding) is not None:
            counts[0] += spec.num_draft_tokens
            counts[1] += spec.num_accepted_tokens
        return stats

    sched.make_stats = counting
    return counts


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-speculative-tokens", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    path = make_model(Path(tempfile.mkdtemp()) / "deepseek-mtp")
    engine = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, dtype="float32")
    spec = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
    llms = {
        "none": LLM(str(path), **engine),
        "mtp": LLM(str(path), **engine, speculative_config=spec),
        "mtp_async": LLM(str(path), **engine, speculative_config=spec, async_scheduling=True),
    }
    counts = accepted_share(llms["mtp"])
    counts_async = accepted_share(llms["mtp_async"])
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rng = np.random.default_rng(0)
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        prompts = [
            {"prompt_token_ids": rng.integers(0, SHAPE["vocab_size"], args.input_len).tolist()}
            for _ in range(b)
        ]
        for llm in llms.values():
            llm.generate(prompts, params, use_tqdm=False)  # warm-up
        times = {name: [] for name in llms}
        outs = {}
        before, before_async = list(counts), list(counts_async)
        for _ in range(args.rounds):
            for name, llm in llms.items():
                start = time.perf_counter()
                outs[name] = llm.generate(prompts, params, use_tqdm=False)
                times[name].append(time.perf_counter() - start)
        ids = {name: [o.outputs[0].token_ids for o in out] for name, out in outs.items()}
        drafted, accepted = counts[0] - before[0], counts[1] - before[1]
        drafted_async = counts_async[0] - before_async[0]
        accepted_async = counts_async[1] - before_async[1]
        tok = b * args.output_len
        row = {
            "batch_size": b,
            **{f"tok_s_{name}": tok / statistics.median(times[name]) for name in llms},
            "acceptance": accepted / max(drafted, 1),
            "acceptance_async": accepted_async / max(drafted_async, 1),
            "greedy_equal": ids["none"] == ids["mtp"] == ids["mtp_async"],
        }
        row["speedup"] = row["tok_s_mtp"] / row["tok_s_none"]
        row["async_over_sync_mtp"] = row["tok_s_mtp_async"] / row["tok_s_mtp"]
        row["drafted"], row["accepted"] = drafted, accepted
        print(json.dumps(row))
        rows.append(row)
    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "shape": SHAPE,
        "num_speculative_tokens": args.num_speculative_tokens,
        "rows": rows,
    }
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
