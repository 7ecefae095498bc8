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
    assert layout.place(1)[:2] == (0, 0) and layout.place(0)[:2] == (1, 0)


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


def test_narrower_layers_pack_a_slot():
    """Gemma 4 31B's full layers (4 KV heads of 512) fill half a token's row (16 heads of
    256): two share a slot, one full group of 5 slots beside ten sliding groups of 5; at tp 8
    a device's share of a row is one 512-wide head, so they cannot pack (their heads repeat
    instead). E4B's sliding layers are the narrower ones there."""
    from jaxserve.config.kv_groups import kv_cache_layout
    from jaxserve.transformers_utils.config import read_model_config
    from jaxserve.transformers_utils.model_path import resolve_model_path

    def layout(preset, tp):
        config = read_model_config(resolve_model_path(preset, "dummy"), load_format="dummy")
        return kv_cache_layout(config, tp=tp)

    packed = layout("gemma-4-31b", 1)
    full, *sliding = packed.groups
    assert (full.kind, full.pack, len(full.layers), packed.num_slots) == ("full", 2, 10, 5)
    assert len(sliding) == 10 and {(g.pack, len(g.layers)) for g in sliding} == {(1, 5)}
    assert packed.place(full.layers[3]) == (0, 1, 1, 2)  # the second slot's second layer
    assert {g.pack for g in layout("gemma-4-31b", 8).groups} == {1}
    e4b = layout("gemma-4-e4b", 1)
    assert {(g.kind, g.pack) for g in e4b.groups} == {("full", 1), ("sliding", 2)}
