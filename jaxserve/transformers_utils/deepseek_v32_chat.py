"""DeepSeek-V3.2's prompt encoding (vLLM's `--tokenizer-mode deepseek_v32`): the model ships no
Jinja chat template; DeepSeek publishes the encoding as code (its repository's
encoding/encoding_dsv32.py), and this builds the same text.

    <｜begin▁of▁sentence｜>SYSTEM<｜User｜>USER<｜Assistant｜></think>REPLY<｜end▁of▁sentence｜>...

A user (or developer) turn ends `<think>` when it is the last one and thinking is on
(chat_template_kwargs `thinking` or `enable_thinking`), else `</think>`; an assistant turn
after the last user turn in thinking mode starts with its reasoning and `</think>`, and the
reasoning of earlier ones is dropped when the conversation ends with a user turn. Tools go in
a first system message of their own (their JSON schemas and how to call them, in DSML); an
assistant's calls are written in DSML after its content, and the tool results that follow it
as `<function_results>`. `continue_final_message`: the last assistant message is left open.
"""

# ruff: noqa: E501 (TOOLS_PROMPT: the model's own text, line for line)
from __future__ import annotations

import json
from typing import Any

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
USER_ROLES = ("user", "developer")

TOOLS_PROMPT = f"""## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of your reply to the user:
<{DSML}function_calls>
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
</{DSML}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{DSML}function_calls>
...
</{DSML}function_calls>
<function_results>
...
</function_results>
{THINK}...thinking about results{END_THINK}
Here are the functions available in JSONSchema format:
<functions>
{{schemas}}
</functions>
"""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The tools' section: each OpenAI tool's `function` as one line of JSON."""
    return TOOLS_PROMPT.replace("{schemas}", "\n".join(_json(t["function"]) for t in tools))


def dsml_calls(calls: list[dict[str, Any]]) -> str:
    """An assistant's tool calls (OpenAI's form, arguments a dict or its JSON) in DSML."""
    invokes = []
    for call in calls:
        fn = call["function"]
        args = fn.get("arguments") or {}
        args = json.loads(args) if isinstance(args, str) else args
        params = "\n".join(
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>"
            for key, v in args.items()
        )
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n{params}\n</{DSML}invoke>')
    return f"<{DSML}function_calls>\n" + "\n".join(invokes) + f"\n</{DSML}function_calls>"


def _tool_results(i: int, messages: list[dict[str, Any]], thinking: bool, last_user: int) -> str:
    """Tool message i: its result, opening the results after its assistant's calls for the
    first and closing them after the last."""
    j = i - 1
    while j >= 0 and messages[j].get("role") == "tool":
        j -= 1
    calls = messages[j].get("tool_calls") if j >= 0 else None
    if j < 0 or messages[j].get("role") != "assistant" or not calls or len(calls) < i - j:
        raise ValueError(f"messages[{i}] is a tool result with no assistant tool call before it")
    out = "\n\n<function_results>" if i - j == 1 else ""
    out += f"\n<result>{messages[i].get('content')}</result>"
    if i - j == len(calls):
        out += "\n</function_results>\n\n" + (THINK if thinking and i >= last_user else END_THINK)
    return out


def _message(i: int, messages: list[dict[str, Any]], thinking: bool, last_user: int) -> str:
    msg = messages[i]
    role, content, tools = msg.get("role"), msg.get("content"), msg.get("tools")
    if role == "system":
        return (content or "") + ("\n\n" + tools_prompt(tools) if tools else "")
    if role in USER_ROLES:
        if role == "developer":
            if not content:
                raise ValueError(f"messages[{i}]: a developer message needs content")
            tools_part = "\n\n" + tools_prompt(tools) if tools else ""
            content = f"{tools_part}\n\n# The user's message is: {content}"
        end = THINK if thinking and i == last_user else END_THINK
        return f"<｜User｜>{content}<｜Assistant｜>{end}"
    if role == "tool":
        return _tool_results(i, messages, thinking, last_user)
    if role != "assistant":
        raise ValueError(f"messages[{i}].role {role!r} is not one DeepSeek-V3.2 encodes")
    calls = msg.get("tool_calls")
    reasoning = ""
    if thinking and i > last_user:
        if not (msg.get("reasoning") or calls):
            raise ValueError(
                f"messages[{i}]: in thinking mode an assistant message after the last user "
                "message needs reasoning or tool calls"
            )
        reasoning = (msg.get("reasoning") or "") + END_THINK
    if msg.get("prefix") and not calls:
        return content or ""
    return reasoning + (content or "") + ("\n\n" + dsml_calls(calls) if calls else "") + EOS


def encode_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    thinking: bool = False,
    continue_final: bool = False,
) -> str:
    """The prompt text of `messages` (OpenAI chat messages; an assistant's reasoning under
    `reasoning`) with `tools` (OpenAI function tools)."""
    messages = [dict(m) for m in messages]
    if continue_final and messages and messages[-1].get("role") == "assistant":
        messages[-1]["prefix"] = True
    last_user = max((i for i, m in enumerate(messages) if m.get("role") in USER_ROLES), default=-1)
    if thinking and messages and messages[-1].get("role") == "user":
        # reasoning before the last user turn is dropped (DeepSeek's encoding drops developer
        # turns there too, and then fails: refused here by name)
        for i, m in enumerate(messages[:last_user]):
            if m.get("role") == "assistant":
                messages[i] = {k: v for k, v in m.items() if k != "reasoning"}
            elif m.get("role") == "developer":
                raise ValueError(
                    f"messages[{i}]: in thinking mode DeepSeek-V3.2's encoding takes no "
                    "developer message before the last user message"
                )
    head = "\n\n" + tools_prompt(tools) if tools else ""  # a system message of their own
    return (
        BOS
        + head
        + "".join(_message(i, messages, thinking, last_user) for i in range(len(messages)))
    )


def render(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any] | None,
    continue_final_message: bool = False,
) -> str:
    """As a chat template's rendering: thinking from chat_template_kwargs (`thinking` or
    `enable_thinking`, vLLM's)."""
    kwargs = kwargs or {}
    thinking = bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))
    return encode_messages(
        messages, tools, thinking=thinking, continue_final=continue_final_message
    )
