"""--generation-config / --override-generation-config with vLLM's meaning: the model's
generation_config.json (or a directory's, or none with "vllm") fills the sampling parameters a
request leaves unset, the override over it, and its max_new_tokens caps every request's output
tokens, on the Python API and over HTTP alike (tests/transformers_utils/test_hub.py serves one
over HTTP)."""

from __future__ import annotations

import json

import pytest

from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from jaxserve.transformers_utils.config import check_generation_config, generation_defaults
from jaxserve.transformers_utils.model_path import default_model_path
from tests.helpers import make_tiny_hf, make_tiny_tokenizer


def write_generation_config(directory, **fields) -> None:
    from transformers import GenerationConfig

    GenerationConfig(**fields).save_pretrained(directory)


def test_defaults_are_the_fields_the_file_sets(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    write_generation_config(model, do_sample=True, temperature=0.6, top_p=0.9,
                            repetition_penalty=1.1, max_new_tokens=5, num_beams=1)  # fmt: skip
    write_generation_config(other, do_sample=True, min_p=0.05)
    expected = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 5}
    assert generation_defaults(str(model)) == expected
    assert generation_defaults(str(model), "vllm") == {}
    assert generation_defaults(str(model), str(other)) == {"min_p": 0.05}
    override = {"temperature": 0.0, "max_new_tokens": 2}
    overridden = {**expected, "temperature": 0.0, "max_tokens": 2}
    assert generation_defaults(str(model), "auto", override) == overridden
    assert generation_defaults(str(model), "vllm", {"top_k": 7}) == {"top_k": 7}
    assert generation_defaults(str(default_model_path())) == {}  # a GGUF: no generation config


@pytest.mark.parametrize(
    ("source", "override", "message"),
    [
        ("nowhere", None, "generation_config 'nowhere' is neither 'auto', 'vllm' nor a directory"),
        ("auto", "{temperature: 1}", "override_generation_config '{temperature: 1}' is not JSON"),
        ("auto", "[1]", "must be a JSON object, got \\[1\\]"),
        ("auto", {"temp": 1}, "unknown fields \\['temp'\\]"),
        ("auto", {"top_p": "high"}, "top_p must be a number, got 'high'"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(source, override, message):
    with pytest.raises(ValueError, match=message):
        check_generation_config(source, override)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model = tmp_path_factory.mktemp("generation")
    make_tiny_hf("llama", model, vocab_size=make_tiny_tokenizer(model))
    generation = json.loads((model / "generation_config.json").read_text())
    generation.update(do_sample=True, temperature=0.6, max_new_tokens=5)
    (model / "generation_config.json").write_text(json.dumps(generation))
    return model


def test_llm_api_defaults_and_cap(model):
    """generation_config "vllm" ignores the file's; the override's fields are the defaults,
    and its max_new_tokens caps a request that asks for more."""
    override = '{"temperature": 0.0, "max_new_tokens": 3}'
    llm = LLM(str(model), generation_config="vllm", override_generation_config=override,
              max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)  # fmt: skip
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens, defaults.top_p) == (0.0, 3, 1.0)
        for asked, given in ((10, 3), (2, 2)):
            params = SamplingParams(max_tokens=asked, ignore_eos=True, temperature=0.0)
            out = llm.generate("hello", params, use_tqdm=False)[0].outputs[0]
            assert (len(out.token_ids), out.finish_reason) == (given, "length"), asked
        out = llm.generate("hello", use_tqdm=False)[0].outputs[0]  # the defaults: greedy, 3
        assert len(out.token_ids) == 3 or out.finish_reason == "stop"
    finally:
        llm.llm_engine.shutdown()
