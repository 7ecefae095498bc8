"""Qwen2.5-VL's vision tower (jaxserve/models/vision/qwen2_5_vl.py) against HF transformers'
`visual` in float32: weights read through `hf_weight` from the tensors save_pretrained writes,
images through HF's PIL image processor, the call jitted on a padded patch bucket."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx, traverse_util  # noqa: E402

from jaxserve.models.vision import qwen2_5_vl  # noqa: E402
from jaxserve.models.vision.qwen2_5_vl import Qwen2_5_VLVisionEncoder, vision_config  # noqa: E402

VISION = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 2,
    "out_hidden_size": 40,
    "window_size": 56,  # 2 x 2 merged tokens (16 patches) per window
    "fullatt_block_indexes": [1],
}
TEXT = {
    "hidden_size": 40,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
}
IMAGE_SIZES = [(56, 84), (112, 112), (140, 196)]  # (height, width): 24, 64, 140 patches


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(HF model, its config dict, the safetensors save_pretrained writes, processor)."""
    from safetensors.numpy import load_file
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # unit-variance products, sharp attention, norms away from 1 and
        for name, p in model.model.visual.named_parameters():  # biases away from 0: mix-ups show
            if p.ndim > 1:
                fan_in = p[0].numel()
                p.normal_(0.0, (2.0 if "qkv" in name else 1.0) / fan_in**0.5)
            else:
                p.add_(torch.randn_like(p) * 0.5)
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=200 * 200)
    return model, config.to_dict(), tensors, processor


@pytest.fixture(scope="module")
def encoder(hf):
    """Our encoder, every parameter built from the checkpoint's tensors by `hf_weight`, and a
    jitted call (nnx split / merge)."""
    _, config, tensors, _ = hf
    enc = Qwen2_5_VLVisionEncoder(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    state = nnx.state(enc)
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    used = set()
    for path, target in flat.items():
        weight = Qwen2_5_VLVisionEncoder.hf_weight(config, path)
        host = [tensors[name] for name in weight.names]
        used.update(weight.names)
        value = host[0] if weight.build is None else weight.build(*host)
        assert value.shape == target.shape, (path, value.shape, target.shape)
        flat[path] = jnp.asarray(value, target.dtype)
    assert used == {k for k in tensors if k.startswith("visual.")}
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(flat))
    nnx.update(enc, state)
    graphdef, params = nnx.split(enc)

    @jax.jit
    def run(params, inputs):
        return nnx.merge(graphdef, params)(**inputs)

    return config, lambda inputs: run(params, inputs)


def _image(height: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)


def _hf_embeddings(model, pixel_values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model.model.visual(torch.from_numpy(pixel_values), grid_thw=torch.from_numpy(grid))
    return out.pooler_output.numpy()


def _bucket_above(config: dict, patches: int) -> int:
    return next(b for b in Qwen2_5_VLVisionEncoder.patch_buckets(config, 1024) if b > patches)


@pytest.mark.parametrize("query_block", [512, 16])  # one block of queries; many, keys sliced
def test_matches_hf_per_image(hf, encoder, monkeypatch, query_block):
    model, _, _, processor = hf
    config, run = encoder
    monkeypatch.setattr(qwen2_5_vl, "QUERY_BLOCK", query_block)
    jax.clear_caches()  # QUERY_BLOCK is read at trace time
    for seed, (height, width) in enumerate(IMAGE_SIZES):
        feats = processor(images=[_image(height, width, seed)], return_tensors="np")
        pixels, grid = feats["pixel_values"].astype(np.float32), feats["image_grid_thw"]
        patches = int(np.prod(grid))
        assert patches == (height // 14) * (width // 14)
        bucket = _bucket_above(config, patches)
        inputs = Qwen2_5_VLVisionEncoder.prepare(config, pixels, grid, bucket)
        assert inputs["patches"].shape[0] == bucket
        out = np.asarray(run(inputs))
        assert out.shape == (bucket // 4, 40)
        ref = _hf_embeddings(model, pixels, grid)
        np.testing.assert_allclose(out[: patches // 4], ref, atol=1e-4, rtol=1e-4)
        assert np.all(np.isfinite(out))


def test_matches_hf_two_images_together(hf, encoder):
    """Two images of different sizes in one call, as HF's `visual` takes them."""
    model, _, _, processor = hf
    config, run = encoder
    images = [_image(56, 84, 7), _image(112, 112, 8)]
    feats = processor(images=images, return_tensors="np")
    pixels, grid = feats["pixel_values"].astype(np.float32), feats["image_grid_thw"]
    bucket = _bucket_above(config, len(pixels))
    out = np.asarray(run(Qwen2_5_VLVisionEncoder.prepare(config, pixels, grid, bucket)))
    ref = _hf_embeddings(model, pixels, grid)
    np.testing.assert_allclose(out[: len(ref)], ref, atol=1e-4, rtol=1e-4)


def test_prepare_layout(hf):
    _, config, _, processor = hf
    feats = processor(images=[_image(56, 84, 0)], return_tensors="np")
    pixels, grid = feats["pixel_values"], feats["image_grid_thw"]  # 4 x 6 patches
    inputs = Qwen2_5_VLVisionEncoder.prepare(config, pixels, grid, 64)
    assert {k: v.shape for k, v in inputs.items()} == {
        "patches": (64, 3 * 2 * 14 * 14),
        "positions": (64, 2),
        "window_segments": (64,),
        "full_segments": (64,),
        "reverse_index": (16,),
    }
    # merged grid 2 x 3 in windows of 2 x 2: [0, 1, 3, 4] then [2, 5], 4 patches each
    np.testing.assert_array_equal(inputs["window_segments"][:24], np.repeat([0, 1], [16, 8]))
    np.testing.assert_array_equal(inputs["window_segments"][24:], -1)
    np.testing.assert_array_equal(inputs["full_segments"], np.repeat([0, -1], [24, 40]))
    np.testing.assert_array_equal(inputs["reverse_index"][:6], [0, 1, 4, 2, 3, 5])
    np.testing.assert_array_equal(inputs["reverse_index"][6:], np.arange(6, 16))
    assert not inputs["patches"][24:].any()
    with pytest.raises(ValueError):
        Qwen2_5_VLVisionEncoder.prepare(config, pixels, grid, 16)  # fewer rows than patches
    with pytest.raises(ValueError):
        Qwen2_5_VLVisionEncoder.prepare(config, pixels, grid, 30)  # not whole merge units


def test_buckets_and_config_defaults():
    buckets = Qwen2_5_VLVisionEncoder.patch_buckets({}, 1000)
    assert buckets == [64, 128, 256, 512, 1000]
    assert Qwen2_5_VLVisionEncoder.patch_buckets({}, 1001)[-1] == 1004
    assert Qwen2_5_VLVisionEncoder.patch_buckets({}, 10) == [12]
    vc = vision_config({"vision_config": {"depth": 2, "in_chans": 1, "hidden_size": 64}})
    assert (vc["depth"], vc["in_channels"], vc["hidden_size"]) == (2, 1, 64)
    assert vc["fullatt_block_indexes"] == (7, 15, 23, 31) and vc["window_size"] == 112
    assert vc["rope_theta"] == 10000.0
