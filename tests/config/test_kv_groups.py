"""The KV-cache layout an engine gets (config/kv_groups.py): groups for a model with windowed
and full layers, one group where vLLM keeps one too."""

import argparse

import pytest

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.entrypoints.cli_args import add_engine_args, engine_args_from


def _layout(**kw):
    args = EngineArgs(model="gpt-oss-20b", load_format="dummy", max_model_len=1024, **kw)
    return args.create_engine_config().cache.kv_layout


def test_windowed_and_full_layers_get_a_group_each():
    layout = _layout()
    assert [(g.kind, g.span, len(g.layers)) for g in layout.groups] == [
        ("full", None, 12),
        ("sliding", 128, 12),
    ]
    assert layout.position(1) == (0, 0) and layout.position(0) == (1, 0)


@pytest.mark.parametrize(
    "kw",
    [
        {"disable_hybrid_kv_cache_manager": True},
        {"kv_offloading_size": 1},  # a KV connector moves whole blocks of every layer
    ],
)
def test_one_group_where_blocks_must_hold_every_layer(kw):
    layout = _layout(**kw)
    assert layout.num_groups == 1 and layout.num_slots == 24


def test_the_vllm_flag_parses():
    parser = add_engine_args(argparse.ArgumentParser())
    parser.add_argument("--model")
    args = parser.parse_args(["--model", "m", "--disable-hybrid-kv-cache-manager"])
    assert engine_args_from(args).disable_hybrid_kv_cache_manager is True
    assert engine_args_from(parser.parse_args([])).disable_hybrid_kv_cache_manager is False
