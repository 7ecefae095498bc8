"""LoRARequest (vLLM's fields) and the adapter config checks the frontend and engine run."""

import json

import pytest

from jaxserve.engine.input_processor import InputProcessor
from jaxserve.lora_request import LoRARequest, read_adapter_config
from jaxserve.sampling_params import SamplingParams


def write_adapter(path, **config):
    path.mkdir(parents=True, exist_ok=True)
    base = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(base | config))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return str(path)


def test_vllm_fields_and_scaling(tmp_path):
    lora = LoRARequest("sql", 3, "/a")
    assert (lora.name, lora.adapter_id, lora.path) == ("sql", 3, "/a")
    assert LoRARequest("sql", 3, "/a").cache_key != LoRARequest("sql", 4, "/a").cache_key
    assert read_adapter_config(write_adapter(tmp_path / "a")).scaling == 2.0
    rs = read_adapter_config(write_adapter(tmp_path / "b", use_rslora=True, r=16, lora_alpha=8))
    assert rs.scaling == 2.0  # alpha / sqrt(r)
    assert read_adapter_config(write_adapter(tmp_path / "c", target_modules="all-linear"))


@pytest.mark.parametrize(
    "config, message",
    [
        ({"r": 32}, "LoRA rank 32 .* greater than max_lora_rank 16"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"use_dora": True}, "DoRA"),
        ({"target_modules": ["q_proj", "lm_head"]}, "targets lm_head"),
        ({"bias": "all"}, "bias='all'"),
        ({"peft_type": "IA3"}, "IA3 adapter"),
        ({"r": 0}, "r must be a positive integer"),
    ],
)
def test_refusals_name_the_value(tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        read_adapter_config(write_adapter(tmp_path, **config), max_lora_rank=16)


def test_missing_adapter_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no LoRA adapter"):
        read_adapter_config(str(tmp_path / "nowhere"))


def test_lora_request_without_enable_lora_is_refused():
    processor = InputProcessor(None, vocab_size=100, max_model_len=64, max_logprobs=5,
                               eos_token_id=None)  # fmt: skip
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        processor.process("r", [1, 2], SamplingParams(max_tokens=4),
                          lora_request=LoRARequest("a", 1, "/x"))  # fmt: skip
