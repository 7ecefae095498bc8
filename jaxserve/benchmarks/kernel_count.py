"""The kernels a compiled forward launches, read from XLA's optimized HLO for a CUDA GPU.

Each instruction of the optimized entry computation that runs on the device is one kernel
launch: a fusion (a GEMM fusion, or the elementwise, reduction and scatter fusions between
them), a custom call (a Pallas kernel, a cuBLAS GEMM), a copy. `count` sorts them into:

  gemm         GEMM fusions (XLA's Triton GEMMs) and cuBLAS calls
  pallas       Pallas kernels (Mosaic GPU, Triton): the attention
  elementwise  every other kernel: norms, residual adds, rotary, scatters, gathers, copies
  control      while / conditional (kernels of their own inside; the step's metadata)

Per layer: the forward compiled with L and L + 1 decoder layers, the difference (what one more
layer adds; the embedding, final norm and per-step metadata cancel out). L = 3 by default:
below it the first and last layers' fusions differ (the final norm joins the last residual
add), and the difference with them.

Where to compile: the local GPU, else an H100 with no device at all (deviceless
ahead-of-time compilation: jax >= 0.11 with its CUDA plugin installed, e.g. `pip install
"jax[cuda13]"`, run with JAX_PLATFORMS=cpu). XLA does not autotune without a device, so its
GEMM tiling (split-K among them) is its heuristic's there and an autotuned compile may fuse an
epilogue differently: the GPU's own count is the one a report quotes.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re

import jax
import numpy as np

# An H100 SXM as XLA's GPU compiler describes a target (stream_executor's GpuTargetConfig
# text proto): deviceless compilation for it.
H100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

CLASSES = ("gemm", "pallas", "elementwise", "control")
_NO_KERNEL = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all"}
_PALLAS_TARGETS = ("mosaic_gpu", "__gpu$xla.gpu.triton", "triton_kernel_call")


def cuda_devices() -> tuple[list, str]:
    """(devices, how): the local GPUs ("gpu"), else a deviceless H100 ("deviceless H100"),
    else ([], why not)."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if gpus:
        return gpus, "gpu"
    try:
        from jax.experimental import topologies

        topo = topologies.get_topology_desc(
            platform="cuda", target_config=H100_TARGET, topology="1x1x1"
        )
    except Exception as e:  # no CUDA plugin, or a jax without deviceless compilation
        return [], f"no GPU, and no deviceless CUDA target ({type(e).__name__}: {e})"
    return list(topo.devices), "deviceless H100"


def entry_kernels(hlo_text: str) -> list[tuple[str, str]]:
    """(class, "%name type") of each kernel the optimized HLO's entry computation launches
    (the type without layouts: a split-K GEMM's shows its f32 partial sums, [k, M, N])."""
    entry = hlo_text[hlo_text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    out = []
    for line in entry.splitlines()[1:]:
        opcode = _opcode(line)
        if opcode is None or opcode in _NO_KERNEL:
            continue
        name, _, rest = line.strip().partition(" = ")
        shape = re.sub(r"\{[^}]*\}", "", rest[: rest.index(f"{opcode}(")]).strip()
        cls = _classify(opcode, line)
        if opcode == "fusion" and "kind=kCustom" in line and cls == "elementwise":
            # a custom call XLA wrapped with its operands' address arithmetic (a
            # dynamic_slice_fusion around a Pallas kernel): the call's class
            called = re.search(r"calls=(%[\w.-]+)", line)
            body = _computation(hlo_text, called.group(1)) if called else ""
            calls = [ln for ln in body.splitlines() if _opcode(ln) == "custom-call"]
            cls = _classify("custom-call", calls[-1]) if calls else cls
        out.append((cls, f"{name} {shape}"))
    return out


def _computation(hlo_text: str, name: str) -> str:
    """The body of computation `name` (e.g. "%fused_add") in the HLO text, or ""."""
    start = hlo_text.find(f"\n{name} (")
    return "" if start < 0 else hlo_text[start : hlo_text.find("\n}", start)]


def count(hlo_text: str) -> collections.Counter:
    """Kernels of the entry computation by class (CLASSES)."""
    return collections.Counter(c for c, _ in entry_kernels(hlo_text))


def _opcode(line: str) -> str | None:
    """The instruction's opcode: `%name = TYPE opcode(...)`, TYPE maybe a (tuple)."""
    _, sep, rest = line.partition(" = ")
    if not sep or not line.lstrip().startswith(("%", "ROOT")):
        return None
    if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rest = rest[i + 1 :]
                break
    else:
        rest = rest.partition(" ")[2]
    m = re.match(r"\s*([\w-]+)\(", rest)
    return m.group(1) if m else None


def _classify(opcode: str, line: str) -> str:
    if opcode in ("while", "conditional", "call"):
        return "control"
    if opcode in ("dot", "convolution"):
        return "gemm"
    if opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', line)
        name = target.group(1) if target else ""
        if name.startswith(_PALLAS_TARGETS):
            return "pallas"
        return "gemm" if "cublas" in name or "gemm" in name else "elementwise"
    if opcode == "fusion" and ("calls=%gemm_fusion" in line or "__triton_gemm" in line):
        return "gemm"
    if opcode == "fusion" and "__cublas" in line:
        return "gemm"
    return "elementwise"


@dataclasses.dataclass
class LayerCount:
    """What one decoder layer adds to the forward's kernels."""

    per_layer: dict[str, int]  # class -> kernels
    total: dict[str, int]  # the whole forward's, by class
    layers: int  # the forward's decoder layers
    how: str  # where it was compiled, and how the layer was told apart
    kernels: list[tuple[str, str]]  # the forward's entry kernels

    def line(self) -> str:
        parts = ", ".join(f"{c} {self.per_layer.get(c, 0)}" for c in CLASSES)
        return f"{parts} ({self.how})"


def forward_hlo(engine_args, devices: list, tokens: int, decode_only: bool) -> str:
    """The optimized HLO of engine_args' forward at token bucket `tokens` compiled for
    `devices` (its model loaded on this host; the attention backend engine_args')."""
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxserve.layers.attention import configure_attention
    from jaxserve.startup import StartupTimeline
    from jaxserve.worker import step_functions
    from jaxserve.worker.build import build_runner

    config = engine_args.create_engine_config()
    runner = build_runner(config, StartupTimeline())
    runner.initialize_kv_cache(runner.max_blocks_per_req * runner.max_num_seqs + 1)
    shape = runner.mesh.devices.shape
    mesh = Mesh(np.array(devices[: int(np.prod(shape))]).reshape(shape), runner.mesh.axis_names)
    model = runner.model
    configure_attention(model, config.attention_backend, mesh)
    graphdef, state = nnx.split(model)
    params, params_def = jax.tree.flatten(state)
    model_def = step_functions.ModelDef(graphdef, params_def)

    def on_mesh(x, spec=None):
        if spec is None:
            spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    rep = NamedSharding(mesh, P())
    kv = NamedSharding(mesh, runner.kv.sharding.spec)
    forward = jax.jit(
        lambda *a: step_functions.forward(model_def, runner.kv.block_size, *a),
        donate_argnums=(1,),
        out_shardings=(rep, rep, kv),
    )
    inputs = jax.tree.map(
        lambda x: on_mesh(np.asarray(x), P()), runner._padding(tokens, decode_only)
    )
    with jax.default_device(devices[0]):  # what the kernels' choices read (the MoE's)
        lowered = forward.lower(
            jax.tree.map(on_mesh, params),
            jax.tree.map(on_mesh, runner.kv_caches),
            on_mesh(runner.step_state),
            inputs,
        )
    return lowered.compile().as_text()


def count_per_layer(
    engine_args,
    layers: int,
    tokens: int,
    decode_only: bool,
    cpu_ok: bool = False,
    dump_dir: str | None = None,
) -> LayerCount:
    """The kernels one more decoder layer adds to engine_args' forward: the model cut to
    `layers` and `layers + 1` decoder layers (hf_overrides num_hidden_layers), each compiled
    for CUDA (cuda_devices()) and counted, the difference taken (a layer's kernels that XLA
    schedules away from the rest of it, such as work on the block tables alone, count too).
    cpu_ok: with no CUDA target, count XLA:CPU's kernels instead (a dry run's plumbing).
    dump_dir: write each optimized HLO there (forward_L<layers>.txt)."""
    devices, how = cuda_devices()
    if not devices:
        if not cpu_ok:
            raise RuntimeError(how)
        devices, how = jax.devices("cpu"), "cpu: no CUDA target"
    counts, kernels = [], []
    for n in (layers, layers + 1):
        args = dataclasses.replace(
            engine_args, hf_overrides={**(engine_args.hf_overrides or {}), "num_hidden_layers": n}
        )
        text = forward_hlo(args, devices, tokens, decode_only)
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)
            with open(f"{dump_dir}/forward_L{n}.txt", "w") as f:
                f.write(text)
        kernels = entry_kernels(text)
        counts.append(collections.Counter(c for c, _ in kernels))
    per_layer = {c: counts[1][c] - counts[0][c] for c in CLASSES}
    return LayerCount(
        per_layer, dict(counts[1]), layers, f"{how}; {layers} vs {layers + 1} layers", kernels
    )
