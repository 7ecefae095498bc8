"""KV capacity from the allocator on the presets' real widths (issue 71's must-show): the
32k-token sequences a 40 GiB KV budget holds, one group of every layer (before) against the
KV-cache groups (after). Gemma 3 27B: 52 of its 62 layers keep a 1024-token window; gpt-oss:
half its layers a 128-token one; Llama 4 Scout: three in four layers an 8192-token chunk."""

import pytest

from jaxserve.benchmarks.kv_capacity import block_bytes, capacity
from jaxserve.config.kv_groups import KVCacheLayout
from jaxserve.transformers_utils.config import read_model_config
from jaxserve.transformers_utils.model_path import resolve_model_path

GIB = 2**30


def _config(name):
    return read_model_config(resolve_model_path(name, "dummy"), "bfloat16")


@pytest.mark.parametrize(
    ("name", "before", "after"),
    [("gemma-3-27b", 2, 12), ("gpt-oss-120b", 17, 35), ("llama-4-scout", 6, 25)],
)
def test_windowed_layers_hold_their_window_so_more_long_sequences_fit(name, before, after):
    config = _config(name)
    one = capacity(config, 40 * GIB, 32768, one_group=True)
    groups = capacity(config, 40 * GIB, 32768)
    # the budget's blocks: one block id is every layer, or a group's slots of layers
    assert one.block_bytes == block_bytes(
        config, KVCacheLayout.uniform(config.num_layers), 16, "bfloat16"
    )
    assert one.num_blocks == 40 * GIB // one.block_bytes
    assert (one.sequences, groups.sequences) == (before, after)


def test_a_full_attention_model_is_unchanged():
    config = _config("llama-3-8b")
    assert capacity(config, 40 * GIB, 32768) == capacity(config, 40 * GIB, 32768, one_group=True)


def test_shared_indexer_layers_free_their_index_keys():
    """GLM-5 at its published widths (78 layers, 512 + 64 latent values, 128-value index
    keys) with GLM-5.2's indexer pattern (full at layers 0-2, then every 4th from 6; the
    rest reuse a full layer's top-k and keep no index keys): 78 x 576 + 21 x 128 values a
    token instead of 78 x 704: 15% more blocks, 13 32k-token sequences in 40 GiB for 11."""
    import dataclasses

    config = _config("glm-5")
    full = {0, 1, 2, *range(6, 78, 4)}
    shared = tuple(i not in full for i in range(78))
    glm52 = dataclasses.replace(config, mla=dataclasses.replace(config.mla, index_shared=shared))
    assert sum(v is not None for v in glm52.v_slots) == 21
    before, after = (capacity(c, 40 * GIB, 32768) for c in (config, glm52))
    assert before.block_bytes == 16 * 78 * 704 * 2
    assert after.block_bytes == 16 * (78 * 576 + 21 * 128) * 2
    assert (before.sequences, after.sequences) == (11, 13)
