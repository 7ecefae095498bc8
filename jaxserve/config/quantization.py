"""What a pre-quantized checkpoint's `quantization_config` holds, as jaxserve's quantization
modes (layers/linear.py): compressed-tensors, transformers' fp8, GPTQ and AWQ; every variant
that is not supported is a ValueError naming the field and its value."""

from __future__ import annotations

from typing import Any

# --quantization names that select a pre-quantized checkpoint's own method (vLLM's; the
# marlin ones are its GPU kernels for the same checkpoints) -> the config's quant_method.
CHECKPOINT_METHODS = {"compressed-tensors": "compressed-tensors", "gptq": "gptq",
                      "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
                      "mxfp4": "mxfp4"}  # fmt: skip
# Modes whose kernels carry a scale (and offset) per group of input rows (layers/linear.py).
GROUPED_QUANT = ("gguf", "fp8_block", "int4", "mxfp4")


def _config(hf_config: Any) -> dict:
    """The checkpoint's quantization_config as a dict; {} for a full-precision checkpoint."""
    qc = getattr(hf_config, "quantization_config", None)
    return (qc if isinstance(qc, dict) else qc.to_dict()) if qc else {}


def checkpoint_quantization(hf_config: Any) -> tuple[str, int] | None:
    """The weights of a pre-quantized checkpoint (its config's quantization_config), as
    (mode, group): ("int4", group size, -1 for one group per output channel) for 4-bit
    weights: compressed-tensors pack-quantized, GPTQ, AWQ (the layouts:
    models/int4_checkpoints.py); ("mxfp4", 32) for compressed-tensors
    mxfp4-pack-quantized (OCP MX FP4: e2m1 values, an e8m0 scale per 32);
    ("int8" | "fp8", 0) for 8-bit symmetric per-channel or per-tensor weights
    stored unpacked (compressed-tensors int-, naive- or float-quantized; HF `fp8` without
    blocks); ("fp8_block", input rows per block) for e4m3 weights with 2-D block scales (HF
    `quant_method: fp8` with weight_block_size, compressed-tensors' block strategy). A
    compressed-tensors W8A8 checkpoint's dynamic inputs: `input_quantization`.
    None for a full-precision checkpoint; ValueError naming anything else."""
    qc = _config(hf_config)
    if not qc:
        return None
    method, fmt = qc.get("quant_method"), qc.get("format")
    if method == "mxfp4":  # gpt-oss's: only the experts, dequantized as they load
        return _gpt_oss_mxfp4(hf_config, qc)
    if method == "fp8":
        return _hf_fp8(qc)
    if method in ("gptq", "awq"):
        return ("int4", _gptq_awq_group(qc, method))
    if method != "compressed-tensors":
        raise ValueError(
            f"checkpoint quantization {method!r} is not supported (compressed-tensors, GPTQ "
            "and AWQ 4-bit, HF fp8 are; or load a full-precision checkpoint with "
            "--quantization int8|fp8)"
        )
    formats = ("int-quantized", "naive-quantized", "float-quantized", "pack-quantized",
               "mxfp4-pack-quantized")  # fmt: skip
    if fmt not in formats:
        raise ValueError(
            f"compressed-tensors format {fmt!r} is not supported ({', '.join(formats)})"
        )
    modes = set()
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        kind, strategy = (w.get("type"), w.get("num_bits")), w.get("strategy")
        if group.get("format", fmt) == "pack-quantized":
            modes.add(("int4", _int4_group(w, name)))
            continue
        if group.get("format", fmt) == "mxfp4-pack-quantized":
            if (w.get("type"), w.get("num_bits"), w.get("group_size")) != ("float", 4, 32):
                raise ValueError(
                    f"compressed-tensors group {name!r}: mxfp4-pack-quantized weights must be "
                    f"float 4-bit in groups of 32, not {w.get('type')} {w.get('num_bits')}-bit "
                    f"in groups of {w.get('group_size')}"
                )
            modes.add(("mxfp4", 32))
            continue
        if kind == ("float", 8) and strategy == "block":
            modes.add(("fp8_block", _block_rows(w.get("block_structure"), f"group {name!r}")))
        elif kind in (("int", 8), ("float", 8)) and strategy in ("channel", "tensor"):
            modes.add(("int8" if kind[0] == "int" else "fp8", 0))
        else:
            raise ValueError(
                f"compressed-tensors group {name!r}: {w.get('type')} {w.get('num_bits')}-bit "
                f"{strategy} weights are not supported (8-bit channel or tensor, fp8 block)"
            )
        if not w.get("symmetric", True):
            raise ValueError(f"compressed-tensors group {name!r}: asymmetric weights")
    if len(modes) != 1:
        raise ValueError(f"compressed-tensors weights of mixed kinds {sorted(modes)}")
    return modes.pop()


# Packed formats `--load-format dummy` fills with random weights when `-q` names one (the
# checkpoint formats' own modes, for timing shapes no checkpoint here has): inputs per scale.
DUMMY_PACKED = {"mxfp4": 32, "int4": 128, "fp8_block": 128}


def expert_quantization(hf_config: Any) -> str | None:
    """How a mixture-of-experts checkpoint keeps its routed experts: packed as "mxfp4"
    (gpt-oss's, or compressed-tensors'), "fp8_block" or "int4" (pack-quantized, GPTQ, AWQ),
    in the checkpoint's groups; None when they load in the model dtype (unquantized or left
    out of the quantization, or stored in a variant models/loader.py refuses for experts:
    act-order int4, per-tensor or per-channel 8-bit)."""
    qc = _config(hf_config)
    if qc.get("quant_method") == "mxfp4":
        return "mxfp4"
    mode = checkpoint_quantization(hf_config)
    if mode is None or mode[0] not in ("fp8_block", "int4", "mxfp4") or int4_act_order(hf_config):
        return None
    if any("experts" in str(m) for m in qc.get("ignore") or ()):  # compressed-tensors'
        return None
    return mode[0]


def block_rows(hf_config: Any) -> int:
    """The output rows of an fp8 block checkpoint's 2-D blocks (weight_block_size[0] or
    compressed-tensors' block_structure[0]); 0 for any other checkpoint."""
    qc = _config(hf_config)
    if qc.get("quant_method") == "fp8" and qc.get("weight_block_size"):
        return int(qc["weight_block_size"][0])
    for group in (qc.get("config_groups") or {}).values():
        block = (group.get("weights") or {}).get("block_structure")
        if block:
            return int(block[0])
    return 0


def _gpt_oss_mxfp4(hf_config: Any, qc: dict) -> None:
    """gpt-oss's `quant_method: mxfp4`: its experts' `*_blocks` / `*_scales`
    (models/gpt_oss.py), everything else unquantized."""
    archs = getattr(hf_config, "architectures", None) or []
    if archs[:1] != ["GptOssForCausalLM"]:
        raise ValueError(
            f"quant_method 'mxfp4' is supported for GptOssForCausalLM's experts, not {archs}"
        )
    for module in qc.get("modules_to_not_convert") or ():
        if "experts" in str(module):
            raise ValueError(
                f"mxfp4 checkpoint modules_to_not_convert {module!r}: unquantized experts in "
                "an MXFP4 gpt-oss checkpoint are not supported"
            )


# Module names a checkpoint may keep unquantized: jaxserve keeps them in full precision anyway.
_FULL_PRECISION_MODULES = ("lm_head", "embed_tokens", "norm", "gate", "router")


def _hf_fp8(qc: dict) -> tuple[str, int]:
    """transformers' FineGrainedFP8 checkpoints: e4m3 `weight` and `weight_scale_inv`."""
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"fp8 checkpoint activation_scheme {qc.get('activation_scheme')!r} is not "
            "supported (dynamic)"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 checkpoint fmt {qc.get('fmt')!r} is not supported (e4m3)")
    for module in qc.get("modules_to_not_convert") or ():
        if not str(module).split(".")[-1].startswith(_FULL_PRECISION_MODULES):
            raise ValueError(
                f"fp8 checkpoint modules_to_not_convert {module!r}: decoder layers left in "
                "full precision are not supported"
            )
    if qc.get("weight_block_size") is None:
        return ("fp8", 0)  # one scale per tensor
    return ("fp8_block", _block_rows(qc["weight_block_size"], "weight_block_size"))


def _int4_group(w: dict, name: str) -> int:
    """compressed-tensors pack-quantized weights (llm-compressor's W4A16 / W4A16_ASYM): int
    4-bit, grouped along the input; the group size."""
    what = f"compressed-tensors group {name!r}"
    if (w.get("type"), w.get("num_bits")) != ("int", 4):
        raise ValueError(
            f"{what}: {w.get('type')} {w.get('num_bits')}-bit packed weights are not supported "
            "(int 4-bit)"
        )
    if w.get("strategy") == "channel":
        return -1  # one scale per output channel
    if w.get("strategy") != "group" or not isinstance(w.get("group_size"), int):
        raise ValueError(
            f"{what}: strategy {w.get('strategy')!r} is not supported for 4-bit weights "
            "(group, channel)"
        )
    if w.get("actorder") not in (None, "static", "weight"):  # compressed-tensors 0.19
        raise ValueError(  # itself refuses "group" and "dynamic" (a stored weight_g_idx)
            f"{what}: actorder {w.get('actorder')!r} is not supported (weight, static or "
            "none; compressed-tensors itself no longer loads 'group')"
        )
    return w["group_size"]


def quant_method(hf_config: Any) -> str | None:
    return _config(hf_config).get("quant_method")


def int4_act_order(hf_config: Any) -> bool:
    """Whether a 4-bit checkpoint's input rows are grouped by a stored g_idx (GPTQ
    `desc_act`) rather than contiguously; never with one group per channel, where the order
    changes nothing."""
    qc = _config(hf_config)
    return (
        qc.get("quant_method") == "gptq"
        and bool(qc.get("desc_act"))
        and (qc.get("group_size") != -1)
    )


def per_channel_group(*input_sizes: int) -> int:
    """The kernel group that stands for one scale per output channel (group_size -1,
    strategy "channel"): the largest power of two up to 128 that divides every linear input
    size by 8, so that tensor parallelism up to 8 splits whole groups; each channel's scale
    and zero point are repeated over its groups at load."""
    group = 128
    while any((size // 8) % group for size in input_sizes if size) and group > 1:
        group //= 2
    return group


def int4_layout(hf_config: Any) -> str:
    """The packed layout of an "int4" checkpoint (models/int4_checkpoints.py):
    "compressed-tensors", "gptq", "gptq_v2" or "awq"."""
    qc = _config(hf_config)
    if qc.get("quant_method") == "gptq" and qc.get("checkpoint_format") == "gptq_v2":
        return "gptq_v2"
    return qc.get("quant_method")


def _gptq_awq_group(qc: dict, method: str) -> int:
    """GPTQ (AutoGPTQ / GPTQModel) and AWQ ("gemm") 4-bit checkpoints; the group size."""
    what = f"{method} checkpoint"
    if qc.get("bits") != 4:
        raise ValueError(f"{what}: bits {qc.get('bits')!r} are not supported (4)")
    group = qc.get("group_size")
    if not isinstance(group, int) or not (group > 0 or group == -1):
        raise ValueError(
            f"{what}: group_size {group!r} is not supported (a positive group size, or -1: one "
            "group per channel)"
        )
    if qc.get("lm_head"):
        raise ValueError(f"{what}: a quantized lm_head is not supported")
    if qc.get("dynamic"):
        raise ValueError(f"{what}: per-module `dynamic` overrides are not supported")
    if method == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{what}: checkpoint_format {fmt!r} is not supported (gptq)")
    else:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{what}: version {version!r} is not supported (gemm)")
        if qc.get("zero_point") is False:
            raise ValueError(f"{what}: zero_point false is not supported")
    return group


def _block_rows(block: Any, field: str) -> int:
    """[output rows, input columns] of a block -> the input columns (the kernel's group)."""
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(f"fp8 {field} {block!r} is not [rows, columns] of a 2-D block")
    return block[1]


def input_quantization(hf_config: Any) -> tuple[str, int] | None:
    """A compressed-tensors W8A8 checkpoint's `input_activations`, as (kind, group): "fp8" or
    "int8", dynamic and symmetric, one scale per token (group 0, strategy "token") or per
    group_size inputs of a token (strategy "group"); None when its inputs stay unquantized."""
    qc = _config(hf_config)
    if qc.get("quant_method") != "compressed-tensors":
        return None
    found = set()
    for name, group in (qc.get("config_groups") or {}).items():
        a = group.get("input_activations")
        if not a:
            found.add(None)
            continue
        what = f"compressed-tensors group {name!r} input_activations"
        kind = {("float", 8): "fp8", ("int", 8): "int8"}.get((a.get("type"), a.get("num_bits")))
        if kind is None:
            raise ValueError(
                f"{what}: {a.get('type')} {a.get('num_bits')}-bit inputs are not supported "
                "(8-bit float or int)"
            )
        if not a.get("dynamic") or not a.get("symmetric", True):
            raise ValueError(
                f"{what}: dynamic={a.get('dynamic')!r} symmetric={a.get('symmetric', True)!r} "
                "is not supported (dynamic, symmetric)"
            )
        strategy = a.get("strategy")
        if strategy == "token":
            found.add((kind, 0))
        elif strategy == "group" and isinstance(a.get("group_size"), int):
            found.add((kind, a["group_size"]))
        else:
            raise ValueError(f"{what}: strategy {strategy!r} is not supported (token, group)")
    if len(found) > 1:
        raise ValueError(f"compressed-tensors input_activations of mixed kinds {found}")
    return found.pop() if found else None
