"""Anthropic Messages API bodies (/v1/messages, /v1/messages/count_tokens), as vLLM serves
them for Claude-compatible clients, and their mapping onto the chat path.

A Messages request becomes a `ChatCompletionRequest` (`to_chat_request`): `system` the first
message; each user turn's `tool_result` blocks `tool` messages (before the rest of that turn);
an assistant's `tool_use` blocks its `tool_calls`, its `thinking` blocks its reasoning;
`image` blocks `image_url` parts (a base64 source as a data: URL); `tools` functions;
`tool_choice` auto / any / tool / none as chat's default / required / a named function / none;
`output_config.format` (a JSON schema) a json_schema response_format (structured outputs) and
`output_config.effort` the chat template's `reasoning_effort`, as vLLM maps them; a final
assistant turn is continued (Anthropic's prefill). The chat path then renders, checks and runs
it: the same template, tool parser and 400s as /v1/chat/completions. A bad block is a
ValueError naming where it is (a 400).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest

Effort = Literal["low", "medium", "high", "xhigh", "max"]  # vLLM's AnthropicEffort


class JsonOutputFormat(msgspec.Struct, kw_only=True):
    """output_config.format: the answer is JSON matching `schema`."""

    type: Literal["json_schema"] = "json_schema"
    schema: dict[str, Any] | None = None  # None or {}: no constraint (vLLM's)


class OutputConfig(msgspec.Struct, kw_only=True):
    effort: Effort | None = None  # the chat template's reasoning_effort
    format: JsonOutputFormat | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """/v1/messages/count_tokens: a Messages request without max_tokens."""

    messages: list[Any]
    model: str | None = None
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: int  # required, as Anthropic's
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # accepted ({"user_id"}), not used
    stream: bool = False
    # vLLM's extensions, as on /v1/chat/completions
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class Usage(msgspec.Struct):
    """The cache fields only with --enable-prompt-tokens-details (vLLM's): then
    input_tokens is the prompt less the tokens read from and written to the prefix cache
    (Anthropic's three parts of a prompt)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | UnsetType = UNSET
    cache_read_input_tokens: int | UnsetType = UNSET


def usage(prompt_tokens: int, output_tokens: int, cache: tuple[int, int] | None) -> Usage:
    """cache: (tokens read from the prefix cache, tokens written to it), or None."""
    if cache is None:
        return Usage(prompt_tokens, output_tokens)
    read, written = cache
    return Usage(max(0, prompt_tokens - read - written), output_tokens, written, read)


class MessagesResponse(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[dict[str, Any]]  # text, thinking and tool_use blocks
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    # what the engine's KV connector hands on (disaggregated prefill); absent when none
    kv_transfer_params: dict[str, Any] | UnsetType = UNSET


class AnthropicErrorInfo(msgspec.Struct):
    type: str  # invalid_request_error, authentication_error, not_found_error, ...
    message: str


class AnthropicError(msgspec.Struct, kw_only=True):
    type: str = "error"
    error: AnthropicErrorInfo


# HTTP status -> Anthropic's error type (their documented pairs)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(finish_reason: str | None, matched: Any, tool_use: bool) -> str | None:
    """The engine's finish (and stop_reason: a matched stop string, or a stop token id) as
    Anthropic's stop_reason."""
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason is None:
        return None
    if isinstance(matched, str):
        return "stop_sequence"
    return "tool_use" if tool_use else "end_turn"


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as tool_use's input object ({} when cut short or not an
    object: Anthropic's input is always one)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


# ---------------------------------------------------------------------- request -> chat
def to_chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages request is (see the module's docstring)."""
    messages = _system(body.system) + _messages(body.messages)
    final = messages[-1] if messages else None
    prefill = final is not None and final["role"] == "assistant" and not final.get("tool_calls")
    fields: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        fields = {
            "max_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stream": body.stream,
            "cache_salt": body.cache_salt,
            "kv_transfer_params": body.kv_transfer_params,
        }
    choice, parallel = _tool_choice(body.tool_choice)
    return ChatCompletionRequest(
        messages=messages,
        model=body.model,
        tools=_tools(body.tools),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        **_output_config(body),
        **fields,
    )


def _output_config(body: CountTokensRequest) -> dict[str, Any]:
    """The chat fields of output_config (and chat_template_kwargs, over its effort)."""
    config = body.output_config or OutputConfig()
    kwargs = body.chat_template_kwargs
    if config.effort is not None:
        kwargs = {"reasoning_effort": config.effort, **(kwargs or {})}
    fields: dict[str, Any] = {"chat_template_kwargs": kwargs}
    if config.format is not None and config.format.schema:
        spec = {"name": "json_schema", "schema": config.format.schema}
        fields["response_format"] = {"type": "json_schema", "json_schema": spec}
    return fields


def _system(system: str | list[Any] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    texts = [_text(f"system[{i}]", block) for i, block in enumerate(system)]
    return [{"role": "system", "content": "\n".join(texts)}]


def _text(where: str, block: Any) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise ValueError(
            f'{where} must be a text block {{"type": "text", "text": ...}}, got {block!r:.200}'
        )
    if not isinstance(block.get("text"), str):
        raise ValueError(f"{where}.text must be a string, got {block.get('text')!r:.100}")
    return block["text"]


def _messages(messages: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise ValueError(f"{where}.role must be 'user' or 'assistant', got {role!r:.100}")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += _blocks(where, role, content)
        else:
            raise ValueError(
                f"{where}.content must be a string or a list of content blocks, "
                f"got {type(content).__name__}"
            )
    return out


def _blocks(where: str, role: str, blocks: list[Any]) -> list[dict[str, Any]]:
    """One turn's blocks as chat messages: a user's tool results first (one tool message
    each), then its text and images; an assistant's text and tool calls as one message."""
    tool_messages, parts, calls, thinking = [], [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text(at, block)})
        elif kind == "thinking" and role == "assistant":
            thinking.append(str(block.get("thinking") or ""))
        elif kind == "redacted_thinking" and role == "assistant":
            pass  # opaque: nothing a template could render
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(at, block)}})
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(at, block))
        elif kind == "tool_result" and role == "user":
            tool_messages.append(_tool_result(at, block))
        else:
            allowed = "text, image, tool_result" if role == "user" else "text, thinking, tool_use"
            raise ValueError(
                f"{at}: a {role} message's content blocks must be of type "
                f"{allowed}, got {block!r:.200}"
            )
    message: dict[str, Any] = {"role": role, "content": parts}
    if calls:
        message["tool_calls"] = calls
    if thinking:  # the chat path's reasoning of an earlier turn
        message["reasoning"] = "\n".join(thinking)
    keep = parts or calls or not tool_messages  # a turn of tool results alone: those only
    return tool_messages + ([message] if keep else [])


def _image_url(where: str, block: dict[str, Any]) -> str:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ValueError(
        f'{where}.source must be {{"type": "base64", "media_type", "data"}} or '
        f'{{"type": "url", "url"}}, got {source!r:.200}'
    )


def _tool_call(where: str, block: dict[str, Any]) -> dict[str, Any]:
    name, args = block.get("name"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(args, dict):
        raise ValueError(
            f"{where}: a tool_use block needs a name and an input object, got {block!r:.200}"
        )
    arguments = json.dumps(args, ensure_ascii=False)
    return {
        "id": block.get("id"),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _tool_result(where: str, block: dict[str, Any]) -> dict[str, Any]:
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text(f"{where}.content[{k}]", b) for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise ValueError(
            f"{where}.content must be a string or text blocks, got {type(content).__name__}"
        )
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": content}


def _tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if not tools:  # [] as no tools (chat refuses an empty list)
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise ValueError(f"tools[{i}] must be an object with a name, got {tool!r:.200}")
        schema = tool.get("input_schema", {"type": "object", "properties": {}})
        if not isinstance(schema, dict):
            raise ValueError(f"tools[{i}].input_schema must be a JSON schema object")
        function = {"name": tool["name"], "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool]:
    """(chat's tool_choice, parallel_tool_calls). auto is chat's default with tools (its
    tool parser, when the server has one); any: required; tool: the named function."""
    if choice is None:
        return None, True
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "auto":
        return None, parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ValueError(
        'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} '
        f'or {{"type": "tool", "name": ...}}, got {choice!r:.200}'
    )
