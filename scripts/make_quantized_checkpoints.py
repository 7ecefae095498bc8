"""Make the tiny quantized checkpoints the suite reads (tests/data/quantized/), with the
formats' own tools, once: never run by the suite.

    # 1. the float model and its byte tokenizer, in jaxserve's venv (tests/helpers.py)
    .venv/bin/python scripts/make_quantized_checkpoints.py base /tmp/qbase
    #    and the tiny Qwen3-MoE the MoE schemes start from
    .venv/bin/python scripts/make_quantized_checkpoints.py base-moe /tmp/qbase-moe
    # 2. quantized by llm-compressor, in a venv of its own (it pins its own transformers)
    python3 -m venv /tmp/lcvenv && /tmp/lcvenv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    /tmp/lcvenv/bin/python scripts/make_quantized_checkpoints.py quantize /tmp/qbase \
        tests/data/quantized
    #    (scheme names after the folder make only those, e.g. ct-fp8-block ct-mxfp4a16;
    #    the same for gptqmodel below); the MoE schemes (MOE_SCHEMES) from the MoE base:
    /tmp/lcvenv/bin/python scripts/make_quantized_checkpoints.py quantize /tmp/qbase-moe \
        tests/data/quantized ct-moe-fp8-block ct-moe-w4a16

    # 3. native GPTQ (v1) and AWQ (gemm) checkpoints by GPTQModel, in a venv of its own, CPU
    #    only: 7.x is pure Python (CUDA kernels are JIT-built on first GPU use, never here);
    #    7.7.0 wants torch>=2.14.1 and transformers>=5.20.2; 7.5.0 imports requests undeclared
    python3 -m venv /tmp/gqvenv && /tmp/gqvenv/bin/pip install torch==2.13.0
    /tmp/gqvenv/bin/pip install gptqmodel==7.5.0 transformers==5.17.0 requests
    /tmp/gqvenv/bin/python scripts/make_quantized_checkpoints.py gptqmodel /tmp/qbase \
        tests/data/quantized

    # 4. a tiny Qwen3.5-MoE and a tiny Gemma 4 in W4A16 by compressed-tensors alone, in
    #    jaxserve's venv
    .venv/bin/pip install --no-deps --target /tmp/ct compressed-tensors==0.20.1 loguru
    PYTHONPATH=/tmp/ct .venv/bin/python scripts/make_quantized_checkpoints.py qwen3_5 \
        tests/data/quantized
    PYTHONPATH=/tmp/ct .venv/bin/python scripts/make_quantized_checkpoints.py gemma4 \
        tests/data/quantized

Each checkpoint directory also holds `reference_logits.npz`: transformers' float32 logits of
the checkpoint as its own library (compressed-tensors) decompresses it, for fixed prompts, so
the suite compares against the format's maintained code without installing it. For GPTQModel's
checkpoints those logits come from the checkpoint loaded back by GPTQModel (its CPU torch
kernels), each quantized linear dequantized by the library in float32 and the model run in
float32; `reference_dequant.npz` holds that dequantized weight of `DEQUANT_LAYER`, [out, in].
The llm-compressor preset checkpoints (PRESET_SCHEMES) hold it too, as compressed-tensors
decompresses it, and where the scheme also quantizes activations (FP8_BLOCK)
`reference_logits_weight_only.npz` holds the logits with that switched off.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# A tiny Llama whose every linear input size is a multiple of the int4 group (32)
SHAPES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256)  # fmt: skip
PROMPTS = [list(range(3, 14)), list(range(40, 57)), [7, 100, 200, 33, 45, 46, 47]]
# name -> (symmetric, group size or None: one scale per channel): llm-compressor's GPTQ
# W4A16 and W4A16_ASYM with these groups (its actorder "group", a stored weight_g_idx, is
# gone: compressed-tensors 0.19 refuses it)
SCHEMES = {"ct-w4a16-g32": (True, 32), "ct-w4a16-asym-g64": (False, 64),
           "ct-w4a16-channel": (True, None)}  # fmt: skip
# name -> llm-compressor preset scheme, data-free (QuantizationModifier: round to nearest from
# the weights alone): FP8_BLOCK (e4m3 weights, a float32 scale per 128 x 128 block; its dynamic
# per-token fp8 activations, groups of 128, are part of the scheme) and MXFP4A16 (weight-only
# e2m1, an e8m0 exponent per 32 inputs). These also write reference_dequant.npz.
PRESET_SCHEMES = {"ct-fp8-block": "FP8_BLOCK", "ct-mxfp4a16": "MXFP4A16"}
# A tiny Qwen3-MoE (8 experts, top 2) whose every linear input is a multiple of 128, and the
# schemes llm-compressor quantizes it by, the routed experts included (its Qwen3-MoE experts
# linearized for the modifier, saved back per expert), the router left in full precision, no
# calibration (round to nearest): weight-only fp8 in 64 x 64 blocks, and W4A16 (int4, a scale
# per 64 inputs, symmetric): blocks and groups small enough that tp 2 keeps whole ones
MOE_SHAPES = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_hidden_layers=2,
    max_position_embeddings=256,
)
MOE_SCHEMES = {
    "ct-moe-fp8-block": {"num_bits": 8, "type": "float", "strategy": "block",
                         "block_structure": [64, 64], "symmetric": True},
    "ct-moe-w4a16": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64,
                     "symmetric": True},
    "ct-moe-mxfp4a16": "MXFP4A16",  # a preset scheme: e2m1, an e8m0 exponent per 32
}  # fmt: skip
# name -> (method, symmetric, group size, desc_act): GPTQModel's native GPTQ (v1) and AWQ gemm
GPTQMODEL_SCHEMES = {
    "gptq-w4-g32": ("gptq", True, 32, False),
    "gptq-w4-asym-g64-actorder": ("gptq", False, 64, True),
    "awq-w4-g64": ("awq", False, 64, False),
    "gptq-w4-channel-actorder": ("gptq", True, -1, True),  # group_size -1: g_idx all 0
    # from the MoE base (base-moe): the routed experts quantized too
    "gptq-moe-w4-g64": ("gptq", True, 64, False),
}
DEQUANT_LAYER = "model.layers.0.self_attn.q_proj"  # the layer reference_dequant.npz holds
CALIBRATION = [
    f"Sentence {i}: the {w} {v} over the {o} while it {t}."
    for i, (w, v, o, t) in enumerate(
        [(w, v, o, t) for w in ("quick fox", "old man", "red car", "tall tree")
         for v in ("jumps", "looks", "runs") for o in ("lazy dog", "river", "hill")
         for t in ("rains", "snows")][:48]
    )
]  # fmt: skip


def base(out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers import make_tiny_hf, make_tiny_tokenizer

    out_dir = Path(out)
    make_tiny_hf("llama", out_dir, vocab_size=make_tiny_tokenizer(out_dir), **SHAPES)


def base_moe(out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers import make_tiny_hf, make_tiny_tokenizer

    out_dir = Path(out)
    make_tiny_hf("qwen3_moe", out_dir, vocab_size=make_tiny_tokenizer(out_dir), **MOE_SHAPES)


def quantize(base_dir: str, out: str, *names: str) -> None:
    """Every scheme of SCHEMES and PRESET_SCHEMES, or only those named after `out` (also
    MOE_SCHEMES', from the MoE base)."""
    import numpy as np
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    names = names or (*SCHEMES, *PRESET_SCHEMES)
    unknown = set(names) - SCHEMES.keys() - PRESET_SCHEMES.keys() - MOE_SCHEMES.keys()
    assert not unknown, f"unknown schemes {sorted(unknown)}"
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    data = Dataset.from_dict({"text": CALIBRATION}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=64),
        remove_columns=["text"],
    )
    for name in names:
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        if name in SCHEMES:
            symmetric, group = SCHEMES[name]
            weights = {"num_bits": 4, "type": "int", "symmetric": symmetric,
                       "strategy": "channel" if group is None else "group"}  # fmt: skip
            if group is not None:
                weights["group_size"] = group
            recipe = GPTQModifier(
                ignore=["lm_head"],
                config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
            )
            oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=len(data))
        elif name in MOE_SCHEMES:
            scheme, ignore = MOE_SCHEMES[name], ["lm_head", "re:.*mlp.gate$"]
            recipe = (
                QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)
                if isinstance(scheme, str)
                else QuantizationModifier(
                    ignore=ignore,
                    config_groups={"group_0": {"targets": ["Linear"], "weights": scheme}},
                )
            )
            oneshot(model=model, recipe=recipe)
        else:
            # data-free: round-to-nearest from the weights alone, no calibration
            recipe = QuantizationModifier(
                targets="Linear", scheme=PRESET_SCHEMES[name], ignore=["lm_head"]
            )
            oneshot(model=model, recipe=recipe)
        dst = Path(out) / name
        model.save_pretrained(dst, save_compressed=True)
        tokenizer.save_pretrained(dst)
        if name in MOE_SCHEMES:
            # transformers folds Qwen3-MoE's experts into fused tensors as it loads, so its
            # compressed-tensors hook never sees them: each stored layer decompressed by
            # compressed-tensors' own compressor instead, the float checkpoint loaded back
            ref = _decompressed_by_library(dst, base_dir)
            w = {f"{EXPERT_LAYER}.weight": ref.pop(EXPERT_LAYER)}
            ref = AutoModelForCausalLM.from_pretrained(ref.pop("dir"), dtype=torch.float32)
            ref = ref.eval()
            np.savez_compressed(dst / "reference_dequant.npz", **w)
        elif name in SCHEMES:
            # decompressed by compressed-tensors' hook on the first forward
            ref = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
        else:
            # Decompressed at load (dequantize=True), then .float(): compressed-tensors
            # decompresses MXFP4 in bfloat16 whatever the load dtype (e2m1 value times 2^k,
            # exact in bfloat16, so .float() loses nothing), and with the default route (the
            # decompress hook) the float32 forward fails (float != BFloat16) and transformers
            # refuses .float(). FP8_BLOCK decompresses in its float32 scales' dtype: the same
            # logits by either route, .float() a no-op.
            ref = AutoModelForCausalLM.from_pretrained(
                dst, dtype=torch.float32,
                quantization_config=CompressedTensorsConfig(dequantize=True),
            ).eval().float()  # fmt: skip
            weight = ref.get_submodule(DEQUANT_LAYER).weight.detach().float()
            np.savez_compressed(dst / "reference_dequant.npz",
                                **{f"{DEQUANT_LAYER}.weight": weight.numpy()})  # fmt: skip
        with torch.no_grad():
            logits = {f"prompt_{i}": ref(torch.tensor([p])).logits[0].numpy()
                      for i, p in enumerate(PROMPTS)}  # fmt: skip
        np.savez_compressed(dst / "reference_logits.npz", **logits)
        if name in PRESET_SCHEMES and any(
            getattr(getattr(m, "quantization_scheme", None), "input_activations", None)
            for m in ref.modules()
        ):
            # the library's forward also fake-quantizes each linear's input (FP8_BLOCK:
            # dynamic fp8 per token and 128 inputs); these logits are the same model with
            # that switched off, the decompressed weights alone
            for m in ref.modules():
                if hasattr(m, "quantization_scheme"):
                    m.quantization_enabled = False
            with torch.no_grad():
                weight_only = {f"prompt_{i}": ref(torch.tensor([p])).logits[0].numpy()
                               for i, p in enumerate(PROMPTS)}  # fmt: skip
            gap = max(np.abs(logits[k] - weight_only[k]).max() for k in logits)
            print(name, "max |logits - weight-only logits|:", gap)
            np.savez_compressed(dst / "reference_logits_weight_only.npz", **weight_only)
        (dst / "reference_prompts.json").write_text(json.dumps(PROMPTS))
        print(name, "->", dst)


EXPERT_LAYER = "model.layers.1.mlp.experts.3.down_proj"  # the MoE schemes' reference_dequant


def _decompressed_by_library(dst: Path, base_dir: str) -> dict:
    """The checkpoint at dst decompressed layer by layer by compressed-tensors (its
    compressor for the config's format and scheme) and written as a float checkpoint beside
    it (the base model's config): {"dir": that directory, EXPERT_LAYER: its weight [out, in]}."""
    import shutil
    import tempfile

    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file, save_file

    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme(**{k: v for k, v in group.items() if k != "output_activations"})
    compressor = BaseCompressor.get_value_from_registry(group.get("format", qc["format"]))
    stored = load_file(dst / "model.safetensors")
    prefixes = {k.rsplit(".", 1)[0] for k in stored if k.endswith("weight_scale")}
    dense = {k: v for k, v in stored.items() if k.rsplit(".", 1)[0] not in prefixes}
    for prefix in sorted(prefixes):
        local = {k[len(prefix) + 1 :]: v for k, v in stored.items() if k.startswith(prefix + ".")}
        dense[f"{prefix}.weight"] = compressor.decompress(local, scheme)["weight"].float()
    out = Path(tempfile.mkdtemp(prefix=dst.name + "-decompressed-"))
    for f in Path(base_dir).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    save_file(
        {k: v.contiguous() for k, v in dense.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    return {"dir": out, EXPERT_LAYER: dense[f"{EXPERT_LAYER}.weight"].numpy()}


def gptqmodel(base_dir: str, out: str, *names: str) -> None:
    """Every scheme of GPTQMODEL_SCHEMES, or only those named after `out`."""
    import os

    # its CPU thread pool wants 2 workers but defaults to cores // 2 (1 on a 2-core machine)
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    import numpy as np
    import torch
    from gptqmodel import BACKEND, AWQConfig, GPTQConfig, GPTQModel
    from gptqmodel.nn_modules.qlinear import AWQuantLinear, BaseQuantLinear
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    names = names or tuple(GPTQMODEL_SCHEMES)
    assert set(names) <= GPTQMODEL_SCHEMES.keys(), f"unknown schemes {names}"
    for name in names:
        method, symmetric, group, desc_act = GPTQMODEL_SCHEMES[name]
        dst = Path(out) / name
        if method == "gptq":
            # act_group_aware off: desc_act=False then keeps g_idx = i // group
            config = GPTQConfig(bits=4, group_size=group, sym=symmetric, desc_act=desc_act,
                                act_group_aware=False, offload_to_disk=False)  # fmt: skip
            # quantized from float32; the saved checkpoint is v1 ("gptq", zeros minus one)
            dtype, backend = torch.float32, BACKEND.GPTQ_TORCH
        else:
            # its AWQ packer (the CPU torch kernel) takes float16 or bfloat16 only
            config = AWQConfig(bits=4, group_size=group, sym=symmetric, offload_to_disk=False)
            dtype, backend = torch.float16, BACKEND.AWQ_TORCH
        model = GPTQModel.load(base_dir, config, device="cpu", dtype=dtype)
        model.quantize(CALIBRATION, batch_size=1, backend=backend)
        model.save(str(dst))
        tokenizer.save_pretrained(dst)
        (dst / "quant_log.csv").unlink(missing_ok=True)  # per-run timings, not the checkpoint

        # Loaded back by the library on CPU (its torch kernels run float16/bfloat16 only)
        ref = GPTQModel.load(str(dst), device="cpu", backend=backend, dtype=torch.float16)
        hf = ref.model.eval()
        with torch.no_grad():
            kernel = [hf(torch.tensor([p])).logits[0].float() for p in PROMPTS]
        # ...then each quantized linear replaced by the library's own dequantization done in
        # float32 (its float16 scales upcast before the multiply), the rest of the model set
        # to the float tensors the checkpoint stores, and run in float32
        dequant = {}
        for mod_name, mod in list(hf.named_modules()):
            if not isinstance(mod, BaseQuantLinear):
                continue
            with torch.no_grad():
                if isinstance(mod, AWQuantLinear):
                    w = dequantize_gemm(mod.qweight, mod.qzeros, mod.scales.float(), mod.bits,
                                        mod.group_size)  # fmt: skip
                else:
                    mod.scales = mod.scales.float()
                    w = mod.dequantize_weight()
            w = w.float().T.contiguous()  # [in, out] -> HF [out, in]
            linear = torch.nn.Linear(mod.in_features, mod.out_features, bias=False)
            linear.weight = torch.nn.Parameter(w, requires_grad=False)
            parent, _, child = mod_name.rpartition(".")
            setattr(hf.get_submodule(parent), child, linear)
            if mod_name == DEQUANT_LAYER:
                dequant[f"{mod_name}.weight"] = w.numpy()
                print(name, f"{mod_name}.weight", tuple(w.shape), w[:2, :6])
        hf.float()
        stored = load_file(dst / "model.safetensors")
        floats = {k: v.float() for k, v in stored.items() if v.is_floating_point()}
        floats = {k: v for k, v in floats.items() if not k.endswith(".scales")}
        assert floats.keys() <= hf.state_dict().keys(), floats.keys() - hf.state_dict().keys()
        hf.load_state_dict(floats, strict=False)
        with torch.no_grad():
            logits = [hf(torch.tensor([p])).logits[0] for p in PROMPTS]
        gap = max((a - b).abs().max().item() for a, b in zip(logits, kernel, strict=True))
        print(name, "max |float32 dequant - library float16 kernel| logits:", gap)
        np.savez_compressed(dst / "reference_logits.npz",
                            **{f"prompt_{i}": x.numpy() for i, x in enumerate(logits)})  # fmt: skip
        np.savez_compressed(dst / "reference_dequant.npz", **dequant)
        (dst / "reference_prompts.json").write_text(json.dumps(PROMPTS))
        print(name, "->", dst)


# A tiny Qwen3.5-MoE (tests/models/test_qwen3_5.py's shape: linear, full, linear layers) in
# compressed-tensors' W4A16 (int4, symmetric, a scale per 16 inputs: the smallest input of a
# projection here is 32, the shared expert's 48), round to nearest: every decoder projection,
# the linear attention's, the routed and the shared experts' included; routers, the shared
# expert's gate, the linear attention's in_proj_a / in_proj_b (a row per value head, full
# precision in the published FP8 builds too) and lm_head in full precision.
QWEN35_NAME = "ct-qwen3_5-moe-w4a16"
QWEN35_GROUP = 16


def qwen35(out: str) -> None:
    """QWEN35_NAME by compressed-tensors alone (its own qparams, quantization and packing, no
    llm-compressor: it pins a transformers without Qwen3.5), in jaxserve's venv with
    compressed-tensors importable (PYTHONPATH=DIR after `pip install --no-deps --target DIR
    compressed-tensors==0.20.1 loguru`); its reference is the layers as the same library
    decompresses them, run by transformers in float32."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.models.test_qwen3_5 import MOE, SHAPE

    keep = ("mlp.gate.weight", "shared_expert_gate.weight", "in_proj_a.weight", "in_proj_b.weight")
    _w4a16(out, QWEN35_NAME, "qwen3_5_moe", {**SHAPE, **MOE}, keep)


# A tiny Gemma 4 (tests/models/test_gemma4_quantized.py's dense build: wider full layers whose
# V is K, KV-sharing layers, per-layer inputs) in the same W4A16 (a scale per 16 inputs): the
# attention's and MLPs' projections; the per-layer-input projections (8 wide here) and
# lm_head in full precision.
GEMMA4_NAME = "ct-gemma4-w4a16"


def gemma4(out: str) -> None:
    """GEMMA4_NAME, as `qwen35` makes its checkpoint."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.models.test_gemma4_quantized import DENSE

    keep = ("per_layer_input_gate.weight", "per_layer_projection.weight")
    _w4a16(out, GEMMA4_NAME, "gemma4", DENSE, keep)


def _w4a16(out: str, name: str, family: str, shape: dict, keep: tuple[str, ...]) -> None:
    """A tiny `family` model (tests/helpers.py::make_tiny_hf) in compressed-tensors' W4A16,
    round to nearest: every 2-D decoder weight but norms and `keep`; with the references."""
    import shutil

    import numpy as np
    import torch
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers import make_tiny_hf, make_tiny_tokenizer

    dst = Path(out) / name
    vocab = make_tiny_tokenizer(dst)
    tables = ["vocab_size"] + [k for k in ("vocab_size_per_layer_input",) if k in shape]
    make_tiny_hf(family, dst, **{**shape, **dict.fromkeys(tables, vocab)})  # the tokenizer's
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=QWEN35_GROUP)  # fmt: skip
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    weights = load_file(dst / "model.safetensors")
    stored, decoded, ignore = {}, {}, ["lm_head"]
    for tensor, w in weights.items():
        quantized = ".layers." in tensor and w.ndim == 2 and tensor.endswith("weight")
        if not quantized or tensor.endswith(keep) or "norm" in tensor:
            stored[tensor] = decoded[tensor] = w
            if tensor.endswith(keep):
                ignore.append(tensor.removesuffix(".weight"))
            continue
        groups = w.float().reshape(w.shape[0], -1, QWEN35_GROUP)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        local = {"weight": w.float(), "weight_scale": scale, "weight_zero_point": zero}
        packed = compressor.compress(local, scheme)
        prefix = tensor.removesuffix(".weight")
        stored.update({f"{prefix}.{k}": v for k, v in packed.items()})
        decoded[tensor] = compressor.decompress(packed, scheme)["weight"].float()
    save_file({k: v.contiguous() for k, v in stored.items()}, dst / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": sorted(ignore),
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                      "weights": args.model_dump(), "input_activations": None,
                                      "output_activations": None}},
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    ref_dir = Path(out) / f"{name}-decompressed"
    shutil.copytree(dst, ref_dir, dirs_exist_ok=True)
    config.pop("quantization_config")
    (ref_dir / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in decoded.items()}, ref_dir / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    shutil.rmtree(ref_dir)
    with torch.no_grad():
        logits = {f"prompt_{i}": ref(torch.tensor([p])).logits[0].numpy()
                  for i, p in enumerate(PROMPTS)}  # fmt: skip
        generated = [_greedy(ref, p, GENERATE_STEPS) for p in GENERATE_PROMPTS]
    np.savez_compressed(dst / "reference_logits.npz", **logits)
    (dst / "reference_prompts.json").write_text(json.dumps(PROMPTS))
    (dst / "reference_generate.json").write_text(json.dumps(
        {"prompts": GENERATE_PROMPTS, "tokens": [g[0] for g in generated],
         "logprobs": [g[1] for g in generated]}))  # fmt: skip
    print(name, "->", dst)


# reference_generate.json: transformers' greedy tokens (and each one's logprob) of these
# prompts, for an engine run with chunked prefill and preemption (test_qwen3_5.py)
GENERATE_PROMPTS = [
    list(range(5, 10)),
    list(range(20, 39)),
    list(range(60, 90)),
    [9, 8, 7, 6, 5, 4, 3],
]
GENERATE_STEPS = 12


def _greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens after prompt and each one's logprob: its forward over the
    whole sequence each step, past any EOS (as the engine's ignore_eos; HF generate's tokens
    where it does not stop)."""
    import torch

    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(steps):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(torch.log_softmax(logits, -1)[token].item())
        ids.append(token)
    return tokens, logprobs


if __name__ == "__main__":
    commands = {"base": base, "base-moe": base_moe, "quantize": quantize, "gptqmodel": gptqmodel,
                "qwen3_5": qwen35, "gemma4": gemma4}  # fmt: skip
    commands[sys.argv[1]](*sys.argv[2:])
