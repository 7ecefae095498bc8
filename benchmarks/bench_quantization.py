"""Weight-only quantization and the fp8 KV cache on the default model: memory, agreement,
quality and speed against full precision, each mode in its own engine in this process.
Modes: none, int8, fp8 (weights), kv-fp8 (full-precision weights, `kv_cache_dtype="fp8"`),
and three checkpoint formats kept as stored, written from the model's HF weights (transformers'
dequantization of the GGUF) into --work first: fp8_block (transformers' `quant_method: fp8`,
64 x 64 blocks: the default model's 576-wide layers hold no 128 x 128 ones), int4
(compressed-tensors pack-quantized W4A16, symmetric, group 64, round-to-nearest; GPTQ and
AWQ checkpoints load into the same kernel) and mxfp4 (compressed-tensors mxfp4-pack-quantized,
OCP MX rounding to nearest; these three are written here, not by their libraries: for speed
and memory, and quality as this rounding gives it).

  - weights: bytes of the model's parameters on the device; KV cache bytes per token;
  - greedy agreement: 64 greedy tokens on each of 4 chat prompts, tokens equal to full
    precision's at the same position (counted up to the first difference, and in total);
  - mean logprob of a fixed ~330-token text (its prompt logprobs: a perplexity-style check),
    and its change against full precision;
  - decode speed: output tokens/s of a batch of --batches prompts (default 1 and 8) each
    generating 64 tokens (ignore_eos), median of --iters runs after a warm-up (--iters 0:
    quality only).

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


def run(
    mode: str,
    iters: int,
    max_num_batched_tokens: int | None = None,
    batches: tuple[int, ...] = (1, 8),
    work: str = "/tmp/bench-quantization",
) -> dict:
    model, quantization = None, None if mode in ("none", "kv-fp8") else mode
    if mode in CHECKPOINT_FORMATS:
        model, quantization = write_checkpoint(mode, work), None
    kv_cache_dtype = "fp8" if mode == "kv-fp8" else "auto"
    llm = LLM(
        model, max_num_seqs=max(8, *batches), max_model_len=512, quantization=quantization,
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
    speeds = {}
    for size in batches if iters else ():
        batch_prompts = (prompts * size)[:size]
        llm.generate(batch_prompts, batch, use_tqdm=False)  # warm-up
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            llm.generate(batch_prompts, batch, use_tqdm=False)
            times.append(time.perf_counter() - start)
        speeds[size] = size * 64 / statistics.median(times)
    result = {
        "mode": mode,
        "weight_mib": weights / 2**20,
        "kv_bytes_per_token": kv_per_token,
        "tokens": [o.outputs[0].token_ids for o in greedy],
        "mean_logprob": float(np.mean(logprobs)),
        **{f"decode_tok_s_b{size}": speed for size, speed in speeds.items()},
    }
    del llm, core
    return result


CHECKPOINT_FORMATS = ("fp8_block", "int4", "mxfp4")
GROUP = 64  # the default model's widths (576, 1536, 192) are multiples of 64, not of 128
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # OCP FP4 magnitudes, codes 0-7


def mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (e2m1 codes uint8 [out, in / 2], the even input in the low nibble;
    e8m0 exponents uint8 [out, in / 32]): OCP MX's shared exponent floor(log2 amax) - 2
    (e2m1's largest exponent), each value rounded to the nearest code, saturated at 6."""
    out, d_in = w.shape
    groups = w.reshape(out, d_in // 32, 32)
    amax = np.maximum(np.abs(groups).max(axis=2), 2.0**-126)
    exp = np.clip(np.floor(np.log2(amax)) - 2, -127, 127)  # [out, in / 32]
    x = np.abs(groups) / 2.0 ** exp[..., None]
    code = np.abs(x[..., None] - E2M1).argmin(axis=-1)  # nearest magnitude
    code = (code | ((groups < 0) << 3)).reshape(out, d_in).astype(np.uint8)
    return code[:, 0::2] | (code[:, 1::2] << 4), (exp + 127).astype(np.uint8)


def write_checkpoint(mode: str, work: str) -> str:
    """The default model's HF weights (transformers' dequantization of the GGUF) saved in
    `mode`'s checkpoint layout under work/mode (once)."""
    from pathlib import Path

    import ml_dtypes
    import torch
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxserve.transformers_utils.model_path import default_model_path

    dst = Path(work) / mode
    if (dst / "config.json").exists():
        return str(dst)
    gguf = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)  # fmt: skip
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dst)
    config = model.config.to_dict()  # a GGUF-loaded model does not save_pretrained itself
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    tensors = {k: v.numpy() for k, v in model.state_dict().items()}
    linears = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in linears]:
        w = tensors.pop(name)
        out, d_in = w.shape
        base = name.removesuffix("weight")
        if mode == "fp8_block":
            blocks = w.reshape(out // GROUP, GROUP, d_in // GROUP, GROUP)
            scale = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / 448.0
            q = (blocks / scale[:, None, :, None]).reshape(out, d_in)
            tensors[name] = q.astype(ml_dtypes.float8_e4m3fn)
            tensors[base + "weight_scale_inv"] = scale.astype(np.float32)
        elif mode == "mxfp4":
            tensors[base + "weight_packed"], tensors[base + "weight_scale"] = mxfp4(w)
        else:  # int4: q in [-8, 7] stored as q + 8, eight nibbles an int32, low bits first
            groups = w.reshape(out, d_in // GROUP, GROUP)
            scale = np.maximum(np.abs(groups).max(axis=2), 1e-12) / 7.0  # [out, in / group]
            q = np.clip(np.rint(groups / scale[..., None]), -8, 7).reshape(out, d_in)
            u = (q + 8).astype(np.uint32).reshape(out, d_in // 8, 8)
            words = (u << (4 * np.arange(8, dtype=np.uint32))).sum(axis=2, dtype=np.uint32)
            tensors[base + "weight_packed"] = words.view(np.int32)
            tensors[base + "weight_scale"] = scale.astype(np.float32)
            tensors[base + "weight_shape"] = np.array([out, d_in], np.int64)
    if "lm_head.weight" in tensors and model.config.tie_word_embeddings:
        del tensors["lm_head.weight"]
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, dst / "model.safetensors")
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": GROUP}  # fmt: skip
    if mode == "mxfp4":
        weights = {**weights, "type": "float", "group_size": 32}
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [GROUP, GROUP],
    } if mode == "fp8_block" else {
        "quant_method": "compressed-tensors", "ignore": ["lm_head"],
        "format": "mxfp4-pack-quantized" if mode == "mxfp4" else "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="none,int8,fp8,kv-fp8")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--batches", default="1,8", help="decode batch sizes, comma-separated")
    parser.add_argument("--work", default="/tmp/bench-quantization",
                        help="where the fp8_block / int4 checkpoints are written")  # fmt: skip
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    rows = [run(m, args.iters, args.max_num_batched_tokens, batches, args.work)
            for m in args.modes.split(",")]  # fmt: skip
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
        for size in batches if args.iters else ():
            key = f"decode_tok_s_b{size}"
            r[f"speed_vs_full_b{size}"] = r[key] / base[key]
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
