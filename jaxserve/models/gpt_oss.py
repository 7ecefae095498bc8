"""gpt-oss (GptOssForCausalLM): Llama-style GQA attention with biases on q/k/v and the output
projection, a learned attention sink per query head (layers/attention.py) and sliding windows
of 128 tokens on alternate layers (`layer_types`); a mixture of experts on every layer whose
router and experts have biases and whose experts compute a clamped SwiGLU (config/moe.py).

The checkpoints OpenAI ships keep the experts in MXFP4 (`quantization_config.quant_method:
mxfp4`): each expert projection as `*_blocks` uint8 [E, out, in / 32, 16] (two e2m1 codes a
byte, the low nibble first) and `*_scales` uint8 [E, out, in / 32] (e8m0 exponents, 2 ** (s -
127)); they stay packed (FusedMoE's `w13` / `w2` kernels [E, in / 2, out] and `w13_scale` /
`w2_scale` [E, in / 32, out], config.expert_quant "mxfp4"), or, where tensor parallelism would
split a scale's 32 inputs, are dequantized to the model's dtype as they load (as transformers
dequantizes them on a CPU). Everything else is stored unquantized.
"""

from __future__ import annotations

import logging

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.config.quantization import quant_method
from jaxserve.layers.linear import E2M1
from jaxserve.models.llama import HFWeight, LlamaForCausalLM

logger = logging.getLogger(__name__)


def dequantize_mxfp4_experts(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks u8[E, out, G, 16] and scales u8[E, out, G] -> f32[E, in = G * 32, out] (the
    FusedMoE layout, [in, out] per expert)."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match "
            "([E, out, G, 16] and [E, out, G])"
        )
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [E, out, G, 16, 2]
    values = np.asarray(E2M1, np.float32)[codes].reshape(*scales.shape, 32)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*scales.shape[:2], -1).transpose(0, 2, 1)


def pack_mxfp4_codes(blocks: np.ndarray) -> np.ndarray:
    """blocks u8[E, out, G, 16] -> the packed kernel u8[E, in / 2, out]: byte r of a column
    holds inputs 2r (low nibble) and 2r + 1, as gpt-oss's blocks already pair them."""
    blocks = np.asarray(blocks, np.uint8)
    e, out = blocks.shape[:2]
    return np.ascontiguousarray(blocks.reshape(e, out, -1).transpose(0, 2, 1))


def _swap_last(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(np.asarray(a), -1, -2))


class GptOssForCausalLM(LlamaForCausalLM):
    @staticmethod
    def hf_weight(config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        names = [str(p) for p in path]
        if names[0] != "layers":
            return LlamaForCausalLM.hf_weight(config, path, kv_replicas)
        prefix = f"model.layers.{names[1]}"
        if names[2:] == ["self_attn", "sinks"]:
            return HFWeight((f"{prefix}.self_attn.sinks",))
        if names[2] != "mlp":
            return LlamaForCausalLM.hf_weight(config, path, kv_replicas)
        leaf = names[3]
        experts = f"{prefix}.mlp.experts"
        if leaf.endswith("_scale"):  # packed MXFP4: e8m0 exponents [E, out, G] -> [E, G, out]
            proj = {"w13": "gate_up_proj", "w2": "down_proj"}[leaf.removesuffix("_scale")]
            return HFWeight((f"{experts}.{proj}_scales",), _swap_last)
        if leaf == "gate":  # the router: weight [E, D] -> [D, E], and its bias
            if names[4] == "bias":
                return HFWeight((f"{prefix}.mlp.router.bias",))
            return HFWeight((f"{prefix}.mlp.router.weight",), np.transpose)
        proj = {"w13": "gate_up_proj", "w2": "down_proj"}[leaf.removesuffix("_bias")]
        if leaf.endswith("_bias"):  # [E, 2F] (gate and up interleaved, as w13), [E, D]
            return HFWeight((f"{experts}.{proj}_bias",))
        if config.expert_quant == "mxfp4":  # codes [E, out, G, 16] -> [E, in / 2, out]
            return HFWeight((f"{experts}.{proj}_blocks",), pack_mxfp4_codes)
        if quant_method(config.hf_config) == "mxfp4":
            if names[1] == "0" and leaf == "w13":
                logger.info(
                    "gpt-oss: MXFP4 experts dequantized to %s as they load",
                    np.dtype(config.dtype).name,
                )
            return HFWeight(
                (f"{experts}.{proj}_blocks", f"{experts}.{proj}_scales"), dequantize_mxfp4_experts
            )
        return HFWeight((f"{experts}.{proj}",))  # [E, D, 2F] / [E, F, D], as FusedMoE's
