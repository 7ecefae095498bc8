"""Qwen2.5-VL's M-RoPE: host positions (jaxserve/multimodal/mrope.py) against transformers'
`Qwen2_5_VLModel.get_rope_index`, and `layers.rotary.apply_mrope` against its rotary embedding
and `apply_rotary_pos_emb`."""

import functools
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from jaxserve.config import RopeConfig  # noqa: E402
from jaxserve.layers.rotary import apply_mrope, apply_rotary, rope_inv_freq  # noqa: E402
from jaxserve.multimodal.mrope import mrope_positions  # noqa: E402

START, END, IMAGE, VIDEO = 151652, 151653, 151655, 151656
MERGE = 2


def _hf_rope_index(ids: list[int], images, videos=None, seconds=None, tokens_per_second=2):
    """HF's get_rope_index of one prompt -> (i64[3, L], delta), without building a model."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    vision = types.SimpleNamespace(spatial_merge_size=MERGE, tokens_per_second=tokens_per_second)
    fake = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision))
    fake.get_vision_position_ids = functools.partial(Qwen2_5_VLModel.get_vision_position_ids, fake)
    input_ids = torch.tensor([ids])
    types_ = (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
    positions, deltas = Qwen2_5_VLModel.get_rope_index(
        fake,
        input_ids,
        mm_token_type_ids=types_,
        image_grid_thw=None if images is None else torch.tensor(images),
        video_grid_thw=None if videos is None else torch.tensor(videos),
        second_per_grid_ts=None if seconds is None else torch.tensor(seconds),
    )
    return positions[:, 0].numpy(), int(deltas[0, 0])


def _prompt(parts: list, rng: np.random.Generator) -> list[int]:
    """parts: ints (that many text tokens) and (token, grid) placeholders -> token ids."""
    ids: list[int] = []
    for part in parts:
        if isinstance(part, int):
            ids += rng.integers(0, 1000, part).tolist()
        else:
            token, (t, h, w) = part
            ids += [START] + [token] * (t * h * w // MERGE**2) + [END]
    return ids


CASES = {
    "text only": ([7], None),
    "one image": ([5, (IMAGE, (1, 4, 6)), 3], [[1, 4, 6]]),
    "two images": ([4, (IMAGE, (1, 8, 4)), 2, (IMAGE, (1, 6, 10)), 6], [[1, 8, 4], [1, 6, 10]]),
    "image first, last": ([(IMAGE, (1, 2, 2)), 3, (IMAGE, (1, 4, 8))], [[1, 2, 2], [1, 4, 8]]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_positions_match_hf(name):
    parts, grids = CASES[name]
    ids = _prompt(parts, np.random.default_rng(0))
    positions, delta = mrope_positions(
        ids, grids, image_token_id=IMAGE, vision_start_token_id=START, spatial_merge_size=MERGE
    )
    ref, ref_delta = _hf_rope_index(ids, grids)
    assert positions.dtype == np.int32 and positions.shape == (3, len(ids))
    np.testing.assert_array_equal(positions, ref)
    assert delta == ref_delta
    if grids is None:
        assert delta == 0


def test_positions_with_video_match_hf():
    videos, seconds = [[3, 4, 4], [2, 2, 6]], [0.7, 1.3]
    grids = [[1, 6, 4]]
    parts = [3, (VIDEO, (3, 4, 4)), 2, (IMAGE, (1, 6, 4)), (VIDEO, (2, 2, 6)), 4]
    ids = _prompt(parts, np.random.default_rng(1))
    positions, delta = mrope_positions(
        ids, grids, image_token_id=IMAGE, spatial_merge_size=MERGE, video_grid_thw=videos,
        video_token_id=VIDEO, second_per_grid_ts=seconds, tokens_per_second=2,
    )  # fmt: skip
    ref, ref_delta = _hf_rope_index(ids, grids, videos, seconds, tokens_per_second=2)
    np.testing.assert_array_equal(positions, ref)
    assert delta == ref_delta


def test_adjacent_images_and_errors():
    """Two placeholders back to back split by their grids' sizes; counts are checked."""
    ids = [1, 2] + [IMAGE] * 2 + [IMAGE] * 6 + [3]
    positions, delta = mrope_positions(
        ids, [[1, 2, 4], [1, 4, 6]], image_token_id=IMAGE, spatial_merge_size=MERGE
    )
    np.testing.assert_array_equal(positions[:, 2:4], [[2, 2], [2, 2], [2, 3]])
    np.testing.assert_array_equal(positions[:, 4:10], [[4] * 6, [4, 4, 4, 5, 5, 5], [4, 5, 6] * 2])
    np.testing.assert_array_equal(positions[:, 10], [7, 7, 7])
    assert delta == 8 - len(ids)
    with pytest.raises(ValueError):  # a grid without placeholders
        mrope_positions([1, IMAGE, 2], [[1, 2, 2], [1, 2, 2]], image_token_id=IMAGE,
                        spatial_merge_size=MERGE)  # fmt: skip
    with pytest.raises(ValueError):  # fewer placeholders than the grid's tokens
        mrope_positions([1, IMAGE, 2], [[1, 2, 4]], image_token_id=IMAGE, spatial_merge_size=MERGE)


@pytest.mark.parametrize("section", [(8, 12, 12), (16, 24, 24)])
def test_apply_mrope_matches_hf(section):
    from transformers import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VLRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    head_dim, heads, tokens, theta = 2 * sum(section), 3, 37, 1e6
    rope = {"rope_type": "default", "rope_theta": theta, "mrope_section": list(section)}
    config = Qwen2_5_VLTextConfig(
        hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=heads,
        rope_parameters=rope,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    positions = rng.integers(0, 5000, (3, tokens)).astype(np.int32)
    rotary = Qwen2_5_VLRotaryEmbedding(config)
    xt = torch.from_numpy(x).transpose(0, 1)[None]  # [1, H, T, D]
    cos, sin = rotary(xt, torch.from_numpy(positions).long()[:, None])  # [1, T, D]
    ref, _ = apply_rotary_pos_emb(xt, xt, cos, sin)
    ref = ref[0].transpose(0, 1).numpy()
    # numpy's float32 power and torch's differ in the last bit for some frequencies (which
    # turns into 1e-5 at positions in the thousands): apply_mrope is tested on HF's own
    inv_freq = rotary.inv_freq.numpy()
    np.testing.assert_allclose(rope_inv_freq(head_dim, RopeConfig(theta=theta)), inv_freq, 1e-6)
    out = np.asarray(apply_mrope(jnp.asarray(x), jnp.asarray(positions), inv_freq, section))
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    # all three axes equal: plain rotary
    same = np.broadcast_to(positions[:1], (3, tokens))
    plain = apply_mrope(jnp.asarray(x), jnp.asarray(same), inv_freq, section)
    np.testing.assert_allclose(
        np.asarray(plain), np.asarray(apply_rotary(x, jnp.asarray(positions[0]), inv_freq)),
        atol=1e-6,
    )  # fmt: skip
