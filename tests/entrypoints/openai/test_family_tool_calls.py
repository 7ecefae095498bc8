"""A model family's tool-call format reaches every API: the app in process over a stand-in
core that generates a Qwen3-Coder, a MiniMax-M2 or a DeepSeek-V3.2 tool call (XML or DSML,
`--tool-call-parser qwen3_coder` / `minimax_m2` / `deepseek_v32`, the last with
`--tokenizer-mode deepseek_v32`: the prompts in DeepSeek's encoding) with `tool_choice:
"auto"`, read back as chat `tool_calls`, Responses `function_call` items and Messages
`tool_use` blocks, whole and streamed, with arguments typed by the tool's schema (DSML: by
each value's `string` attribute)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.transformers_utils.tokenizer import read_tokenizer
from tests.engine.test_kv_transfer_params import config
from tests.entrypoints.openai.test_vllm_response_fields import ScriptedCore
from tests.require import import_or_skip

CALLS = {
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "minimax_m2": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
    'Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
    "deepseek_v32": '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜'
    'parameter name="city" string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter '
    'name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    "</｜DSML｜function_calls>",
}
TOKENIZER_MODE = {"deepseek_v32": "deepseek_v32"}  # parser -> --tokenizer-mode (else auto)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
WANT = ("get_weather", {"city": "Paris", "days": 3})
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


class StoppingCore(ScriptedCore):
    """ScriptedCore whose requests end with a stop (the model's end of turn), not length."""

    def add_requests(self, requests) -> None:
        self.prompts = [*getattr(self, "prompts", []), *(r.prompt_token_ids for r in requests)]
        super().add_requests(requests)
        for steps in self.steps[-len(requests) :]:
            steps[-1].finish_reason = "stop"


@pytest.fixture(scope="module", params=sorted(CALLS))
def answers(request):
    openai = import_or_skip("openai")
    tokenizer = read_tokenizer(None, TOKENIZER_MODE.get(request.param, "auto"))
    cfg = config(max_model_len=1024)  # DSML's tools section: ~450 tokens
    cfg.model.vocab_size = len(tokenizer)
    tokens = tokenizer.encode(CALLS[request.param], add_special_tokens=False)
    core = StoppingCore(tokens)
    engine = AsyncLLM(cfg, core, tokenizer=tokenizer)
    app = build_app(
        engine, ["m"], log_stats_interval=None, enable_auto_tools=True, tool_parser=request.param
    )
    flat_tool = {"type": "function", **TOOL["function"]}  # the Responses API's form
    anthropic_tool = {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(
                base_url="http://test/v1", api_key="none", http_client=http, max_retries=0
            )
            chat = dict(model="m", messages=ASK, tools=[TOOL], tool_choice="auto", max_tokens=64)
            whole = await client.chat.completions.create(**chat)
            chunks = [c async for c in await client.chat.completions.create(**chat, stream=True)]
            responses = await client.responses.create(
                model="m", input="Weather in Paris for 3 days?", tools=[flat_tool]
            )
            body = {"model": "m", "max_tokens": 64, "messages": ASK, "tools": [anthropic_tool]}
            messages = (await http.post("/v1/messages", json=body)).json()
            prompts = [tokenizer.decode(p) for p in core.prompts]
            return whole, chunks, responses, messages, (request.param, prompts)

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()
        app.state.cpu.shutdown(wait=False)


def test_chat_whole_and_streamed(answers):
    whole, chunks, _, _, _ = answers
    (call,) = whole.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == WANT
    assert whole.choices[0].finish_reason == "tool_calls" and not whole.choices[0].message.content
    calls = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or ()]
    name = "".join(tc.function.name or "" for tc in calls if tc.function)
    args = "".join(tc.function.arguments or "" for tc in calls if tc.function)
    assert (name, json.loads(args)) == WANT
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_and_messages_carry_the_call(answers):
    _, _, responses, messages, _ = answers
    (item,) = [i for i in responses.output if i.type == "function_call"]
    assert (item.name, json.loads(item.arguments)) == WANT
    (block,) = [b for b in messages["content"] if b["type"] == "tool_use"]
    assert (block["name"], block["input"]) == WANT and messages["stop_reason"] == "tool_use"


def test_each_api_prompts_in_the_tokenizer_modes_encoding(answers):
    """Chat, Responses and Messages all render through --tokenizer-mode deepseek_v32: the
    tools in DeepSeek's DSML system section, the turn ended as its encoding ends it."""
    *_, (parser, prompts) = answers
    assert len(prompts) == 4
    for prompt in prompts:
        encoded = prompt.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n")
        assert encoded == (parser == "deepseek_v32"), prompt[:80]
        if encoded:
            assert '"name": "get_weather"' in prompt
            assert prompt.endswith("<｜User｜>Weather in Paris for 3 days?<｜Assistant｜></think>")
