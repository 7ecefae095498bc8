"""PartitionSpecs for the model's parameters and KV cache over the `tp` mesh axis.

Megatron-style: the fused qkv and gate_up projections are column-parallel (their output
columns are ordered so that each contiguous 1/tp of them is whole KV-head groups, or a slice of
the intermediate dim with both its gate and up columns), o and down are row-parallel (XLA
inserts the all-reduce after them). The embedding and lm_head are split over the vocabulary, so
logits come out vocab-sharded and no device holds the whole table. The KV cache is split over
KV heads. When tp is a multiple of num_kv_heads, each KV head is stored `kv_head_replicas`
times, once for each device whose query heads use it (as vLLM does): every device then holds
whole KV heads, and only the ones it needs.
"""

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import GROUPED_QUANT, ModelConfig
from jaxserve.config.kv_groups import cache_head_replicas
from jaxserve.distributed.mesh import TP_AXIS


def validate_tp(config: ModelConfig, tp: int) -> None:
    """Raise ValueError unless tp splits the query heads, KV heads and MLP evenly."""
    problems = []
    if config.num_heads % tp:
        problems.append(f"num_attention_heads={config.num_heads}")
    if config.num_kv_heads % tp and tp % config.num_kv_heads:
        problems.append(f"num_key_value_heads={config.num_kv_heads} (nor is tp a multiple of it)")
    if config.intermediate_size % tp:
        problems.append(f"intermediate_size={config.intermediate_size}")
    if config.num_experts and config.expert_parallel and config.num_experts % tp:
        problems.append(f"num_experts={config.num_experts} (expert parallel)")
    if config.num_experts and not config.expert_parallel and config.moe_intermediate_size % tp:
        problems.append(f"moe_intermediate_size={config.moe_intermediate_size}")
    if config.moe_routing.shared_intermediate % tp:
        problems.append(f"the shared experts' {config.moe_routing.shared_intermediate} columns")
    if config.quantization in GROUPED_QUANT:  # row-parallel: whole groups
        group = 16 if config.quantization == "gguf" else config.quant_group
        head = config.mla.v_head_dim if config.mla else config.head_dim  # o_proj's inputs
        for name, rows in (
            ("num_attention_heads * head_dim", config.num_heads * head),
            ("intermediate_size", config.intermediate_size),
        ):
            if rows % (group * tp):
                problems.append(f"{name}={rows} into whole {config.quantization} groups of {group}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide {', '.join(problems)} of "
            f"{config.architecture}"
        )


def splits_linear_attention(config: ModelConfig, tp: int) -> bool:
    """Whether tp splits a hybrid model's linear-attention layers (their parameters and
    states) by key heads: when it divides them; else they are replicated."""
    return config.linear_attn is not None and config.linear_attn.num_k_heads % tp == 0


def state_shardings(config: ModelConfig, mesh: Mesh) -> tuple[NamedSharding, NamedSharding]:
    """A hybrid model's per-row states, conv [N, K-1, C] and rec f32[N, Hv, Dk, Dv]: split
    by key heads (C grouped per key head, Hv by them) as its layers' parameters."""
    if not splits_linear_attention(config, mesh.shape[TP_AXIS]):
        return NamedSharding(mesh, P()), NamedSharding(mesh, P())
    return NamedSharding(mesh, P(None, None, TP_AXIS)), NamedSharding(mesh, P(None, TP_AXIS))


def kv_head_replicas(config: ModelConfig, tp: int) -> int:
    """Copies of each KV head in the qkv projection and the KV cache (the rule:
    config/kv_groups.py::cache_head_replicas)."""
    return cache_head_replicas(config, tp)


# A vision tower's layers, Megatron-style as the language model's: attention by heads (its
# fused qkv columns go head by head), MLPs by their hidden units; embeddings, norms, the
# projector and the patch merger replicated.
VISION_RULES = {
    "self_attn/qkv_proj/kernel": P(None, TP_AXIS), "self_attn/qkv_proj/bias": P(TP_AXIS),
    "self_attn/out_proj/kernel": P(TP_AXIS, None),
    "mlp/fc1/kernel": P(None, TP_AXIS), "mlp/fc1/bias": P(TP_AXIS),
    "mlp/fc2/kernel": P(TP_AXIS, None),
    "attn/qkv/kernel": P(None, TP_AXIS), "attn/qkv/bias": P(TP_AXIS),  # Qwen2.5-VL
    "attn/proj/kernel": P(TP_AXIS, None),
    "mlp/gate_up/kernel": P(None, TP_AXIS), "mlp/gate_up/bias": P(TP_AXIS),
    "mlp/down_proj/kernel": P(TP_AXIS, None),
    # Gemma 4's (models/vision/gemma4_vision.py): its projections apart, each a ClippableLinear
    "q_proj/linear/kernel": P(None, TP_AXIS), "k_proj/linear/kernel": P(None, TP_AXIS),
    "v_proj/linear/kernel": P(None, TP_AXIS), "o_proj/linear/kernel": P(TP_AXIS, None),
    "gate_proj/linear/kernel": P(None, TP_AXIS), "up_proj/linear/kernel": P(None, TP_AXIS),
    "down_proj/linear/kernel": P(TP_AXIS, None),
}  # fmt: skip


def param_spec(path: Sequence[str | int], config: ModelConfig, tp: int) -> P:
    """The PartitionSpec of the parameter at `path`, e.g. ('layers', 3, 'mlp', 'down_proj',
    'kernel')."""
    if config.quantization in GROUPED_QUANT and path[-1] in ("scale", "offset"):
        return param_spec((*path[:-1], "kernel"), config, tp)  # [in / group, out]: as the kernel
    if path and str(path[-1]).startswith(("w13_", "w2_")) and not path[-1].endswith("bias"):
        return param_spec((*path[:-1], path[-1].split("_")[0]), config, tp)  # packed experts
    name = "/".join(str(p) for p in path)
    if path and path[0] == "vision":  # a multimodal model's image encoder (models/vision/)
        return next((spec for suffix, spec in VISION_RULES.items() if name.endswith(suffix)), P())
    vocab = TP_AXIS if config.vocab_size % tp == 0 else None
    heads = TP_AXIS if splits_linear_attention(config, tp) else None  # linear attention's
    rules = {
        "embed_tokens/embedding": P(vocab, None),  # [V, D]
        "lm_head/kernel": P(None, vocab),  # [D, V]
        "self_attn/qkv_proj/kernel": P(None, TP_AXIS),  # [D, Hkv * (G + 2) * hd]
        "self_attn/qkv_proj/bias": P(TP_AXIS),  # [Hkv * (G + 2) * hd]
        "self_attn/o_proj/kernel": P(TP_AXIS, None),  # [Hq * hd, D]
        # MLA (models/deepseek.py): the query's heads and kv_b_proj's per-head halves split,
        # the latent projections replicated (every rank keeps the whole latent)
        "self_attn/q_b_proj/kernel": P(None, TP_AXIS),  # [q_lora, H * (nope + rope)]
        "self_attn/q_proj/kernel": P(None, TP_AXIS),
        "self_attn/w_uk": P(TP_AXIS),  # [H, nope, r]
        "self_attn/w_uv": P(TP_AXIS),  # [H, v, r]
        "mlp/gate_up_proj/kernel": P(None, TP_AXIS),  # [D, F * 2]
        "mlp/down_proj/kernel": P(TP_AXIS, None),  # [F, D]
        "shared_experts/gate_up_proj/kernel": P(None, TP_AXIS),  # a GatedMLP beside experts
        "shared_experts/down_proj/kernel": P(TP_AXIS, None),
        # experts [E, D, 2F] and [E, F, D]: whole experts per device (expert parallel), or
        # every expert's slice of F (tensor parallel); the router is replicated
        "mlp/w13": P(TP_AXIS) if config.expert_parallel else P(None, None, TP_AXIS),
        "mlp/w2": P(TP_AXIS) if config.expert_parallel else P(None, TP_AXIS),
        "mlp/w13_bias": P(TP_AXIS) if config.expert_parallel else P(None, TP_AXIS),  # [E, 2F]
        "self_attn/sinks": P(TP_AXIS),  # [Hq], as the query heads
        "self_attn/gate_proj/kernel": P(None, TP_AXIS),  # [D, Hq * hd]: Qwen3-Next's gate
        # gated delta-net (layers/gated_delta_net.py): every part by key heads, but the norm
        "linear_attn/in_proj_qkvz/kernel": P(None, heads),  # [D, Hk (2 Dk + 2 r Dv)]
        "linear_attn/in_proj_ba/kernel": P(None, heads),  # [D, Hk 2r]
        "linear_attn/conv1d": P(None, heads),  # [K, C], C grouped per key head
        "linear_attn/dt_bias": P(heads),  # [Hv]
        "linear_attn/A_log": P(heads),
        "linear_attn/out_proj/kernel": P(heads, None),  # [Hv Dv, D]
        "linear_attn/in_proj_qkvz/scale": P(heads),
        "linear_attn/in_proj_ba/scale": P(heads),
        # per-output-channel scales of quantized kernels: split as their kernel's columns
        "self_attn/qkv_proj/scale": P(TP_AXIS),
        "mlp/gate_up_proj/scale": P(TP_AXIS),
        "shared_experts/gate_up_proj/scale": P(TP_AXIS),
    }
    for suffix, spec in rules.items():
        if name.endswith(suffix):
            return spec
    return P()  # norms: replicated


def param_sharding(
    path: Sequence[str | int], config: ModelConfig, mesh: Mesh, shape: Sequence[int] = ()
) -> NamedSharding:
    """The parameter's NamedSharding; shape: its shape, when known: a vision tower's
    dimension the tensor-parallel size does not divide (validate_tp checks only the language
    model's) is replicated instead."""
    spec = param_spec(path, config, mesh.shape[TP_AXIS])
    tp = mesh.shape[TP_AXIS]
    if any(axis is not None and dim % tp for axis, dim in zip(spec, shape, strict=False)):
        spec = P()
    return NamedSharding(mesh, spec)


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a [L * num_blocks, block_size, Hkv * replicas, hd] cache: over KV heads."""
    return NamedSharding(mesh, P(None, None, TP_AXIS, None))


def put(tree: Any, sharding: NamedSharding) -> Any:
    """Host arrays (numpy) onto the mesh: jax.device_put, without the check that every
    process passed the same values, which over several hosts is a collective of its own and
    assumes each host has as many devices (every rank builds these the same way)."""
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, sharding, x.__getitem__, dtype=x.dtype),
        tree,
    )
