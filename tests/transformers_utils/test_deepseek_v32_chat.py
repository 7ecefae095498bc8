"""DeepSeek-V3.2's prompt encoding (`--tokenizer-mode deepseek_v32`): the prompts DeepSeek's
own encoding (encoding_dsv32.py, as vLLM 0.32 calls it) gives for conversations with system,
developer, tool and assistant turns, with and without tools and thinking, recorded in
tests/data/deepseek_v32_prompts.json, and the same text through LLM.chat's and the server's
rendering; bad conversations and a chat template beside the mode are refused by name."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.entrypoints.openai.chat_utils import render_chat, template_messages
from jaxserve.transformers_utils.deepseek_v32_chat import encode_messages
from jaxserve.transformers_utils.tokenizer import read_tokenizer

RECORDED = json.loads((Path(__file__).parents[1] / "data/deepseek_v32_prompts.json").read_text())
CASES = {
    f"{c['name']}, thinking {c['thinking']}, tools {c['tools'] is not None}": c
    for c in RECORDED["cases"]
}


@pytest.mark.parametrize("case", CASES)
def test_prompts_equal_deepseeks_encoding(case):
    c = CASES[case]
    got = encode_messages(
        c["messages"], c["tools"], thinking=c["thinking"], continue_final=c["continue_final"]
    )
    assert got == c["prompt"]


@pytest.fixture(scope="module")
def tokenizer():
    return read_tokenizer(None, "deepseek_v32")


def test_llm_chat_and_the_server_render_the_encoding(tokenizer):
    c = CASES["two tool calls and their results, thinking True, tools True"]
    text = tokenizer.apply_chat_template(
        c["messages"], tools=c["tools"], tokenize=False, enable_thinking=True
    )
    assert text == c["prompt"]
    ids = tokenizer.apply_chat_template(c["messages"], tools=c["tools"], enable_thinking=True)
    assert ids == tokenizer.encode(c["prompt"], add_special_tokens=False)
    served = render_chat(
        tokenizer,
        template_messages(c["messages"], "string"),
        template=None,
        tools=c["tools"],
        add_generation_prompt=True,
        continue_final_message=False,
        kwargs={"thinking": True},
    )
    assert served == c["prompt"]
    again = pickle.loads(pickle.dumps(tokenizer))  # the mode survives a copy
    assert again.apply_chat_template(
        c["messages"], tokenize=False
    ) == tokenizer.apply_chat_template(c["messages"], tokenize=False)
    with pytest.raises(ValueError, match="a chat template does not apply"):
        render_chat(tokenizer, [], template="{{ 1 }}", tools=None, add_generation_prompt=True,
                    continue_final_message=False, kwargs=None)  # fmt: skip


@pytest.mark.parametrize(
    "messages,error",
    [
        ([{"role": "tool", "content": "x"}], r"messages\[0\] is a tool result with no assistant"),
        ([{"role": "developer", "content": ""}], r"messages\[0\]: a developer message needs"),
        ([{"role": "critic", "content": "x"}], r"messages\[0\].role 'critic' is not one"),
        (
            [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}],
            r"messages\[0\]: in thinking mode DeepSeek-V3.2's encoding takes no developer",
        ),
        (
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
            r"messages\[1\]: in thinking mode an assistant message after the last user",
        ),
    ],
)
def test_conversations_it_cannot_encode_are_refused_by_name(messages, error):
    with pytest.raises(ValueError, match=error):
        encode_messages(messages, thinking=True)


def test_an_unknown_tokenizer_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="tokenizer_mode 'mistral' is not supported"):
        EngineArgs(tokenizer_mode="mistral").create_engine_config()
