"""Write the bundled default model (SmolLM2-135M-Instruct GGUF) as an fp32 HF directory
(config.json, model.safetensors, tokenizer), so every engine of a comparison reads the same
weights: vLLM's CPU build cannot read the GGUF, jaxserve and HF read either.

transformers dequantises the GGUF (this needs torch: the test extra) but refuses to
`save_pretrained` a GGUF-loaded model, so a fresh model is built from its config (without the
quantization config) and given the loaded weights.

    .venv/bin/python benchmarks/export_hf_dir.py /tmp/smollm2-hf
"""

from __future__ import annotations

import argparse
from pathlib import Path


def export(dst: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxserve.transformers_utils.model_path import default_model_path

    gguf = default_model_path()
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dst)
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dst", type=Path, help="directory to write")
    print(export(parser.parse_args().dst))


if __name__ == "__main__":
    main()
