"""LLaVA's and Gemma 3's vision encoders (jaxserve/models/vision) against HF transformers'
`get_image_features` in fp32, on tiny random models loaded through `hf_weight` from the
tensors save_pretrained writes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file

from jaxserve.models.vision.clip import LlavaVisionEncoder
from jaxserve.models.vision.siglip import Gemma3VisionEncoder
from jaxserve.models.vision.vit import full_attention

transformers = pytest.importorskip("transformers")

TEXT = {"hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}


def _randomize(model: torch.nn.Module) -> None:
    """Every vision / projector weight random at a scale that makes errors visible (HF
    initializes Gemma 3's projector to zeros and norms to ones)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name:
                continue
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))


def _build(cls, hf_model, tmp_path_factory) -> dict:
    """Save `hf_model`, then build `cls` from its config dict and fill every parameter from the
    saved tensors through `cls.hf_weight` (the loader's contract). -> a case dict."""
    path = tmp_path_factory.mktemp(cls.__name__)
    hf_model.save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    config = hf_model.config.to_dict()
    module = cls(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    state = nnx.state(module, nnx.Param)
    used = set()
    for p, var in nnx.to_flat_state(state):
        w = cls.hf_weight(config, p)
        arrays = [tensors[n] for n in w.names]
        value = arrays[0] if w.build is None else w.build(*arrays)
        assert value.shape == var.shape, (p, value.shape, var.shape)
        var.set_value(jnp.asarray(value, var.dtype))
        used.update(w.names)
    nnx.update(module, state)
    return {"hf": hf_model, "module": module, "config": config, "tensors": tensors, "used": used}


def _jit_call(module: nnx.Module, pixels: np.ndarray) -> np.ndarray:
    graphdef, state = nnx.split(module)
    fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    return np.asarray(fn(state, jnp.asarray(pixels)))


def _close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert np.abs(ref).max() > 1e-2  # not a trivially small output
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


def _llava(tmp_path_factory, vision: dict, **top) -> dict:
    torch.manual_seed(0)
    cfg = transformers.LlavaConfig(
        vision_config={**TOWER, "image_size": 28, "patch_size": 14, **vision},
        text_config={"model_type": "llama", **TEXT},
        **top,
    )
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    _randomize(model)
    return _build(LlavaVisionEncoder, model, tmp_path_factory)


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> dict:
    """CLIP tower of 3 layers, vision_feature_layer -2 (HF's default)."""
    return _llava(tmp_path_factory, {"num_hidden_layers": 3})


@pytest.fixture(scope="module")
def llava_multi(tmp_path_factory) -> dict:
    """vision_feature_layer [-3, -1]: two hidden states concatenated; no projector bias."""
    return _llava(
        tmp_path_factory, {"num_hidden_layers": 3},
        vision_feature_layer=[-3, -1], multimodal_projector_bias=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> dict:
    torch.manual_seed(0)
    cfg = transformers.Gemma3Config(
        vision_config={**TOWER, "num_hidden_layers": 2, "image_size": 64, "patch_size": 8},
        text_config={**TEXT, "head_dim": 16},
        mm_tokens_per_image=16,
    )
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    _randomize(model)
    return _build(Gemma3VisionEncoder, model, tmp_path_factory)


def _pixels(batch: int, size: int) -> np.ndarray:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1)).numpy()


def _hf_llava(case: dict, pixels: np.ndarray, **kw) -> np.ndarray:
    with torch.no_grad():
        out = case["hf"].model.get_image_features(pixel_values=torch.from_numpy(pixels), **kw)
    return torch.cat(list(out.pooler_output)).numpy()


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_llava_matches_hf(llava, strategy):
    pixels = _pixels(2, 28)
    config = {**llava["config"], "vision_feature_select_strategy": strategy}
    module = llava["module"]
    if strategy == "full":  # same weights, another strategy
        module = LlavaVisionEncoder(config, dtype=jnp.float32, rngs=nnx.Rngs(1))
        nnx.update(module, nnx.state(llava["module"]))
    ref = _hf_llava(llava, pixels, vision_feature_select_strategy=strategy)
    ours = _jit_call(module, pixels)
    assert ours.shape == (2 * LlavaVisionEncoder.tokens_per_image(config), 48)
    _close(ours, ref)


def test_llava_builds_only_needed_layers(llava):
    """Layer -2 of 3: two encoder layers built; post_layernorm and layer 2 never loaded."""
    assert len(llava["module"].vision_tower.layers) == 2
    vision = {k for k in llava["tensors"] if "language_model" not in k and "lm_head" not in k}
    unused = vision - llava["used"]
    assert all(
        k.startswith(("vision_tower.post_layernorm", "vision_tower.encoder.layers.2."))
        for k in unused
    ), unused


def test_llava_feature_layer_list(llava_multi):
    pixels = _pixels(2, 28)
    _close(_jit_call(llava_multi["module"], pixels), _hf_llava(llava_multi, pixels))
    assert llava_multi["module"].multi_modal_projector.linear_1.bias is None


def test_llava_siglip_tower(tmp_path_factory):
    """A LLaVA over a SigLIP tower (no class token; "default" still drops the first token)."""
    case = _llava(
        tmp_path_factory,
        {"model_type": "siglip_vision_model", "num_hidden_layers": 2, "image_size": 32,
         "patch_size": 8},
        vision_feature_layer=-1,
    )  # fmt: skip
    pixels = _pixels(1, 32)
    ours = _jit_call(case["module"], pixels)
    assert ours.shape == (LlavaVisionEncoder.tokens_per_image(case["config"]), 48) == (15, 48)
    _close(ours, _hf_llava(case, pixels))


def test_gemma3_matches_hf(gemma3):
    pixels = _pixels(2, 64)
    with torch.no_grad():
        ref = gemma3["hf"].model.get_image_features(pixel_values=torch.from_numpy(pixels))
    ref = ref.pooler_output.reshape(-1, 48).numpy()
    ours = _jit_call(gemma3["module"], pixels)
    assert ours.shape == (2 * Gemma3VisionEncoder.tokens_per_image(gemma3["config"]), 48)
    assert Gemma3VisionEncoder.tokens_per_image(gemma3["config"]) == 16
    _close(ours, ref)
    # Every vision tensor is loaded except the SigLIP pooling head Gemma 3 does not use.
    vision = {k for k in gemma3["tensors"] if "language_model" not in k and "lm_head" not in k}
    assert all(k.startswith("vision_tower.head.") for k in vision - gemma3["used"])


def test_bf16_runs(gemma3):
    """The same module in bf16: parameters and output in bf16, close to fp32."""
    module = Gemma3VisionEncoder(gemma3["config"], dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    state = nnx.state(gemma3["module"], nnx.Param)
    nnx.update(module, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))
    pixels = _pixels(1, 64)
    out = _jit_call(module, pixels)
    assert out.dtype == jnp.bfloat16
    ref = _jit_call(gemma3["module"], pixels)
    assert np.abs(out.astype(np.float32) - ref).max() < 0.1 * np.abs(ref).max()


def test_full_attention_blocks_match():
    """Query blocks (padded: 40 = 3 blocks of 16) equal one-shot attention."""
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 40, 4, 8))
    np.testing.assert_allclose(
        full_attention(q, k, v, 0.3, block=16), full_attention(q, k, v, 0.3), atol=1e-6
    )


def test_defaults_and_errors():
    """Config fields left out take HF's class defaults; bad paths and settings are refused."""
    llava_tokens = LlavaVisionEncoder.tokens_per_image({})  # CLIP 336 / 14, "default"
    assert llava_tokens == 576
    gemma = {"vision_config": {"image_size": 896, "patch_size": 14}}  # 64x64 patches
    assert Gemma3VisionEncoder.tokens_per_image(gemma) == 256
    with pytest.raises(KeyError):
        LlavaVisionEncoder.hf_weight({}, ("nope", "kernel"))
    with pytest.raises(ValueError):
        LlavaVisionEncoder.tokens_per_image({"vision_feature_select_strategy": "bogus"})
    with pytest.raises(ValueError):
        LlavaVisionEncoder.tokens_per_image({"vision_feature_layer": -30})
