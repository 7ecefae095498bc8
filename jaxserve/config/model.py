"""The model's architecture (`ModelConfig`; its rotary: config/rope.py) and the dtype helpers.

`ModelConfig` is the one place the HF config is read: everything downstream (layers, sharding,
KV cache sizing) reads these typed fields instead of poking at the HF object.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config.gemma4 import GEMMA4, Gemma4Layers, gemma4_fields
from jaxserve.config.linear_attention import LinearAttentionConfig, linear_attention_config
from jaxserve.config.llama4 import LLAMA4, llama4_fields
from jaxserve.config.mla import MlaConfig, mla_config
from jaxserve.config.moe import MoeRouting, first_dense_layers, moe_routing
from jaxserve.config.pooler import is_classifier
from jaxserve.config.quantization import (
    CHECKPOINT_METHODS,
    DUMMY_PACKED,
    checkpoint_quantization,
    expert_quantization,
    input_quantization,
    int4_act_order,
    per_channel_group,
    quant_method,
)
from jaxserve.config.rope import RopeConfig

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
QUANTIZATIONS = ("int8", "fp8", "gguf")
# Architectures whose `attention_bias` gives the output projection a bias too (HF's).
O_PROJ_BIAS = (
    "LlamaForCausalLM",
    "GptOssForCausalLM",
)  # gguf: a GGUF file's blocks kept (layers/linear.py)

_DTYPES = {
    "float32": jnp.float32,
    "float": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "half": jnp.float16,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder-only transformer, plus the dtype its weights live in."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections have biases
    o_proj_bias: bool = False  # and the output projection (Llama's, gpt-oss's attention_bias)
    # A learned logit per query head in each softmax's denominator (gpt-oss's `sinks`)
    attention_sinks: bool = False
    sliding_window: int | None = None  # each token attends to the latest this many keys
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3, Gemma 3)
    qk_norm_over_heads: bool = False  # over each whole q and k projection (MiniMax-M2)
    qk_l2_norm: bool = False  # a weightless one, on the layers with rotary (Llama 4)
    # Llama 4 (config/llama4.py): "chunked_attention" layers attend within chunks of this
    # many tokens; layers without rotary; their queries' temperature (floor_scale,
    # attn_scale)
    attention_chunk_size: int | None = None
    nope_layers: tuple[int, ...] = ()
    attn_temperature: tuple[float, float] | None = None
    hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_pytorch_tanh
    # Per layer "sliding_attention" (sliding_window applies) or "full_attention"; None: every
    # layer alike (the window, if any, applies to all).
    layer_types: tuple[str, ...] | None = None
    sliding_rope: RopeConfig | None = None  # rotary of sliding layers, when it differs
    attn_logit_softcapping: float | None = None  # scores: cap * tanh(score / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits likewise (Gemma 2)
    query_pre_attn_scalar: float | None = None  # scores scaled by its ** -0.5, not head_dim's
    # Weight-only quantization of the decoder layers' linear kernels: "int8" or "fp8" (e4m3),
    # one float32 scale per output channel (layers/linear.py), computed at load, or read from
    # a pre-quantized checkpoint (prequantized: compressed-tensors, `checkpoint_quantization`).
    # "fp8_block": a checkpoint's e4m3 weights with 2-D block scales, one scale per
    # quant_group input rows of each output channel; "int4": 4-bit weights packed two a byte,
    # a scale and zero point per quant_group input rows (compressed-tensors pack-quantized).
    quantization: str | None = None
    prequantized: bool = False
    quant_group: int = 0
    # "int4" with one scale and zero point per output channel in the checkpoint (group_size
    # -1): repeated over groups of quant_group rows at load (config.per_channel_group).
    quant_per_channel: bool = False
    # "int4" from an act-order checkpoint (GPTQ desc_act, compressed-tensors actorder group):
    # each linear layer's input rows are stored sorted by group, and the layer gathers its
    # input by `perm` first.
    quant_act_order: bool = False
    # A W8A8 checkpoint's dynamic input quantization, emulated in the model dtype (as
    # compressed-tensors runs it on CPU): "fp8" (e4m3) or "int8", symmetric, one scale per
    # token (input_group 0) or per input_group inputs of each token.
    input_quant: str | None = None
    input_group: int = 0
    # The routed experts kept packed (pallas_kernels/grouped_matmul/packed.py): "mxfp4"
    # (gpt-oss's checkpoints), or any of DUMMY_PACKED for dummy weights; expert_group inputs
    # per scale. None: the experts are in the model dtype.
    expert_quant: str | None = None
    expert_group: int = 0
    # Mixture of experts (Mixtral, Qwen3-MoE; layers/fused_moe.py): 0 experts = dense MLPs.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP (Qwen3-MoE's)
    moe_routing: MoeRouting = MoeRouting()  # how the router picks experts (config/moe.py)
    rotary_dim: int = 0  # the leading dims of each head that rotary turns (0: all of them)
    # Multi-head latent attention (DeepSeek-V3): num_kv_heads is then 1 (the latent the cache
    # holds) and head_dim the rotary part's (config/mla.py)
    mla: MlaConfig | None = None
    # Gated delta-net layers (Qwen3-Next; config/linear_attention.py): a hybrid model, whose
    # other layers are full attention with an output gate (attn_output_gate: sigmoid of a
    # second half of q_proj's columns multiplies each head's output)
    linear_attn: LinearAttentionConfig | None = None
    attn_output_gate: bool = False
    gemma4: Gemma4Layers | None = None  # Gemma 4's per-layer widths, KV sharing (config/gemma4.py)
    expert_parallel: bool = False  # experts split over the devices (load_model sets it)
    dtype: Any = jnp.float32
    hf_config: Any = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_hf(
        cls,
        hf_config: Any,
        dtype: str | Any = "auto",
        quantization: str | None = None,
        load_format: str = "auto",
    ) -> ModelConfig:
        """load_format "dummy" with quantization one of DUMMY_PACKED (a config that names no
        quantization): random weights packed as that format's checkpoints keep them."""
        if quantization in DUMMY_PACKED and not getattr(hf_config, "quantization_config", None):
            if load_format == "dummy":
                unpacked = cls.from_hf(hf_config, dtype, None, load_format)
                return unpacked.with_dummy_packing(quantization)
            if quantization != "mxfp4":  # mxfp4 names a checkpoint's own too: refused below
                raise ValueError(
                    f"quantization {quantization!r} makes random packed weights for "
                    "--load-format dummy; a checkpoint's own packed weights are read from it "
                    "(automatic)"
                )
        prequantized, quant_group = checkpoint_quantization(hf_config) or (None, 0)
        input_quant, input_group = input_quantization(hf_config) or (None, 0)
        # vLLM's names of a checkpoint's own method ("mxfp4" also names compressed-tensors')
        if quantization in CHECKPOINT_METHODS and quantization != prequantized:
            method = quant_method(hf_config)
            if method != CHECKPOINT_METHODS[quantization]:
                raise ValueError(
                    f"quantization {quantization!r}: the checkpoint's quantization_config "
                    + (f"names {method!r}" if method else "is absent (not quantized)")
                )
            quantization = None
        if quantization == prequantized or (prequantized == "fp8_block" and quantization == "fp8"):
            quantization = None  # the checkpoint's own (vLLM's -q fp8 names block fp8 too)
        if quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"quantization {quantization!r} is not supported; choose from "
                f"{(*QUANTIZATIONS, *CHECKPOINT_METHODS)}"
            )
        if prequantized and quantization is not None:
            raise ValueError(
                f"quantization {quantization!r} conflicts with the checkpoint's own "
                f"{prequantized} weights"
            )
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError("HF config has no `architectures` entry; cannot pick a model class")
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        rope_params = getattr(hf_config, "rope_parameters", None) or {}
        num_heads = hf_config.num_attention_heads
        partial = rope_params.get("partial_rotary_factor", None)
        partial = getattr(hf_config, "partial_rotary_factor", None) if partial is None else partial
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rotary_dim = 0 if partial in (None, 1, 1.0) else int(head_dim * partial)
        if rotary_dim % 2 or not 0 <= rotary_dim <= head_dim:
            raise ValueError(
                f"partial_rotary_factor={partial} of head_dim {head_dim} is not an even number "
                "of rotated dims"
            )
        hidden_act = (
            getattr(hf_config, "hidden_activation", None)
            or getattr(hf_config, "hidden_act", None)
            or "silu"
        )
        if hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})"
            )
        # Qwen2 always has q/k/v biases; Llama-style configs say so with `attention_bias`.
        attention_bias = bool(getattr(hf_config, "attention_bias", False)) or archs[0].startswith(
            "Qwen2"
        )
        sliding_window = getattr(hf_config, "sliding_window", None)
        if archs[0].startswith("Qwen") and not getattr(hf_config, "use_sliding_window", False):
            sliding_window = None
        layer_types = getattr(hf_config, "layer_types", None)
        if layer_types and not sliding_window:
            layer_types = None
        num_experts = int(
            getattr(hf_config, "num_local_experts", None)
            or getattr(hf_config, "num_experts", 0)
            or 0
        )
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        only_mlp = set(getattr(hf_config, "mlp_only_layers", None) or ())
        first_dense = first_dense_layers(hf_config, archs[0])
        dense_layers = tuple(
            i
            for i in range(hf_config.num_hidden_layers)
            if num_experts and (i in only_mlp or (i + 1) % step or i in first_dense)
        )
        # an all-MoE config (Qwen3.5-MoE's) may name no dense width: the experts' then
        dense = getattr(hf_config, "intermediate_size", None)
        moe_intermediate = int(getattr(hf_config, "moe_intermediate_size", None) or dense)
        dense = int(dense or moe_intermediate)
        per_channel = prequantized == "int4" and quant_group == -1
        if per_channel:
            quant_group = per_channel_group(
                hf_config.hidden_size,
                num_heads * head_dim,
                dense,
                moe_intermediate,
            )
        # the experts packed: gpt-oss's MXFP4 (its only packed tensors), or as the linear layers
        expert_quant = expert_quantization(hf_config) if num_experts else None
        expert_group = (quant_group or 32) if expert_quant else 0
        scaling = getattr(hf_config, "rope_scaling", None) or {}
        mla = mla_config(hf_config, archs[0], {**scaling, **rope_params})
        linear_attn = linear_attention_config(hf_config, archs[0])
        use_qk_norm = bool(getattr(hf_config, "use_qk_norm", False))
        over_heads = archs[0] == "MiniMaxM2ForCausalLM"  # its q / k norms span every head
        sliding_rope = RopeConfig.from_hf(hf_config, "sliding_attention")
        if sliding_rope == RopeConfig.from_hf(hf_config):
            sliding_rope = None
        config = cls(
            architecture=archs[0],
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=dense,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=1 if mla else getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope=RopeConfig.from_hf(hf_config),
            max_position_embeddings=hf_config.max_position_embeddings,
            # A classifier has no LM head: its pooling runner's one dropped token reads the
            # embedding table (models/seq_cls.py)
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False))
            or is_classifier(archs[0]),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and archs[0] in O_PROJ_BIAS,
            attention_sinks=archs[0] == "GptOssForCausalLM",
            sliding_window=sliding_window,
            qk_norm=(archs[0].startswith(("Qwen3", "Gemma3")) or use_qk_norm) and not over_heads,
            qk_norm_over_heads=over_heads,
            hidden_act=hidden_act,
            layer_types=tuple(layer_types) if layer_types else None,
            sliding_rope=sliding_rope,
            attn_logit_softcapping=getattr(hf_config, "attn_logit_softcapping", None),
            final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None),
            query_pre_attn_scalar=getattr(hf_config, "query_pre_attn_scalar", None),
            num_experts=num_experts,
            num_experts_per_tok=int(getattr(hf_config, "num_experts_per_tok", 0) or 0),
            moe_intermediate_size=moe_intermediate,
            norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", True)),
            dense_layers=dense_layers,
            moe_routing=moe_routing(hf_config, archs[0]) if num_experts else MoeRouting(),
            rotary_dim=rotary_dim,
            mla=mla,
            linear_attn=linear_attn,
            attn_output_gate=linear_attn is not None,
            quantization=prequantized or quantization,
            prequantized=prequantized is not None,
            quant_group=quant_group,
            quant_per_channel=per_channel,
            quant_act_order=prequantized == "int4" and int4_act_order(hf_config),
            input_quant=input_quant,
            input_group=input_group,
            expert_quant=expert_quant,
            expert_group=expert_group,
            dtype=resolve_dtype(dtype, hf_config),
            hf_config=hf_config,
        )
        if archs[0] in LLAMA4:
            config = dataclasses.replace(config, **llama4_fields(hf_config))
        if archs[0] in GEMMA4:
            config = dataclasses.replace(config, **gemma4_fields(hf_config))
        return config

    def with_dummy_packing(self, mode: str) -> ModelConfig:
        """This config with random weights packed as `mode` (DUMMY_PACKED) in place of a
        checkpoint's: the linear layers and the experts as a checkpoint of that format keeps
        them (gpt-oss's MXFP4: the experts alone)."""
        group = DUMMY_PACKED[mode]
        experts_only = mode == "mxfp4" and self.architecture == "GptOssForCausalLM"
        return dataclasses.replace(
            self,
            quantization=None if experts_only else mode,
            prequantized=not experts_only,
            quant_group=0 if experts_only else group,
            expert_quant=mode if self.num_experts else None,
            expert_group=group if self.num_experts else 0,
        )

    def linear_kwargs(self) -> dict:
        """How the decoder layers' linear projections are quantized (layers/linear.py)."""
        return dict(
            quant=self.quantization,
            group=self.quant_group,
            act_order=self.quant_act_order,
            input_quant=self.input_quant,
            input_group=self.input_group,
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence the model takes (a sliding window is honoured by the attention,
        so it does not cap it)."""
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (None: full attention)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_chunk(self, layer: int) -> int | None:
        """The attention chunk of decoder layer `layer` (Llama 4's; None: none)."""
        if self.layer_types is not None and self.layer_types[layer] == "chunked_attention":
            return self.attention_chunk_size
        return None

    def layer_rope(self, layer: int) -> RopeConfig:
        if self.sliding_rope is not None and self.layer_window(layer) is not None:
            return self.sliding_rope
        return self.rope

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The decoder layers that keep K/V in the paged cache (all but linear attention's
        and Gemma 4's KV-sharing ones)."""
        linear = set(self.linear_attn.layers) if self.linear_attn else set()
        if self.gemma4 is not None:
            linear |= {i for i, s in enumerate(self.gemma4.shares) if s is not None}
        return tuple(i for i in range(self.num_layers) if i not in linear)

    @property
    def v_slots(self) -> tuple[int | None, ...] | None:
        """The V-cache slot of each cached layer (kv_layers' order) where some keep none:
        GLM-5's shared-indexer layers hold no index keys (None), the full ones take slots
        0, 1, ...; None where every layer has its own, the K cache's."""
        flags = self.mla.index_shared if self.mla else ()
        if not any(flags):
            return None
        full = [i for i in self.kv_layers if not (i < len(flags) and flags[i])]
        return tuple(full.index(i) if i in full else None for i in self.kv_layers)

    def layer_kv_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head_dim) of decoder layer `layer` (Gemma 4's full layers' differ)."""
        if self.gemma4 is not None:
            return self.gemma4.widths[layer]
        return self.num_kv_heads, self.head_dim

    @property
    def cache_dims(self) -> tuple[int, int]:
        """Values per token and cache head in the K and V caches: (head_dim, head_dim), or
        for MLA (the latent and rotary key; V is read from K: 0, or DSA's index key)."""
        return (self.mla.latent_dim, self.mla.index_head_dim) if self.mla else (self.head_dim,) * 2

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def uniform_sliding_window(self) -> int | None:
        """The sliding window when every layer has it (Mistral); None when any layer attends
        to the whole context (Gemma's global layers) or none has a window."""
        windows = {self.layer_window(layer) for layer in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


def resolve_dtype(dtype: str | Any, hf_config: Any = None) -> Any:
    """'auto' -> the checkpoint's dtype (bfloat16 when it names none) on accelerators, and
    float32 on CPU, where XLA's bf16 matmuls are slow and exact parity matters most."""
    if dtype != "auto":
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
            return _DTYPES[dtype]
        return jnp.dtype(dtype).type
    if jax.default_backend() == "cpu":
        return jnp.float32
    name = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(name).removeprefix("torch.") if name is not None else "bfloat16"
    return _DTYPES.get(name, jnp.bfloat16)
