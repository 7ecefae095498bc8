"""PartitionSpecs for the model's parameters and KV cache over the `tp` mesh axis.

Megatron-style: q/k/v and gate/up are column-parallel (split over heads / the intermediate
dim), o and down are row-parallel (XLA inserts the all-reduce after them). The embedding and
lm_head are split over the vocabulary, so logits come out vocab-sharded and no device ever holds
the whole table. K/V projections and the KV cache are split over KV heads, or replicated when
tp > num_kv_heads (each device then holds the KV heads its query heads need, and some more).
"""

from collections.abc import Sequence

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
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
    if problems:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide {', '.join(problems)} of "
            f"{config.architecture}"
        )


def kv_heads_sharded(config: ModelConfig, tp: int) -> bool:
    return config.num_kv_heads % tp == 0


def param_spec(path: Sequence[str], config: ModelConfig, tp: int) -> P:
    """The PartitionSpec of the parameter at `path` (e.g. ('layers','mlp','up_proj','kernel'))."""
    name = "/".join(str(p) for p in path)
    kv = TP_AXIS if kv_heads_sharded(config, tp) else None
    vocab = TP_AXIS if config.vocab_size % tp == 0 else None
    rules = {  # stacked layer params lead with [L]
        "embed_tokens/embedding": P(vocab, None),  # [V, D]
        "lm_head/kernel": P(None, vocab),  # [D, V]
        "self_attn/q_proj/kernel": P(None, None, TP_AXIS, None),  # [L, D, Hq, hd]
        "self_attn/q_proj/bias": P(None, TP_AXIS, None),  # [L, Hq, hd]
        "self_attn/k_proj/kernel": P(None, None, kv, None),
        "self_attn/k_proj/bias": P(None, kv, None),
        "self_attn/v_proj/kernel": P(None, None, kv, None),
        "self_attn/v_proj/bias": P(None, kv, None),
        "self_attn/o_proj/kernel": P(None, TP_AXIS, None, None),  # [L, Hq, hd, D]
        "mlp/gate_proj/kernel": P(None, None, TP_AXIS),  # [L, D, F]
        "mlp/up_proj/kernel": P(None, None, TP_AXIS),
        "mlp/down_proj/kernel": P(None, TP_AXIS, None),  # [L, F, D]
    }
    for suffix, spec in rules.items():
        if name.endswith(suffix):
            return spec
    return P()  # norms: replicated


def param_sharding(path: Sequence[str], config: ModelConfig, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, param_spec(path, config, mesh.shape[TP_AXIS]))


def kv_cache_sharding(config: ModelConfig, mesh: Mesh) -> NamedSharding:
    """Sharding of a [L, num_blocks, block_size, Hkv, hd] cache: over KV heads when they split."""
    kv = TP_AXIS if kv_heads_sharded(config, mesh.shape[TP_AXIS]) else None
    return NamedSharding(mesh, P(None, None, None, kv, None))
