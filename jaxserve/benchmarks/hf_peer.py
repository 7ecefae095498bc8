"""HF transformers as the peer in the benchmarks: the same model and prompts through `generate`.

torch is a test-only dependency (the `test` extra); it is imported only when the peer runs.
"""

from __future__ import annotations

from typing import Any

from jaxserve.transformers_utils.model_path import resolve_model_path

_TORCH_DTYPES = {
    "auto": "float32",
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


def load_hf_model(
    model: str | None,
    *,
    dtype: str = "auto",
    load_format: str = "auto",
    hf_overrides: dict | None = None,
    device: str | None = None,
) -> Any:
    """The model as a transformers module in eval mode. dtype "auto" is float32, as jaxserve's
    is on CPU; load_format "dummy" builds it from its config with HF's random init, with
    hf_overrides (--hf-overrides) set over the config's fields. device (e.g. "cuda"): where
    it is built (a dummy model's random init runs there) or loaded; default the CPU."""
    import contextlib

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, _TORCH_DTYPES[dtype])
    path = resolve_model_path(model, load_format)
    if load_format == "dummy":
        if path.is_file():  # a GGUF: its config, from the file's metadata
            from jaxserve.transformers_utils.config import read_model_config

            config = read_model_config(path).hf_config.to_transformers()
        else:
            config = AutoConfig.from_pretrained(path, **(hf_overrides or {}))
        with torch.device(device) if device else contextlib.nullcontext():
            return AutoModelForCausalLM.from_config(config, dtype=torch_dtype).eval()
    place = dict(device_map=device) if device else {}
    if path.is_file():
        return AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch_dtype, **place
        ).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **place).eval()


def hf_generate(
    model: Any,
    prompts: list[list[int]],
    output_len: int,
    n: int = 1,
    *,
    cache_implementation: str | None = None,
) -> None:
    """Sample exactly output_len tokens (temperature 1, no top-k / top-p, EOS ignored through
    min_new_tokens) for each of n samples of every prompt, as one batch; all prompts have the
    same length, so there is no padding. cache_implementation "static": transformers' static
    KV cache, whose decode forward generate compiles itself on a GPU (not on the CPU). Returns
    when every token is out (on a GPU, synchronised)."""
    import torch

    extra = dict(cache_implementation=cache_implementation) if cache_implementation else {}
    with torch.no_grad():
        out = model.generate(
            torch.tensor(prompts, device=model.device),
            attention_mask=torch.ones(
                len(prompts), len(prompts[0]), dtype=torch.long, device=model.device
            ),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            num_return_sequences=n,
            pad_token_id=0,
            **extra,
        )
    if out.device.type == "cuda":
        torch.cuda.synchronize()
    if out.shape != (len(prompts) * n, len(prompts[0]) + output_len):
        raise RuntimeError(f"HF generate returned shape {tuple(out.shape)}")
