"""The KV-cache layout an engine gets (config/kv_groups.py): groups for a model with windowed
and full layers (with a KV connector too: it moves a block position's blocks of every
group), one group where asked or with pipeline stages."""

import argparse

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


def test_one_group_where_asked():
    layout = _layout(disable_hybrid_kv_cache_manager=True)
    assert layout.num_groups == 1 and layout.num_slots == 24


def test_a_kv_connector_keeps_the_groups():
    assert _layout(kv_offloading_size=1).num_groups == 2


def test_the_vllm_flag_parses():
    parser = add_engine_args(argparse.ArgumentParser())
    parser.add_argument("--model")
    args = parser.parse_args(["--model", "m", "--disable-hybrid-kv-cache-manager"])
    assert engine_args_from(args).disable_hybrid_kv_cache_manager is True
    assert engine_args_from(parser.parse_args([])).disable_hybrid_kv_cache_manager is False
