"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) in Flax NNX.

One forward call runs a flat batch of tokens from many sequences over a paged KV cache. Each
decoder layer has its own parameter arrays and the layers run as a plain Python loop (unrolled
in the compiled step): XLA reads every weight where it lies, where `lax.scan` over stacked
[L, ...] weights copies each layer's slices out first (half of a decode step on GPU and CPU).
The KV cache is one pair of arrays [L * num_blocks, block_size, Hkv, hd]; layer l addresses its
blocks as l * num_blocks + block_id, so the attention op sees an ordinary paged cache and all
layers write into the same donated buffers in place.

Weights are stored as the matmuls read them ([in, out], q/k/v and gate/up fused; see
layers/attention.py and layers/mlp.py); `hf_weight` says how each is built from HF tensors.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.layers.attention import Attention, AttentionMetadata
from jaxserve.layers.fused_moe import FusedMoE
from jaxserve.layers.linear import Linear
from jaxserve.layers.lora import LoRABatch
from jaxserve.layers.mlp import GatedMLP
from jaxserve.layers.norm import RMSNorm
from jaxserve.models.step_inputs import StepInputs

KVCaches = tuple[jax.Array, jax.Array]  # K, V: [L * num_blocks, block_size, Hkv, hd]


class DecoderLayer(nnx.Module):
    attention_cls: type = Attention  # MLA's for DeepSeek (models/deepseek.py)

    def __init__(self, config: ModelConfig, layer: int, *, kv_replicas: int, rngs: nnx.Rngs):
        dt = config.dtype
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dt)
        self.self_attn = self.attention_cls(config, layer=layer, kv_replicas=kv_replicas, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dt)
        if config.is_moe_layer(layer):  # Mixtral, Qwen3-MoE
            self.mlp = FusedMoE(config, rngs=rngs)
        else:
            self.mlp = GatedMLP(
                config.hidden_size,
                config.intermediate_size,
                dtype=dt,
                rngs=rngs,
                act=config.hidden_act,
                linear=config.linear_kwargs(),
            )

    def __call__(
        self, x, positions, k_cache, v_cache, md: AttentionMetadata, lora: LoRABatch | None = None
    ):
        """x: [T, D] -> ([T, D], k_cache, v_cache); lora: the tokens' adapter slots."""
        adapters = {} if lora is None else {"lora": lora}  # MLA, MoE: no adapters (refused)
        attn_in, attn_kw = self._normed(self.input_layernorm, self.self_attn, x)
        attn_out, k_cache, v_cache = self.self_attn(
            attn_in, positions, k_cache, v_cache, md, **adapters, **attn_kw
        )
        x = x + attn_out
        mlp_in, mlp_kw = self._normed(self.post_attention_layernorm, self.mlp, x)
        x = x + self.mlp(mlp_in, **adapters, **mlp_kw)
        return x, k_cache, v_cache

    @staticmethod
    def _normed(norm, layer, x) -> tuple[jax.Array, dict]:
        """norm(x) as `layer` takes it: an RMSNorm's weight * x and its 1 / rms row scale,
        which Attention and GatedMLP apply to their first projection's output (no pass of
        its own: it joins the kernels that read that output); else norm(x). Not where the
        projection quantizes its input (W8A8: the normalized activations are what a
        checkpoint's scales were calibrated on)."""
        if type(norm) is not RMSNorm or type(layer) not in (Attention, GatedMLP):
            return norm(x), {}
        first = layer.qkv_proj if type(layer) is Attention else layer.gate_up_proj
        if first.input_quant is not None:
            return norm(x), {}
        h, scale = norm.split(x)
        return h, {"row_scale": scale}


class LlamaForCausalLM(nnx.Module):
    """kv_replicas: copies of each KV head in the projections and cache (tensor parallelism
    over more devices than KV heads; `distributed.sharding.kv_head_replicas`). Other families
    subclass it with their own decoder layer and norm (`layer_cls`, `norm_cls`) and embedding
    scale (`embed_scale`)."""

    layer_cls: type = DecoderLayer
    norm_cls: type = RMSNorm
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    num_lora_slots: int = 0  # LoRA adapter slots in its projections (worker/lora_slots.py)
    deepstack_layers: int = 0  # leading layers after which images add a feature (Qwen3-VL)
    # EAGLE / EAGLE-3 heads draft for it (models/interfaces.py::supports_eagle): this forward,
    # with the final hidden states and aux_layers' inputs (EAGLE-3's feature)
    eagle_target: bool = True

    def __init__(self, config: ModelConfig, *, kv_replicas: int = 1, rngs: nnx.Rngs):
        self.config = config
        self.kv_replicas = kv_replicas
        dt = config.dtype
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dt, param_dtype=dt, rngs=rngs
        )
        self.layers = nnx.List(
            [
                self.layer_cls(config, i, kv_replicas=kv_replicas, rngs=rngs)
                for i in range(config.num_layers)
            ]
        )
        self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps, dtype=dt)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype=dt, rngs=rngs)

    @property
    def num_cache_kv_heads(self) -> int:
        """KV heads per layer as the cache holds them (replicas included)."""
        return self.config.num_kv_heads * self.kv_replicas

    def __call__(
        self,
        inputs: StepInputs,
        kv_caches: KVCaches,
        aux_layers: tuple[int, ...] = (),
        final_norm: bool = True,
    ) -> tuple[jax.Array, KVCaches] | tuple[jax.Array, KVCaches, jax.Array]:
        """inputs: the step's T tokens and feature fields (models/step_inputs.py) -> (final
        hidden states [T, D], updated kv_caches); aux_layers: also the inputs of those layers,
        concatenated [T, D * len(aux_layers)] (an EAGLE-3 head's feature). Of the inputs this
        family reads lora_slots (when worker/lora_slots.py attached slots), mm_rows and
        mm_embeds (a multimodal model's encoder cache rows), mrope_positions (Qwen2.5-VL's
        M-RoPE, in place of positions) and hidden_in (a pipeline stage's input, in place of
        the embedding); final_norm False: the hidden states leave un-normed (for the next
        stage)."""
        positions, md, hidden_in = inputs.positions, inputs.attn, inputs.hidden_in
        lora_slots = inputs.lora_slots
        k_cache, v_cache = kv_caches
        h = self.embed_tokens(inputs.input_ids) if hidden_in is None else hidden_in  # [T, D]
        if self.embed_scale and hidden_in is None:  # HF rounds the scale to the dtype first
            h = h * jnp.asarray(self.config.hidden_size**0.5, h.dtype)
        h = with_images(h, inputs)
        if inputs.mrope_positions is not None:
            positions = inputs.mrope_positions
        aux = []
        lora = {}
        if lora_slots is not None and self.num_lora_slots:
            lora["lora"] = LoRABatch.from_slots(lora_slots, self.num_lora_slots, h.dtype)
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux.append(h)
            layer_md = md.at_layer(i, k_cache, len(self.layers))  # this layer's blocks
            h, k_cache, v_cache = layer(h, positions, k_cache, v_cache, layer_md, **lora)
            if i < self.deepstack_layers:  # Qwen3-VL: the images' i-th further feature
                h = with_images(h, inputs, deepstack=i + 1)
        if aux_layers:
            return self.norm(h), (k_cache, v_cache), jnp.concatenate(aux, axis=-1)
        return (self.norm(h) if final_norm else h), (k_cache, v_cache)

    @property
    def logits_head(self) -> jax.Array:
        """The LM head's weight: the tied embedding [V, D], or lm_head's kernel [D, V]."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.embedding[...]
        return self.lm_head.kernel[...]

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [N, D] (only the rows whose next token is wanted) -> float32 logits [N, V]."""
        return lm_logits(
            hidden,
            self.logits_head,
            tied=self.config.tie_word_embeddings,
            soft_cap=self.config.final_logit_softcapping,
        )

    @staticmethod
    def hf_weight(config: ModelConfig, path: tuple, kv_replicas: int = 1) -> HFWeight:
        """The HF tensors our parameter at `path` is built from, and how.

        ('layers', 3, 'self_attn', 'qkv_proj', 'kernel') <- model.layers.3.self_attn.{q,k,v}_proj
        .weight, fused by `fuse_qkv` and transposed from HF's [out, in] to [in, out].
        """
        *modules, leaf = (str(p) for p in path)
        suffix = "bias" if leaf == "bias" else "weight"
        if modules[0] == "lm_head":
            return HFWeight(("lm_head.weight",), np.transpose)
        if modules[0] != "layers":
            return HFWeight((f"model.{'.'.join(modules)}.{suffix}",))
        prefix = f"model.layers.{modules[1]}"
        name = ".".join(modules[2:])
        if name == "self_attn.qkv_proj":
            names = tuple(f"{prefix}.self_attn.{p}_proj.{suffix}" for p in "qkv")
            fuse = functools.partial(fuse_qkv, config=config, kv_replicas=kv_replicas)
            return HFWeight(names, (lambda *w: fuse(*w).T) if leaf == "kernel" else fuse)
        if name == "mlp.gate_up_proj":
            names = (f"{prefix}.mlp.gate_proj.weight", f"{prefix}.mlp.up_proj.weight")
            return HFWeight(names, lambda gate, up: fuse_gate_up(gate, up).T)
        if name in ("self_attn.o_proj", "mlp.down_proj"):
            if leaf == "bias":  # ModelConfig.o_proj_bias
                return HFWeight((f"{prefix}.{name}.bias",))
            return HFWeight((f"{prefix}.{name}.weight",), np.transpose)
        return HFWeight((f"{prefix}.{name}.{suffix}",))


def lm_logits(
    hidden: jax.Array, head: jax.Array, *, tied: bool, soft_cap: float | None = None
) -> jax.Array:
    """hidden [N, D] x `LlamaForCausalLM.logits_head` ([V, D] when tied, else [D, V]) ->
    f32[N, V], soft-capped (soft_cap * tanh(logit / soft_cap), Gemma 2) when asked."""
    # Tied: contract D with the embedding's minor dim as it lies (`hidden @ head.T` makes
    # XLA:CPU transpose the whole table for a one-row product).
    dims = (((1,), (1,)), ((), ())) if tied else (((1,), (0,)), ((), ()))
    logits = jax.lax.dot_general(hidden, head, dims).astype(jnp.float32)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    return logits


def fuse_qkv(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, *, config: ModelConfig, kv_replicas: int = 1
) -> np.ndarray:
    """HF's q [Hq*hd, ...], k and v [Hkv*hd, ...] (weights [out, in] or biases [out]) ->
    [Hkv*R*(G+2)*hd, ...]: per cache KV head, its G = Hq / (Hkv*R) query heads, its key and
    its value, each KV head repeated R = kv_replicas times (layers/attention.py)."""
    hd, rest = config.head_dim, q.shape[1:]
    heads = config.num_kv_heads * kv_replicas
    q = q.reshape(heads, -1, hd, *rest)  # [Hkv*R, G, hd, ...]
    k, v = (np.repeat(w.reshape(-1, 1, hd, *rest), kv_replicas, axis=0) for w in (k, v))
    return np.concatenate([q, k, v], axis=1).reshape(-1, *rest)


def with_images(h: jax.Array, inputs: StepInputs, deepstack: int = 0) -> jax.Array:
    """The embeddings h [T, D] with each image placeholder token's encoder output in its place
    (inputs.mm_rows: its row of inputs.mm_embeds, -1 for other tokens; None: no images); with
    deepstack j > 0, the hidden states h plus the rows' j-th DeepStack feature (Qwen3-VL's
    rows are [(1 + k) D]: the embedding, then k features)."""
    if inputs.mm_rows is None:
        return h
    d = h.shape[-1]
    table = inputs.mm_embeds[:, deepstack * d : (deepstack + 1) * d]
    picked = table[jnp.maximum(inputs.mm_rows, 0)].astype(h.dtype)
    if deepstack:
        picked = h + picked
    return jnp.where((inputs.mm_rows >= 0)[:, None], picked, h)


def replicate_kv_heads(fused: np.ndarray, config: ModelConfig, kv_replicas: int) -> np.ndarray:
    """A qkv kernel [D, N] or bias [N] fused with each KV head once -> the same with each KV
    head kv_replicas times (a checkpoint restored for tp > num_kv_heads)."""
    kernel = fused.ndim == 2
    out_major = fused.T if kernel else fused  # [N, ...]
    hkv, g, hd = config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim
    groups = out_major.reshape(hkv, g + 2, hd, *out_major.shape[1:])
    q, k, v = (
        groups[:, a:b].reshape(-1, *out_major.shape[1:])
        for a, b in ((0, g), (g, g + 1), (g + 1, g + 2))
    )
    out = fuse_qkv(q, k, v, config=config, kv_replicas=kv_replicas)
    return out.T if kernel else out


def fuse_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """HF's gate and up [F, D] -> [2F, D], interleaved: row 2f is gate f, 2f + 1 is up f."""
    return np.stack([gate, up], axis=1).reshape(-1, gate.shape[1])


@dataclasses.dataclass(frozen=True)
class HFWeight:
    """The HF tensors one parameter is built from, and `build(*tensors)` -> the parameter
    (None: the single tensor as it is)."""

    names: tuple[str, ...]
    build: Callable[..., np.ndarray] | None = None
