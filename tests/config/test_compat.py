"""The feature-compatibility table (config/compat.py): every pair of features has one entry,
each refused pair is refused through EngineArgs.create_engine_config with the table's reason,
each allowed pair builds its engine config (no model loaded: presets and a config.json, dummy
weights), and docs/features.md is the table's grid."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxserve.config import compat
from jaxserve.engine import arg_utils
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.core_control import CoreControl
from jaxserve.transformers_utils.model_path import PRESETS_DIR

ROOT = Path(__file__).resolve().parents[2]
PAIRS = list(itertools.combinations(compat.NAMES, 2))
ARGS = dict(model="llama-3.2-1b", load_format="dummy", max_model_len=256, max_num_seqs=16,
            max_num_batched_tokens=256, num_gpu_blocks_override=256)  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 2}
# a draft model of the Llama preset's vocabulary: only its config is read
DRAFT = {"method": "draft_model", "model": str(PRESETS_DIR / "llama-3.2-1b"),
         "num_speculative_tokens": 2}  # fmt: skip
# the engine arguments that turn each feature on (`images`: the llava fixture's directory)
FEATURE_ARGS = {
    "pipeline parallel": {"pipeline_parallel_size": 2},
    "data parallel": {"data_parallel_size": 2},
    "several hosts": {"nnodes": 2, "tensor_parallel_size": 2},
    "async scheduling": {"async_scheduling": True},
    "draft model": {"speculative_config": DRAFT},
    "ngram speculation": {"speculative_config": NGRAM},
    "LoRA": {"enable_lora": True},
    "images": {"model": None},
    "prompt embeddings": {"enable_prompt_embeds": True},
    "pooling": {"runner": "pooling"},
    "KV connectors": {"kv_transfer_config": {"kv_connector": "ZmqConnector"}},
    "sleep mode": {"enable_sleep_mode": True},
    "hybrid models": {"model": "qwen3-next-80b"},
    "shared-KV models": {"model": None},
}
# pairs no engine turns on together (no model has both; one speculative method per engine)
NEVER_BOTH = {
    ("images", "hybrid models"),
    ("draft model", "ngram speculation"),
    ("hybrid models", "shared-KV models"),
}
SPECULATION = {"draft model", "ngram speculation"}


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    """A LLaVA config.json (its text model: the Llama preset's vocabulary), no weights."""
    path = tmp_path_factory.mktemp("llava")
    text = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "text_config": text, "image_token_index": 32000}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture
def seen(monkeypatch) -> list:
    """The features each compat.check call was given (the pair's args must turn both on)."""
    calls, check = [], compat.check
    monkeypatch.setattr(compat, "check", lambda features: calls.append(features) or check(features))
    return calls


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> dict[bool, str]:
    """Gemma 4 config.jsons (the shared-KV models), text and with images (True), of the
    Llama preset's vocabulary; no weights."""
    path = tmp_path_factory.mktemp("gemma4")
    text = {"model_type": "gemma4_text", "vocab_size": 128256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "max_position_embeddings": 256, "hidden_size_per_layer_input": 0}  # fmt: skip
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
              "text_config": text, "vision_config": {"hidden_size": 32}, "audio_config": None,
              "image_token_id": 3, "boi_token_id": 4, "eoi_token_id": 5}  # fmt: skip
    (path / "vl").mkdir()
    (path / "vl" / "config.json").write_text(json.dumps(config))
    text = {**text, "architectures": ["Gemma4ForCausalLM"]}
    (path / "config.json").write_text(json.dumps(text))
    return {False: str(path), True: str(path / "vl")}


def _engine_args(a: str, b: str, llava: str, gemma4: dict | None = None) -> EngineArgs:
    kwargs = dict(ARGS)
    for name in (a, b):
        kwargs.update(FEATURE_ARGS[name])
    if "shared-KV models" in (a, b):
        kwargs["model"] = gemma4["images" in (a, b)]
    elif "images" in (a, b):
        kwargs["model"] = llava
    return EngineArgs(**kwargs)


def test_every_pair_has_one_entry_in_feature_order():
    assert len(compat.NAMES) == len(set(compat.NAMES)) == 14
    assert len({short for _, short, _ in compat.FEATURES}) == 14
    listed = [(a, b) for a, b, _, _ in compat.TABLE]
    assert listed == PAIRS  # each pair once, in the grid's order: nothing missing or twice
    for a, b, status, text in compat.TABLE:
        assert status in (compat.ALLOWED, compat.REFUSED)
        assert compat.entry(a, b) == compat.entry(b, a) == (status, text)  # symmetric
        assert compat.reason(a, b) == compat.reason(b, a) == (text if status == "refused" else None)
        assert text or status == compat.ALLOWED  # a refusal always says why
    with pytest.raises(KeyError, match="'tensor parallel' is not a feature"):
        compat.reason("tensor parallel", "LoRA")


@pytest.mark.parametrize(("a", "b"), [p for p in PAIRS if compat.reason(*p)])
def test_a_refused_pair_is_refused_with_the_tables_reason(a, b, llava, gemma4, seen):
    with pytest.raises(ValueError) as info:
        _engine_args(a, b, llava, gemma4).create_engine_config()
    assert {a, b} <= set(seen[-1])
    pattern = rf"{re.escape(a)} \(.+\) with {re.escape(b)} \(.+\): {re.escape(compat.reason(a, b))}"
    assert re.fullmatch(pattern, str(info.value)), str(info.value)


@pytest.mark.parametrize(
    ("a", "b"), [p for p in PAIRS if not compat.reason(*p) and p not in NEVER_BOTH]
)
def test_an_allowed_pair_builds_its_engine_config(a, b, llava, gemma4, seen, monkeypatch):
    # the devices of several hosts are not here: the rest of the config is built
    monkeypatch.setattr(arg_utils, "check_local_devices", lambda *args: None)
    config = _engine_args(a, b, llava, gemma4).create_engine_config()
    assert {a, b} <= set(seen[-1])
    assert (config.speculative is not None) == bool({a, b} & SPECULATION)


def test_the_message_names_both_settings():
    features = {"pipeline parallel": "pipeline_parallel_size=2", "LoRA": "enable_lora"}
    with pytest.raises(ValueError) as info:
        compat.check({**features, "data parallel": "data_parallel_size=2"})
    assert str(info.value) == (
        "pipeline parallel (pipeline_parallel_size=2) with data parallel (data_parallel_size=2): "
        "pipeline_parallel_size > 1 is not supported yet with data_parallel_size > 1"
    )
    compat.check({"LoRA": "enable_lora", "sleep mode": "enable_sleep_mode"})  # allowed


@pytest.mark.parametrize(
    ("parallel", "pair"),
    [((2, 1), ("several hosts", "sleep mode")), ((1, 2), ("pipeline parallel", "sleep mode"))],
)
def test_weight_updates_at_run_time_give_the_tables_reason(parallel, pair):
    nnodes, pp = parallel
    core = SimpleNamespace(
        config=SimpleNamespace(parallel=SimpleNamespace(nnodes=nnodes, pipeline_parallel_size=pp))
    )
    with pytest.raises(ValueError, match=re.escape(compat.reason(*pair))):
        CoreControl(core)._device()


def test_docs_features_md_is_the_tables_grid():
    assert (ROOT / "docs" / "features.md").read_text() == compat.markdown(), (
        "docs/features.md is stale: python -m jaxserve.config.compat --markdown > docs/features.md"
    )
    assert "(docs/features.md)" in (ROOT / "README.md").read_text()
    assert "(features.md)" in (ROOT / "docs" / "distributed.md").read_text()
