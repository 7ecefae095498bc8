"""Mixture-of-experts MLP (vLLM's FusedMoE): a router picks each token's top-k experts, the
token's rows are sorted by expert and run through grouped matmuls
(pallas_kernels/grouped_matmul: a loop over row tiles on CPU, tokamax's Mosaic GPU kernel on
Hopper, `jax.lax.ragged_dot` elsewhere).

Weights: router `gate` [D, E] (and `e_score_correction_bias` [E] for noaux_tc routing);
`w13` [E, D, 2F] (each expert's gate and up interleaved, as GatedMLP's gate_up: column 2f is
gate f, 2f + 1 is up f); `w2` [E, F, D]; `shared_experts` a GatedMLP when the model has them;
gpt-oss's biases `w13_bias` [E, 2F] and `w2_bias` [E, D] (and the router's). With
config.expert_quant the experts stay packed (pallas_kernels/grouped_matmul/packed.py): `w13` /
`w2` hold the packed kernels, `w13_scale` / `w2_scale` (and `_offset` for int4) their scales.

Parallelism over the `tp` mesh axis, inside `jax.shard_map` (a grouped matmul is not
auto-partitioned), each device's partial output summed with a psum:
  - tensor parallel (default): every device holds every expert's 1/tp slice of F;
  - expert parallel (`--enable-expert-parallel`): every device holds E/tp whole experts and
    computes only the rows routed to them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.config.moe import MoeRouting
from jaxserve.distributed.mesh import TP_AXIS
from jaxserve.layers.linear import Linear
from jaxserve.layers.mlp import GatedMLP
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.grouped_matmul.packed import Packed


def route(logits: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (expert ids i32[T, k], weights f32[T, k]): the top-k of the
    float32 softmax over all experts, renormalised to sum to 1 when asked (HF's routing)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def route_noaux_tc(
    logits: jax.Array, bias: jax.Array, top_k: int, renormalize: bool, routing: MoeRouting
) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's and GLM-4.5's routing (config/moe.py::MoeRouting): router logits
    f32[T, E] and the correction bias f32[E] -> (expert ids i32[T, k], weights f32[T, k])."""
    t, e = logits.shape
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    biased = scores + bias
    if routing.n_group > 1:  # only the experts of the topk_group best groups compete
        grouped = biased.reshape(t, routing.n_group, e // routing.n_group)
        merit = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)  # [T, n_group]
        best = jax.lax.top_k(merit, routing.topk_group)[1]
        keep = jnp.zeros((t, routing.n_group), bool).at[jnp.arange(t)[:, None], best].set(True)
        biased = jnp.where(jnp.repeat(keep, e // routing.n_group, axis=1), biased, -jnp.inf)
    ids = jax.lax.top_k(biased, top_k)[1]
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * routing.routed_scaling_factor


def glu(act: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The gated unit of an expert, (gate, up) -> hidden: act(gate) * up, act silu or
    gelu_pytorch_tanh."""
    if act == "gelu_pytorch_tanh":
        return lambda gate, up: jax.nn.gelu(gate, approximate=True) * up
    return lambda gate, up: jax.nn.silu(gate) * up


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """gpt-oss's gated unit (config/moe.py::MoeRouting.swiglu_limit)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)


def route_softmax_groups(
    logits: jax.Array, top_k: int, routing: MoeRouting
) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V2's routing (config/moe.py::MoeRouting "softmax_group"): router logits
    f32[T, E] -> (expert ids i32[T, k], weights f32[T, k])."""
    t, e = logits.shape
    scores = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if routing.n_group > 1:  # only the topk_group groups with the best single score compete
        best = jax.lax.top_k(scores.reshape(t, routing.n_group, -1).max(-1), routing.topk_group)[1]
        keep = jnp.zeros((t, routing.n_group), bool).at[jnp.arange(t)[:, None], best].set(True)
        scores = jnp.where(jnp.repeat(keep, e // routing.n_group, axis=1), scores, 0.0)
    weights, ids = jax.lax.top_k(scores, top_k)
    return ids.astype(jnp.int32), weights * routing.routed_scaling_factor


def _bincount(x: jax.Array, length: int) -> jax.Array:
    """jnp.bincount(x, length=length); for few rows a one-hot sum, which joins the fusions
    around it (bincount is a zeroed buffer and a scatter: two kernels of their own)."""
    if x.shape[0] * length > 1 << 16:
        return jnp.bincount(x, length=length)
    return jnp.sum(x[:, None] == jnp.arange(length), axis=0, dtype=jnp.int32)


def expert_mlp(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    first_expert: jax.Array | int = 0,
    act: Callable | None = None,
    b13: jax.Array | None = None,
    scale_inputs: bool = False,
) -> jax.Array:
    """The experts first_expert .. first_expert + E_local - 1 (w13 [E_local, D, 2F'],
    w2 [E_local, F', D], the gate/up biases b13 [E_local, 2F'] when given) applied to the
    rows routed to them: x [T, D], ids / weights [T, k] -> [T, D], the routing-weighted sum
    (rows routed elsewhere contribute nothing). act(gate, up) is the gated unit (default
    `glu("silu")`). scale_inputs: each row's weight multiplies its input, not its output
    (Llama 4)."""
    act = act or glu("silu")
    t, k = ids.shape
    num_local = w13.shape[0]
    flat = ids.reshape(-1)  # [T*k]
    order = jnp.argsort(flat, stable=True)  # rows sorted by expert
    local = flat[order] - first_expert
    is_local = (local >= 0) & (local < num_local)
    group_sizes = _bincount(jnp.where(is_local, local, num_local), num_local + 1)
    # Rows of earlier (other devices') experts come first: rotate them past the local ones,
    # whose groups ragged_dot then reads from row 0; rows past the groups come back zero.
    start = jnp.sum(local < 0)
    weight = jnp.where(is_local, weights.reshape(-1)[order], 0)  # [T*k], in expert order
    rows = x[order // k]
    if scale_inputs:
        rows, weight = rows * weight[:, None].astype(x.dtype), is_local
    rows = jnp.roll(rows, -start, axis=0)  # [T*k, D]
    gate_up = grouped_matmul(rows, w13, group_sizes[:num_local])  # [T*k, 2F']
    if b13 is not None:  # each row's expert's bias (rows past the groups: scaled by 0 below)
        gate_up = gate_up + b13[jnp.roll(jnp.clip(local, 0, num_local - 1), -start)]
    gate_up = gate_up.reshape(t * k, -1, 2)
    hidden = act(gate_up[..., 0], gate_up[..., 1])
    out = grouped_matmul(hidden, w2, group_sizes[:num_local])
    out = jnp.roll(out, start, axis=0)  # [T*k, D] in expert order
    return jnp.zeros_like(x).at[order // k].add(out * weight[:, None].astype(out.dtype))


class FusedMoE(nnx.Module):
    """The routed experts, and the shared experts every token also goes through (DeepSeek,
    GLM-4.5: `shared_experts`, a GatedMLP) when the config has them."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, e, f, dt = (
            config.hidden_size,
            config.num_experts,
            config.moe_intermediate_size,
            config.dtype,
        )
        self.routing = config.moe_routing
        # the router, never quantized
        self.gate = Linear(d, e, bias=self.routing.biases, dtype=dt, rngs=rngs)
        # noaux_tc's per-expert bias on the scores that pick the experts (not their weights)
        self.e_score_correction_bias = (
            nnx.Param(jnp.zeros((e,), jnp.float32)) if self.routing.score_bias else None
        )
        shared = self.routing.shared_intermediate
        self.shared_experts = (
            GatedMLP(
                d, shared, dtype=dt, rngs=rngs, act=config.hidden_act, linear=config.linear_kwargs()
            )
            if shared
            else None
        )
        self.shared_expert_gate = (  # [D, 1]: the shared experts' gate (Qwen3-Next)
            Linear(d, 1, dtype=dt, rngs=rngs) if self.routing.shared_gate else None
        )
        self.expert_group = config.expert_group
        for name, shape in (("w13", (e, d, 2 * f)), ("w2", (e, f, d))):
            kernel, scale, offset = _expert_params(
                shape, config.expert_quant, config.expert_group, dt, rngs
            )
            setattr(self, name, kernel)
            setattr(self, f"{name}_scale", scale)
            setattr(self, f"{name}_offset", offset)
        biases = self.routing.biases
        self.w13_bias = nnx.Param(jnp.zeros((e, 2 * f), dt)) if biases else None
        self.w2_bias = nnx.Param(jnp.zeros((e, d), dt)) if biases else None
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        limit = self.routing.swiglu_limit
        self.act = (
            glu(config.hidden_act)
            if limit is None
            else functools.partial(clamped_swiglu, alpha=self.routing.swiglu_alpha, limit=limit)
        )
        self.expert_parallel = config.expert_parallel
        self.mesh: Mesh | None = None  # configure_moe sets it

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [T, D] -> [T, D]."""
        out = self.routed(x)
        if self.shared_experts is None:
            return out
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x: [T, D] -> (expert ids i32[T, k], weights f32[T, k])."""
        if self.routing.scoring == "sigmoid_topk":  # Llama 4
            top, ids = jax.lax.top_k(self.gate(x).astype(jnp.float32), self.top_k)
            return ids.astype(jnp.int32), jax.nn.sigmoid(top)
        if self.routing.scoring == "softmax":
            return route(self.gate(x), self.top_k, self.renormalize)
        # DeepSeek's routers score in float32 whatever the model dtype (as HF computes them)
        logits = x.astype(jnp.float32) @ self.gate.kernel[...].astype(jnp.float32)
        if self.routing.scoring == "softmax_group":
            return route_softmax_groups(logits, self.top_k, self.routing)
        bias = self.e_score_correction_bias[...]
        return route_noaux_tc(logits, bias, self.top_k, self.renormalize, self.routing)

    def routed(self, x: jax.Array, routing: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """The routed experts' weighted sum: x [T, D] -> [T, D]; routing: (ids, weights) as
        `route` gives them, chosen by the caller (Gemma 4 routes on another input)."""
        ids, weights = self.route(x) if routing is None else routing
        w13, w2 = self.experts("w13"), self.experts("w2")
        b13 = None if self.w13_bias is None else self.w13_bias[...]
        if self.mesh is None or self.mesh.shape[TP_AXIS] == 1:
            out = expert_mlp(
                x,
                ids,
                weights,
                w13,
                w2,
                act=self.act,
                b13=b13,
                scale_inputs=self.routing.scale_inputs,
            )
        else:
            out = self._sharded(x, ids, weights, w13, w2, b13)
        if self.w2_bias is not None:  # sum_k weight_k * bias of expert k, once (not per shard)
            bias = self.w2_bias[...][ids].astype(jnp.float32)  # [T, k, D]
            out = out + jnp.einsum("tk,tkd->td", weights, bias).astype(out.dtype)
        return out

    def experts(self, name: str) -> jax.Array | Packed:
        """The stack `name` ("w13" or "w2"): an array [E, K, N], or packed."""
        scale = getattr(self, f"{name}_scale")
        if scale is None:
            return getattr(self, name)[...]
        offset = getattr(self, f"{name}_offset")
        return Packed(
            getattr(self, name)[...],
            scale[...],
            None if offset is None else offset[...],
            self.expert_group,
        )

    def _sharded(self, x, ids, weights, w13, w2, b13):
        """`expert_mlp` over the mesh: each device's experts (expert parallel) or slice of
        every expert's F, the partial outputs summed."""
        ep = self.expert_parallel

        def shard(x, ids, weights, w13, w2, b13):
            first = jax.lax.axis_index(TP_AXIS) * w13.shape[0] if ep else 0
            out = expert_mlp(
                x,
                ids,
                weights,
                w13,
                w2,
                first,
                act=self.act,
                b13=b13,
                scale_inputs=self.routing.scale_inputs,
            )
            return jax.lax.psum(out, TP_AXIS)

        spec13, spec2 = (
            (P(TP_AXIS), P(TP_AXIS)) if ep else (P(None, None, TP_AXIS), P(None, TP_AXIS))
        )
        spec_b13 = P(TP_AXIS) if ep else P(None, TP_AXIS)
        # a packed stack: its kernel, scales and offsets split alike
        spec13, spec2 = (jax.tree.map(lambda _, s=s: s, w) for w, s in ((w13, spec13), (w2, spec2)))
        return jax.shard_map(
            shard,
            mesh=self.mesh,
            in_specs=(P(), P(), P(), spec13, spec2, spec_b13),
            out_specs=P(),
            check_vma=False,
        )(x, ids, weights, w13, w2, b13)


def _expert_params(
    shape: tuple[int, int, int], quant: str | None, group: int, dtype, rngs: nnx.Rngs
) -> tuple[nnx.Param, nnx.Param | None, nnx.Param | None]:
    """(kernel, scale, offset) of an expert stack [E, K, N]: full precision (no scale), or
    packed as `quant` with a scale per `group` of K (packed.py's layout)."""
    if quant is None:
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0)
        return nnx.Param(init(rngs.params(), shape, dtype)), None, None
    e, k, n = shape
    if k % group:
        raise ValueError(f"{quant} experts: their input size {k} is not a multiple of {group}")
    rows, kind = (k, jnp.float8_e4m3fn) if quant == "fp8_block" else (k // 2, jnp.uint8)
    scale = (
        jnp.full((e, k // group, n), 127, jnp.uint8)
        if quant == "mxfp4"
        else jnp.ones((e, k // group, n), jnp.float32)
    )
    offset = nnx.Param(jnp.zeros((e, k // group, n), jnp.float32)) if quant == "int4" else None
    return nnx.Param(jnp.zeros((e, rows, n), kind)), nnx.Param(scale), offset


def configure_moe(model: nnx.Module, mesh: Mesh | None) -> None:
    """Give every FusedMoE of `model` the mesh its shard_map runs over."""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, FusedMoE):
            module.mesh = mesh
