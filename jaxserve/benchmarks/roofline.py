"""How far a decode step is from the device's physical limits.

A decode step over B sequences reads every weight once and the K/V of every cached token of
every sequence, and does about two FLOPs per weight per sequence plus the attention products:

    memory bound  = (weight bytes + KV bytes read) / peak memory bandwidth
    compute bound = (2 * matmul weights * B + 4 * L * Hq * hd * sum(context)) / peak FLOP/s

Weight bytes are what the step reads of the parameters, in their dtype: every weight once,
except an untied embedding table, of which the step looks up only its B rows (the LM head, a
table of its own, is read whole); a tied table is read whole, by the LM head, and counted
once. Matmul weights leave out an untied embedding table and the norm weights. KV bytes read
are 2 * L * Hkv * hd * dtype bytes * sum(context). A step can be no faster than the larger bound;
`Roofline.line()` prints each bound as a fraction of the measured step (1.0 = at the limit).

Peaks: a table by device kind for GPUs (datasheet dense figures); on CPU they are measured
(`measure_cpu_peaks`): bandwidth as the best of a jitted matrix-vector product and a sum
streaming a 1 GiB float32 array (what a decode step does to its weights), 10 runs each,
FLOP/s as the best of a jitted 2048^3 matmul in the model's dtype. On a shared VM the
bandwidth varies with the neighbours' load (43-71 GB/s on the 2-core CI machine,
benchmarks/results/cpu.md): the best run is the bound, so a fraction is conservative.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig

# device_kind substring -> (memory bytes/s, {dtype: dense FLOP/s}); first match wins.
GPU_PEAKS: tuple[tuple[str, float, dict[str, float]], ...] = (
    ("H100 PCIe", 2.0e12, {"bfloat16": 756e12, "float16": 756e12, "float32": 51e12}),
    ("H100", 3.35e12, {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}),  # SXM
    ("H200", 4.8e12, {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}),
    ("A100", 2.039e12, {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}),
)
CPU_BANDWIDTH_BYTES = 1 << 30  # streamed by the bandwidth measurement
CPU_MATMUL_SIZE = 2048


@dataclasses.dataclass(frozen=True)
class DevicePeaks:
    device: str
    bandwidth: float  # bytes/s
    flops: float  # FLOP/s in the model's dtype
    how: str  # "datasheet" or how it was measured


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What one decode step must move and compute at the least."""

    weight_bytes: int
    kv_bytes: float
    flops: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


@dataclasses.dataclass(frozen=True)
class Roofline:
    step_s: float  # the measured decode step
    cost: StepCost
    peaks: DevicePeaks

    @property
    def memory_bound_s(self) -> float:
        return self.cost.bytes / self.peaks.bandwidth

    @property
    def compute_bound_s(self) -> float:
        return self.cost.flops / self.peaks.flops

    def line(self) -> str:
        step, mem, comp = 1e3 * self.step_s, 1e3 * self.memory_bound_s, 1e3 * self.compute_bound_s
        return (
            f"Roofline: step {step:.2f} ms, memory bound {mem:.2f} ms ({mem / step:.2f} of it), "
            f"compute bound {comp:.2f} ms ({comp / step:.2f} of it)"
        )

    def detail(self) -> str:
        c, p = self.cost, self.peaks
        return (
            f"  per step {c.weight_bytes / 2**20:.1f} MiB of weights + {c.kv_bytes / 2**20:.2f} "
            f"MiB of KV read, {c.flops / 1e9:.2f} GFLOP; {p.device}: {p.bandwidth / 1e9:.1f} "
            f"GB/s, {p.flops / 1e9:.0f} GFLOP/s ({p.how})"
        )

    def to_dict(self) -> dict:
        return dict(
            step_ms=1e3 * self.step_s,
            memory_bound_ms=1e3 * self.memory_bound_s,
            compute_bound_ms=1e3 * self.compute_bound_s,
            memory_fraction=self.memory_bound_s / self.step_s,
            compute_fraction=self.compute_bound_s / self.step_s,
            weight_bytes=self.cost.weight_bytes,
            kv_bytes=self.cost.kv_bytes,
            flops=self.cost.flops,
            device=self.peaks.device,
            bandwidth_bytes_per_s=self.peaks.bandwidth,
            peak_flops=self.peaks.flops,
            peaks_how=self.peaks.how,
        )


def param_counts(config: ModelConfig) -> tuple[int, int, int]:
    """(all parameters, matmul weights, routed experts' weights) of the model, from its
    abstract shapes."""
    total, matmul, experts, _ = _param_sizes(config)
    return total, matmul, experts


def param_bytes(config: ModelConfig) -> tuple[int, int]:
    """(all parameters' bytes, the routed experts' bytes), packed formats as stored."""
    total, _, experts, _ = _param_sizes(config, in_bytes=True)
    return total, experts


def _param_sizes(config: ModelConfig, in_bytes: bool = False) -> tuple[int, int, int, int]:
    """param_counts' three, then the untied embedding tables' parameters (row lookups: a
    step reads B rows of them, not the whole; 0 when the embedding is tied). Counts are of
    weights (a packed 4-bit kernel's byte holds two; scales and offsets are no weights);
    in_bytes: the bytes each occupies instead, packed formats as stored."""
    from flax import nnx, traverse_util

    from jaxserve.distributed.sharding import kv_head_replicas
    from jaxserve.models.registry import get_model_class

    model_cls = get_model_class(config.architecture)
    replicas = kv_head_replicas(config, 1)  # (Gemma 4's narrower layers' repeated heads)
    abstract = nnx.eval_shape(lambda: model_cls(config, kv_replicas=replicas, rngs=nnx.Rngs(0)))
    shapes = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
    total = matmul = experts = lookup = 0
    for path, s in shapes.items():
        name = "/".join(map(str, path))
        leaf, dtype = str(path[-1]), jnp.dtype(s.dtype)
        packing = leaf in ("scale", "offset", "perm") or leaf.endswith(("_scale", "_offset"))
        if in_bytes:
            size = int(np.prod(s.shape)) * dtype.itemsize
        elif packing:
            continue
        else:  # two 4-bit weights a byte
            size = int(np.prod(s.shape)) * (2 if dtype == jnp.dtype(jnp.uint8) else 1)
        total += size
        lookup_only = "embed_tokens" in name and not config.tie_word_embeddings
        lookup += size if lookup_only else 0
        if not lookup_only and "norm" not in name and not name.endswith("bias"):
            matmul += size
        if re.search(r"mlp/w(13|2)(_scale|_offset)?$", name):
            experts += size
    return total, matmul, experts, lookup


def decode_step_cost(config: ModelConfig, context_lens: Sequence[float]) -> StepCost:
    """The least a decode step of len(context_lens) sequences reads and computes; each
    context length counts the cached tokens the step's query attends to (its own included).
    An untied embedding table is read B rows of hidden_size (at most the whole table); a tied
    one whole (the LM head). A mixture of experts reads only the experts its B * k routed
    rows pick: with routing uniform, E * (1 - (1 - k / E) ** B) of E per layer; each row
    multiplies through k."""
    _, matmul, experts, _ = _param_sizes(config)
    total_b, _, experts_b, lookup_b = _param_sizes(config, in_bytes=True)
    itemsize = jnp.dtype(config.dtype).itemsize
    b, ctx = len(context_lens), float(sum(context_lens))
    read = total_b - lookup_b + min(lookup_b, b * config.hidden_size * itemsize)
    per_row = matmul
    if experts:
        e, k = config.num_experts, config.num_experts_per_tok
        read = read - experts_b + experts_b * (1 - (1 - k / e) ** b)
        per_row = matmul - experts + experts * k / e
    k_dim, v_dim = config.cache_dims  # MLA: the latent and rotary key, no V
    layers = len(config.kv_layers)  # a hybrid's linear-attention layers keep no KV
    kv_bytes = layers * config.num_kv_heads * (k_dim + v_dim) * itemsize * ctx
    v_read = config.mla.kv_lora_rank if config.mla else v_dim  # values: MLA's latent
    attn_flops = 2 * layers * config.num_heads * (k_dim + v_read) * ctx
    if (la := config.linear_attn) is not None:  # each row's f32 state, read and written
        state = la.num_v_heads * la.k_head_dim * la.v_head_dim
        kv_bytes += len(la.layers) * b * 2 * (4 * state + la.conv_dim * itemsize)
        attn_flops += len(la.layers) * b * 8 * state  # decay, S^T k, update, S^T q
    return StepCost(int(read), int(kv_bytes), 2.0 * per_row * b + attn_flops)


def device_peaks(dtype) -> DevicePeaks:
    """Peak bandwidth and FLOP/s of the first device: datasheet for known GPUs, else measured."""
    device = jax.devices()[0]
    peaks = datasheet_peaks(device.device_kind, dtype)
    if peaks is not None:
        return peaks
    if device.platform != "cpu":
        raise ValueError(
            f"no peak figures for {device.device_kind!r}; known: "
            f"{', '.join(k for k, _, _ in GPU_PEAKS)}"
        )
    return measure_cpu_peaks(dtype)


def datasheet_peaks(device_kind: str, dtype) -> DevicePeaks | None:
    """The GPU_PEAKS entry for a jax device_kind, or None."""
    name = jnp.dtype(dtype).name
    for kind, bandwidth, flops in GPU_PEAKS:
        if kind in device_kind and name in flops:
            return DevicePeaks(device_kind, bandwidth, flops[name], "datasheet")
    return None


def measure_cpu_peaks(dtype, nbytes: int = CPU_BANDWIDTH_BYTES) -> DevicePeaks:
    """Measured on this host's CPU devices; see the module docstring."""
    cols = 4096
    rows = nbytes // 4 // cols
    make = jax.jit(
        lambda: jnp.arange(rows * cols, dtype=jnp.float32).reshape(rows, cols) * 1e-9
    )  # real data in every page: no zero-page reads
    w = make()
    x = jnp.ones(cols, jnp.float32)
    matvec = _best_seconds(jax.jit(lambda w, x: w @ x), w, x, reps=10)
    total = _best_seconds(jax.jit(jnp.sum), w, reps=10)
    del w
    n = CPU_MATMUL_SIZE
    a = jnp.ones((n, n), dtype)
    matmul = _best_seconds(jax.jit(lambda a: a @ a), a, reps=3)
    cores = jax.local_device_count("cpu")
    return DevicePeaks(
        f"cpu ({_cpu_name()}, {_host_cores()} cores, {cores} jax devices)",
        rows * cols * 4 / min(matvec, total),
        2.0 * n**3 / matmul,
        f"measured: {nbytes >> 20} MiB f32 matvec/sum, {n}^3 {jnp.dtype(dtype).name} matmul",
    )


def _best_seconds(fn, *args, reps: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _host_cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
