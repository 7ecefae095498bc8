"""Load a model's weights from a HF directory, a GGUF file or a jaxserve (orbax) checkpoint,
with every weight placed straight into its target sharding (`load_model`); or random ones
(load_format "dummy": dummy_weights.py), generated on the devices, for timing shapes no bundled
model has.

Which files a model name stands for, its HF config and its tokenizer are read by
jaxserve/transformers_utils (no model code); the sources of HF-named tensors are in
weight_sources.py; writing a jaxserve checkpoint (`jaxserve convert`) is checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh, SingleDeviceSharding
from tqdm.auto import tqdm

from jaxserve.config import ModelConfig, int4_layout
from jaxserve.config.quantization import block_rows
from jaxserve.distributed.mesh import TP_AXIS, make_mesh
from jaxserve.distributed.sharding import kv_head_replicas, param_sharding, validate_tp
from jaxserve.layers.linear import quantize_kernel
from jaxserve.models import weight_cache
from jaxserve.models.dummy_weights import dummy_params, quantized_dtype
from jaxserve.models.int4_checkpoints import read_int4, read_mxfp4
from jaxserve.models.llama import HFWeight, replicate_kv_heads
from jaxserve.models.registry import get_model_class
from jaxserve.models.weight_sources import GGUFSource, SafetensorsSource
from jaxserve.transformers_utils import hub
from jaxserve.transformers_utils.config import read_any_hf_config, read_generation_config
from jaxserve.transformers_utils.model_path import resolve_model_path
from jaxserve.transformers_utils.tokenizer import read_tokenizer

logger = logging.getLogger(__name__)

CHECKPOINT_MARKER = "jaxserve_checkpoint.json"  # in a jaxserve checkpoint's directory


@dataclasses.dataclass
class LoadedModel:
    model: nnx.Module  # LlamaForCausalLM, parameters placed on `mesh`
    config: ModelConfig
    mesh: Mesh
    tokenizer: Any  # transformers tokenizer, or None when the checkpoint ships none
    generation_config: Any  # transformers GenerationConfig, or None


def load_model(
    model: str | Path | None = None,
    *,
    dtype: str | Any = "auto",
    mesh: Mesh | None = None,
    tensor_parallel_size: int = 1,
    load_tokenizer: bool = True,
    load_format: str = "auto",
    quantization: str | None = None,
    enable_expert_parallel: bool = False,
    architecture: str | None = None,
    hf_overrides: dict | None = None,
    mesh_of: Any = None,
) -> LoadedModel:
    """Load `model` (a name or path transformers_utils/model_path.py resolves) onto `mesh`
    (default: tp over local devices);
    load_tokenizer: also read the tokenizer and generation config (False: the engine core,
    which needs neither);
    load_format "dummy": random weights generated on the devices instead of read ones;
    quantization "int8" / "fp8": the decoder layers' linear kernels quantized as they load;
    enable_expert_parallel: a mixture of experts' experts split over the mesh;
    architecture: the model class to build instead of the config's (an EAGLE head's config
    names a plain Llama); hf_overrides: fields set over the HF config's (--hf-overrides);
    mesh_of: path -> the mesh that parameter goes on (pipeline stages; default: `mesh`)."""
    path = resolve_model_path(model, load_format)
    dummy = load_format == "dummy"
    hf_config = read_any_hf_config(path, hf_overrides)
    if path.is_file():
        source: Any = GGUFSource(path)
    else:
        is_checkpoint = (path / CHECKPOINT_MARKER).exists()
        source = None if is_checkpoint or dummy else SafetensorsSource(path)

    config = ModelConfig.from_hf(hf_config, dtype, quantization, load_format)
    if architecture is not None:
        config = dataclasses.replace(config, architecture=architecture)
    if enable_expert_parallel:
        if not config.num_experts:
            raise ValueError(f"enable_expert_parallel: {config.architecture} has no experts")
        config = dataclasses.replace(config, expert_parallel=True)
    if quantization and source is None and not dummy:
        raise ValueError("quantization of a jaxserve (orbax) checkpoint is not supported yet")
    if quantization == "gguf" and not isinstance(source, GGUFSource) and not dummy:
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's blocks; {path} is not one")
    model_cls = get_model_class(config.architecture)
    mtp = getattr(hf_config, "num_nextn_predict_layers", 0)  # DeepSeek, GLM-4.5
    # Qwen3-Next's `mtp.*`; a draft of method mtp loads them itself (models/mtp.py)
    if (mtp := mtp or getattr(hf_config, "mtp_num_layers", 0)) and architecture is None:
        logger.info(
            "%s: its %d multi-token-prediction layer(s) are not loaded with it "
            "(speculative_config method mtp loads DeepSeek-V3's and GLM-4.5's as a draft)",
            config.architecture,
            mtp,
        )
    mesh = mesh if mesh is not None else make_mesh(tensor_parallel_size)
    tp = mesh.shape[TP_AXIS]
    validate_tp(config, tp)
    config = _experts_packable(config, tp)
    replicas = kv_head_replicas(config, tp)

    graphdef, state = _abstract_model(model_cls, config, replicas)
    targets = traverse_util.flatten_dict(nnx.to_pure_dict(state))  # path -> ShapeDtypeStruct
    shardings = {
        p: param_sharding(p, config, mesh_of(p) if mesh_of else mesh, targets[p].shape)
        for p in targets
    }
    if dummy:
        params = dummy_params(targets, shardings)
    elif source is None:
        params = _restore_orbax(path / "params", model_cls, config, replicas, shardings)
    else:
        params = {}
        # A GGUF's blocks are dequantized on every load: the arrays placed are cached on disk.
        cached = writer = None
        if isinstance(source, GGUFSource) and config.quantization != "gguf":
            entry = weight_cache.key(path, config, replicas)
            cached = weight_cache.read(entry, targets)
            writer = weight_cache.Writer(entry) if cached is None else None

        def place(p, host):
            params[p] = jax.make_array_from_callback(
                host.shape, shardings[p], host.__getitem__, dtype=host.dtype
            )
            if writer is not None:
                writer.add(p, host)

        try:
            if cached is not None:
                for p, host in cached.items():
                    place(p, host)
            else:
                read_params(
                    source, model_cls, config, replicas, targets, place, hub.display_name(path)
                )
            if writer is not None:
                writer.commit()
        finally:
            if writer is not None:
                writer.abort()  # nothing once committed
    logger.info("weights: %s", weight_bytes(params, config))
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(params))
    model = nnx.merge(graphdef, state)
    if source is not None:
        load_kv_scales(model, source)
    del source  # the GGUF reader's parsed metadata is large; free it before the tokenizer

    return LoadedModel(
        model=model,
        config=config,
        mesh=mesh,
        tokenizer=read_tokenizer(path) if load_tokenizer else None,
        generation_config=read_generation_config(path) if load_tokenizer else None,
    )


def _experts_packable(config: ModelConfig, tp: int) -> ModelConfig:
    """config, or, where tensor parallelism would split a packed expert scale's inputs (each
    device's slice of the intermediate size not a multiple of expert_group), gpt-oss's MXFP4
    experts in the model dtype instead (dequantized as they load), with a log line saying so;
    a checkpoint whose linear layers are packed too is refused."""
    f, group = config.moe_intermediate_size, config.expert_group
    if not config.expert_quant or config.expert_parallel or (f // tp) % group == 0:
        return config
    if config.prequantized:  # its linear layers' format too: no unpacked way to read them
        raise ValueError(
            f"tensor parallel size {tp} leaves {f // tp} of the experts' {f} intermediate "
            f"columns a device, which splits their {group}-input scale blocks: use "
            "--enable-expert-parallel, or a size that keeps whole blocks"
        )
    logger.warning(
        "%s experts: %d intermediate columns a device (tp %d) split their scales' "
        "%d inputs: the experts load unpacked, in %s",
        config.expert_quant,
        f // tp,
        tp,
        group,
        jnp.dtype(config.dtype).name,
    )
    return dataclasses.replace(config, expert_quant=None, expert_group=0)


def weight_bytes(params: dict[tuple, Any], config: ModelConfig) -> str:
    """The placed weights' bytes by class: the experts (packed, or not) with their scales,
    the linear layers' packed kernels and scales, the rest."""
    sizes: dict[str, int] = {}
    for p, a in params.items():
        leaf, dtype = str(p[-1]), jnp.dtype(a.dtype)
        if leaf.startswith(("w13", "w2")) and not leaf.endswith("bias"):
            kind = f"{config.expert_quant} experts" if config.expert_quant else "experts"
            kind += " (scales)" if "_" in leaf else ""
        elif leaf in _WITH_KERNEL or (leaf == "kernel" and quantized_dtype(a)):
            kind = f"{config.quantization} linear layers"
        else:
            kind = "the rest"
        sizes[kind] = sizes.get(kind, 0) + a.size * dtype.itemsize
    total = sum(sizes.values())
    parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in sizes.items())
    return f"{total / 2**30:.2f} GiB ({parts})"


def read_params(
    source, model_cls, config: ModelConfig, replicas: int, targets: dict, place, label: str
) -> None:
    """Read (and convert, quantize) every parameter of `targets` from `source`, handing each
    host array to `place(path, array)`."""
    layout = int4_layout(config.hf_config) if config.quantization == "int4" else None
    rows = block_rows(config.hf_config)
    for p in tqdm(targets, desc=f"Loading {label}", unit="param", leave=False):
        leaf = str(p[-1])
        if leaf in _WITH_KERNEL or (config.prequantized and leaf in _EXPERT_WITH_KERNEL):
            continue  # placed with its quantized kernel
        weight = aliased(source, model_cls.hf_weight(config, p, replicas), model_cls)
        names = ", ".join(weight.names)
        if config.expert_quant and not config.prequantized and leaf in _EXPERT_PACKED:
            place(p, _read_param(source, weight, targets[p]))  # gpt-oss's: its HFWeight packs
        elif quantized_dtype(targets[p]) and config.quantization in ("gguf", "int4", "mxfp4"):
            if config.quantization == "mxfp4":
                hosts = read_mxfp4(source, weight, config.quant_group)
            elif config.quantization == "gguf":
                blocks = [source.get_blocks(name) for name in weight.names]  # (q, d, m) each
                build = weight.build or (lambda x: x)
                hosts = [build(*(b[i] for b in blocks)) for i in range(3)]
            else:
                hosts = read_int4(
                    source,
                    weight,
                    config.quant_group,
                    layout,
                    act_order=(*p[:-1], "perm") in targets,
                    per_channel=config.quant_per_channel,
                )
            for part, host in zip(("kernel", "scale", "offset", "perm"), hosts, strict=False):
                q = _companion(p, part)
                place(q, _checked(host, targets[q].shape, names))
        elif quantized_dtype(targets[p]) and config.prequantized:
            kernel, scale = _read_prequantized(source, weight, targets[p], config.quant_group, rows)
            q = _companion(p, "scale")
            place(p, kernel)
            place(q, _checked(scale, targets[q].shape, names))
        elif quantized_dtype(targets[p]):  # read in float32, quantized per output channel
            kernel, scale = quantize_kernel(
                _read_param(source, weight, jax.ShapeDtypeStruct(targets[p].shape, np.float32)),
                config.quantization,
            )
            place(p, kernel)
            place((*p[:-1], "scale"), scale)
        elif config.prequantized and any(_scale_name(source, n) for n in weight.names):
            if leaf in ("w13", "w2") or config.quantization not in ("fp8", "fp8_block"):
                raise ValueError(
                    f"{weight.names[0]} is quantized in the checkpoint ({config.quantization}), "
                    f"but jaxserve keeps {'/'.join(map(str, p))} in full precision: not "
                    "supported for " + ("these experts" if leaf in ("w13", "w2") else "it")
                )
            # fp8 weights that are no linear layer's (MLA's per-head w_uk / w_uv): decoded
            place(p, _read_fp8_decoded(source, weight, targets[p], config.quant_group, rows))
        else:
            place(p, _read_param(source, weight, targets[p]))


_WITH_KERNEL = ("scale", "offset", "perm")  # a Linear's, beside its `kernel`
_EXPERT_PACKED = ("w13", "w2", "w13_scale", "w2_scale")  # gpt-oss's packed experts
_EXPERT_WITH_KERNEL = ("w13_scale", "w2_scale", "w13_offset", "w2_offset")


def _companion(p: tuple, part: str) -> tuple:
    """Where a quantized kernel's `part` (kernel, scale, offset, perm) is: beside a Linear's
    `kernel`, or an expert stack's (`w13` -> `w13_scale`)."""
    if part == "kernel":
        return p
    return (*p[:-1], f"{p[-1]}_{part}") if p[-1] in ("w13", "w2") else (*p[:-1], part)


# Where fp8 checkpoints keep each layer's KV cache scales, as vLLM reads them: ModelOpt's
# self_attn.{k,v}_scale, compressed-tensors' {k,v}_proj.output_scale, the older kv_scale for both.
_KV_SCALE_NAMES = (
    ("self_attn.k_scale", "self_attn.v_scale"),
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
    ("self_attn.kv_scale", "self_attn.kv_scale"),
)


def load_kv_scales(model: nnx.Module, source) -> None:
    """Set each layer's Attention.k_scale / v_scale (used by an fp8 KV cache) from the
    checkpoint's scalars, where it has them (an MTP head's block: layer L's, models/mtp.py)."""
    for i, layer in enumerate(model.layers, getattr(model, "first_hf_layer", 0)):
        for k_name, v_name in _KV_SCALE_NAMES:
            k_name, v_name = f"model.layers.{i}.{k_name}", f"model.layers.{i}.{v_name}"
            if k_name in source and v_name in source:
                attn = layer.self_attn
                attn.k_scale = float(np.asarray(source.get(k_name), np.float32).reshape(-1)[0])
                attn.v_scale = float(np.asarray(source.get(v_name), np.float32).reshape(-1)[0])
                break


def _read_param(source, weight: HFWeight, target) -> np.ndarray:
    """Read the HF tensors of one parameter and build it, in the target dtype."""
    tensors = [np.asarray(source.get(name)) for name in weight.names]
    host = weight.build(*tensors) if weight.build else tensors[0]
    return _checked(host.astype(target.dtype, copy=False), target.shape, ", ".join(weight.names))


# Where pre-quantized checkpoints keep a weight's scales: compressed-tensors' `weight_scale`,
# transformers' FineGrainedFP8 `weight_scale_inv` (multiplied, despite its name).
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")


def aliased(source, weight: HFWeight, model_cls) -> HFWeight:
    """`weight` with each name the checkpoint lacks replaced by the first of its aliases it
    has (`checkpoint_aliases`: the prefixes other versions of transformers save under)."""
    aliases = getattr(model_cls, "checkpoint_aliases", ())
    if not aliases or isinstance(source, GGUFSource):
        return weight
    names = []
    for name in weight.names:
        if name not in source:
            options = (new + name[len(old) :] for old, new in aliases if name.startswith(old))
            name = next((n for n in options if n in source), name)
        names.append(name)
    return HFWeight(tuple(names), weight.build)


def _scale_name(source, name: str) -> str | None:
    names = (name.removesuffix("weight") + suffix for suffix in _SCALE_SUFFIXES)
    return next((n for n in names if n in source), None)


def _read_prequantized(
    source, weight: HFWeight, target, group: int, rows: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """A pre-quantized kernel: each HF `*.weight` (int8 or fp8 values [out, in]) and its scales
    (per channel [out, 1], one per tensor, or, with group > 0, 2-D blocks of `rows` output
    rows and `group` inputs, the last block row possibly partial), fused and transposed like
    the float weights -> (kernel [in, out] in the target dtype, float32 scale [out], or
    [in / group, out]: each block's scale repeated over its output rows, so fusing and
    splitting output channels never cuts a block)."""
    values, scales = _prequantized_parts(source, weight, group, rows)
    build = weight.build or (lambda x: x)
    kernel = _checked(build(*values).astype(target.dtype), target.shape, ", ".join(weight.names))
    scale = build(*scales).astype(np.float32)
    return kernel, scale if group else scale.reshape(-1)


def _read_fp8_decoded(source, weight: HFWeight, target, group: int, rows: int) -> np.ndarray:
    """fp8 weights of a parameter that is no linear layer's kernel (MLA's per-head w_uk /
    w_uv, cut from kv_b_proj): each tensor decoded (values times their block's scale) before
    the parameter is built from it, in the target dtype."""
    values, scales = _prequantized_parts(source, weight, group, rows)
    decoded = [
        v.astype(np.float32) * (np.repeat(s, group, axis=1) if group else s)
        for v, s in zip(values, scales, strict=True)
    ]
    build = weight.build or (lambda x: x)
    return _checked(build(*decoded).astype(target.dtype), target.shape, ", ".join(weight.names))


def _prequantized_parts(source, weight: HFWeight, group: int, rows: int):
    """Each HF tensor of `weight` as stored ([out, in]) and its scale: [out, in / group] (each
    block's repeated over its rows), or [out, 1]."""
    values, scales = [], []
    for name in weight.names:
        scale_name = _scale_name(source, name)
        if scale_name is None:
            raise ValueError(
                f"{name.removesuffix('weight')}weight_scale is missing: a pre-quantized "
                "checkpoint must quantize every decoder linear layer (none may be in its "
                "ignore list)"
            )
        w = np.asarray(source.get(name))
        values.append(w)
        s = np.asarray(source.get(scale_name), np.float32)
        if group:
            out, d_in = w.shape
            r = rows or out // max(s.shape[0], 1)
            # the last block of output rows may be partial (DeepSeek-V3's 576-row
            # kv_a_proj_with_mqa in 128-row blocks: 5 block rows)
            if s.ndim != 2 or s.shape[0] != -(-out // r) or d_in != s.shape[1] * group:
                raise ValueError(
                    f"{scale_name} has shape {s.shape}: not the blocks of {r} output rows "
                    f"and {group} input columns of a {list(w.shape)} weight"
                )
            scales.append(np.repeat(s, r, axis=0)[:out])  # [out, in / group]
        else:
            scales.append(np.broadcast_to(s.reshape(-1), (w.shape[0],))[:, None])  # [out, 1]
    return values, scales


def _abstract_model(model_cls, config: ModelConfig, kv_replicas: int):
    """(graphdef, state of ShapeDtypeStructs): the model's structure, no weights materialised."""
    abstract = nnx.eval_shape(lambda: model_cls(config, kv_replicas=kv_replicas, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)


def _checked(w: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
    if w.shape != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {w.shape}; the config implies {shape}")
    return w


# ----------------------------------------------------------------------------------------------
# jaxserve checkpoints (orbax; written by checkpoint.py)


def _restore_orbax(
    params_dir: Path, model_cls, config: ModelConfig, kv_replicas: int, shardings: dict
) -> dict[tuple, jax.Array]:
    """Restore params straight into their shardings (and dtypes). Checkpoints hold each KV
    head once: with kv_replicas > 1 the fused qkv params are restored replicated and
    expanded on the devices."""
    import orbax.checkpoint as ocp

    if not params_dir.exists():
        raise FileNotFoundError(f"checkpoint parameters {params_dir} are missing")
    _, state = _abstract_model(model_cls, config, 1)
    saved = traverse_util.flatten_dict(nnx.to_pure_dict(state))  # path -> ShapeDtypeStruct
    replicate = kv_replicas > 1
    if replicate:  # the fused qkv params come to the host, to be expanded there
        host = SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    abstract = {
        p: jax.ShapeDtypeStruct(
            t.shape, t.dtype, sharding=host if replicate and "qkv_proj" in p else shardings[p]
        )
        for p, t in saved.items()
    }
    try:
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(params_dir.absolute(), traverse_util.unflatten_dict(abstract))
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ValueError(f"corrupt or incompatible checkpoint {params_dir}: {e}") from e
    params = traverse_util.flatten_dict(restored)
    for p in params:
        if replicate and "qkv_proj" in p:
            w = replicate_kv_heads(np.asarray(params[p]), config, kv_replicas)
            params[p] = jax.make_array_from_callback(
                w.shape, shardings[p], w.__getitem__, dtype=w.dtype
            )
    return params
