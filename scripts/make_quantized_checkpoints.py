"""Make the tiny quantized checkpoints the suite reads (tests/data/quantized/), with the
formats' own tools, once: never run by the suite.

    # 1. the float model and its byte tokenizer, in jaxserve's venv (tests/helpers.py)
    .venv/bin/python scripts/make_quantized_checkpoints.py base /tmp/qbase
    # 2. quantized by llm-compressor, in a venv of its own (it pins its own transformers)
    python3 -m venv /tmp/lcvenv && /tmp/lcvenv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    /tmp/lcvenv/bin/python scripts/make_quantized_checkpoints.py quantize /tmp/qbase \
        tests/data/quantized

Each checkpoint directory also holds `reference_logits.npz`: transformers' float32 logits of
the checkpoint as its own library (compressed-tensors) decompresses it, for fixed prompts, so
the suite compares against the format's maintained code without installing it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# A tiny Llama whose every linear input size is a multiple of the int4 group (32)
SHAPES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256)  # fmt: skip
PROMPTS = [list(range(3, 14)), list(range(40, 57)), [7, 100, 200, 33, 45, 46, 47]]
# name -> (symmetric, group size): llm-compressor's W4A16 and W4A16_ASYM with these groups
SCHEMES = {"ct-w4a16-g32": (True, 32), "ct-w4a16-asym-g64": (False, 64)}
CALIBRATION = [
    f"Sentence {i}: the {w} {v} over the {o} while it {t}."
    for i, (w, v, o, t) in enumerate(
        [(w, v, o, t) for w in ("quick fox", "old man", "red car", "tall tree")
         for v in ("jumps", "looks", "runs") for o in ("lazy dog", "river", "hill")
         for t in ("rains", "snows")][:48]
    )
]  # fmt: skip


def base(out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers import make_tiny_hf, make_tiny_tokenizer

    out_dir = Path(out)
    make_tiny_hf("llama", out_dir, vocab_size=make_tiny_tokenizer(out_dir), **SHAPES)


def quantize(base_dir: str, out: str) -> None:
    import numpy as np
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    data = Dataset.from_dict({"text": CALIBRATION}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=64),
        remove_columns=["text"],
    )
    for name, (symmetric, group) in SCHEMES.items():
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
                   "group_size": group}  # fmt: skip
        recipe = GPTQModifier(
            ignore=["lm_head"],
            config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
        )
        oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=len(data))
        dst = Path(out) / name
        model.save_pretrained(dst, save_compressed=True)
        tokenizer.save_pretrained(dst)
        ref = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = {f"prompt_{i}": ref(torch.tensor([p])).logits[0].numpy()
                      for i, p in enumerate(PROMPTS)}  # fmt: skip
        np.savez_compressed(dst / "reference_logits.npz", **logits)
        (dst / "reference_prompts.json").write_text(json.dumps(PROMPTS))
        print(name, "->", dst)


if __name__ == "__main__":
    {"base": base, "quantize": quantize}[sys.argv[1]](*sys.argv[2:])
