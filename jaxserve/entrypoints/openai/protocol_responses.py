"""/v1/responses bodies (OpenAI's Responses API, as vLLM serves it) as msgspec Structs.

A request becomes a chat conversation (serving_responses.py): `input` items are messages,
`instructions` a system message, `text.format` a response_format, the flat function tools the
chat API's nested ones. The response echoes the request's settings beside its `output` items
(messages of output_text parts, function calls, reasoning), with the fields the openai
client's `Response` model requires.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

# ---------------------------------------------------------------------- bounded settings
# The settings a response echoes (and the store keeps) are typed and bounded here, so the
# decoder refuses an unknown key, a value out of its set or an oversized metadata with a 400
# naming it (`$.reasoning.summary`), before any of it is kept.
# OpenAI's ReasoningEffort: the chat template's reasoning_effort ("none": enable_thinking false)
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Summary = Literal["auto", "concise", "detailed"]
# OpenAI's bounds: at most 16 pairs, keys of at most 64 characters, values of at most 512
Metadata = Annotated[
    dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
    Meta(max_length=16),
]


class Reasoning(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's Reasoning, echoed with every field (nulls too, as vLLM's)."""

    context: Literal["auto", "current_turn", "all_turns"] | None = None  # accepted, echoed
    effort: Effort | None = None
    generate_summary: Summary | None = None  # OpenAI's older name of summary
    mode: Annotated[str, Meta(max_length=64)] | None = None  # accepted, echoed
    summary: Summary | None = None  # accepted, echoed (no summaries are written)


class _Format(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, omit_defaults=True):
    """text.format: {"type": "text" | "json_object" | "json_schema", ...}."""


class TextFormat(_Format, tag="text"):
    pass


class JsonObjectFormat(_Format, tag="json_object"):
    pass


class JsonSchemaFormat(_Format, kw_only=True, tag="json_schema"):
    schema: dict[str, Any]  # a JSON schema object (structured outputs compile it)
    name: Annotated[str, Meta(max_length=64)] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: TextFormat | JsonObjectFormat | JsonSchemaFormat = msgspec.field(
        default_factory=TextFormat
    )
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, echoed


class FunctionToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: Annotated[str, Meta(min_length=1)]


ToolChoice = Literal["none", "auto", "required"] | FunctionToolChoice
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class ResponsesRequest(msgspec.Struct, kw_only=True):
    # A string (one user message) or a list of items: messages ({"role", "content"}, content
    # a string or input_text / output_text / input_image parts), function_call and
    # function_call_output items of an earlier turn, reasoning items.
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None  # a system message first (not carried over by
    # previous_response_id, as OpenAI's)
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # {"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}}
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None  # {"type": "function", "name", "parameters"...}
    tool_choice: ToolChoice | None = None  # none/auto/required/{"type","name"}
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None  # accepted, echoed
    # {"effort"}: the chat template's reasoning_effort, and its enable_thinking (false for
    # "none") unless chat_template_kwargs sets it (vLLM's)
    reasoning: Reasoning | None = None
    stream: bool = False
    store: bool = True  # kept only with JAXSERVE_ENABLE_RESPONSES_API_STORE (echoed false else)
    previous_response_id: str | None = None
    user: str | None = None  # accepted, echoed
    metadata: Metadata | None = None  # accepted, echoed
    # "message.output_text.logprobs": output_text's logprobs (with top_logprobs each)
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None  # "disabled" only (no "auto" truncation)
    background: bool = False  # refused: needs a store that runs requests on its own
    service_tier: ServiceTier | None = None  # accepted, echoed
    prompt_cache_key: str | None = None  # accepted, not used (as vLLM)
    # vLLM's extensions: the response's raw prompt and output (text and token ids) as
    # input_messages / output_messages; chat's sampling and template fields (CHAT_FIELDS)
    enable_response_messages: bool = False
    top_k: int | None = None
    seed: int | None = None
    priority: int = 0
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    structured_outputs: dict[str, Any] | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    mm_processor_kwargs: dict[str, Any] | None = None


# ResponsesRequest's fields a ChatCompletionRequest takes as they are
CHAT_FIELDS = (
    "model", "stream", "temperature", "top_p", "top_k", "seed", "priority", "user",
    "parallel_tool_calls", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "include_stop_str_in_output", "logit_bias", "structured_outputs", "cache_salt",
    "kv_transfer_params", "include_reasoning", "mm_processor_kwargs",
)  # fmt: skip


# ---------------------------------------------------------------------- output items
class OutputText(msgspec.Struct):
    text: str
    type: str = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct):
    text: str
    type: str = "reasoning_text"


class OutputMessage(msgspec.Struct):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: str = "assistant"
    type: str = "message"


class FunctionCallItem(msgspec.Struct):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"
    type: str = "function_call"


class ReasoningItem(msgspec.Struct):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)
    status: str = "completed"
    type: str = "reasoning"


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


# ---------------------------------------------------------------------- the response
class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # read from the prefix cache
    cache_write_tokens: int = 0  # written to it (cache_usage.py)
    # vLLM's per-turn counts of its multi-turn tool loops: empty for one turn, as vLLM's
    input_tokens_per_turn: list[int] = msgspec.field(default_factory=list)
    cached_tokens_per_turn: list[int] = msgspec.field(default_factory=list)


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0
    tool_output_tokens: int = 0
    output_tokens_per_turn: list[int] = msgspec.field(default_factory=list)
    tool_output_tokens_per_turn: list[int] = msgspec.field(default_factory=list)


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(msgspec.Struct):
    reason: str  # "max_output_tokens"


class RawMessage(msgspec.Struct):
    """enable_response_messages: the raw prompt (the rendered chat template) or output, as
    text and token ids (vLLM's ResponseRawMessageAndToken)."""

    message: str
    tokens: list[int]
    type: str = "raw_message_tokens"


class ResponsesResponse(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    output: list[Any]  # OutputItem structs
    status: Literal["completed", "incomplete", "in_progress", "failed"] = "completed"
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    object: str = "response"
    # the request's settings, echoed (the sampling ones as the engine ran them, as vLLM's)
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None
    prompt: None = None  # OpenAI's prompt templates: not served (vLLM's null)
    store: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    truncation: str = "disabled"
    background: bool = False
    service_tier: str = "auto"
    # vLLM's: what the KV connector hands on (ec_: vLLM's encoder-cache transfer, none here)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: None = None
    # with enable_response_messages: [RawMessage] each (null without, as vLLM's)
    input_messages: list[RawMessage] | None = None
    output_messages: list[RawMessage] | None = None


def item_id(prefix: str) -> str:
    """OpenAI's ids: resp_..., msg_..., fc_..., rs_..., call_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------- request -> chat
_ROLES = ("user", "system", "developer", "assistant")
_ITEMS = "message, function_call, function_call_output or reasoning"


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as a list of items (a string: one user message)."""
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": request.input}]
    if not request.input:
        raise ValueError("input must not be empty")
    return request.input


def to_messages(items: list[Any], where: str = "input") -> list[dict[str, Any]]:
    """Responses items -> chat messages: a message as itself (its parts as text and image_url
    parts), function_call items as the tool_calls of an assistant message (the one before
    them, if it is the assistant's), function_call_output items as tool messages, a
    reasoning item's text as the next assistant message's `reasoning`. ValueError naming a
    bad item as where[i]."""
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{at} must be an object, got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ValueError(f"{at}.role must be one of {', '.join(_ROLES)}, got {role!r:.100}")
            message = {"role": role, "content": _content(item.get("content"), at)}
            if role == "assistant" and reasoning is not None:
                message["reasoning"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call_id, name, args = (_string(item, f, at) for f in ("call_id", "name", "arguments"))
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                if reasoning is not None:
                    last["reasoning"], reasoning = reasoning, None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = _content(output, f"{at}.output")
            elif not isinstance(output, str):
                raise ValueError(f"{at}.output must be a string or a list of input_text parts")
            messages.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", at), "content": output}
            )
        elif kind == "reasoning":
            texts = [_texts(item, field, at) for field in ("content", "summary")]
            reasoning = "".join(t for part in texts for t in part) or None
        else:
            raise ValueError(f"{at}.type must be {_ITEMS}, got {kind!r:.100}")
    return messages


def _texts(item: dict, field: str, at: str) -> list[str]:
    """A reasoning item's content or summary: its parts' texts ([] when absent)."""
    parts = item.get(field)
    if parts is None:
        return []
    if not isinstance(parts, list) or not all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
    ):
        raise ValueError(
            f'{at}.{field} must be a list of parts ({{"type", "text"}}), got {parts!r:.100}'
        )
    return [p["text"] for p in parts]


def _string(item: dict, field: str, at: str) -> str:
    value = item.get(field)
    if not isinstance(value, str) or (not value and field != "arguments"):
        raise ValueError(f"{at}.{field} must be a non-empty string, got {value!r:.100}")
    return value


def _content(content: Any, at: str) -> str | list[dict[str, Any]]:
    """A message's content: a string, or parts -> chat's text and image_url parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{at}.content must be a string or a list of parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if kind else None
        if kind in ("input_text", "output_text", "text", "refusal") and isinstance(text, str):
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise ValueError(
                    f"{at}.content[{j}]: an input_image needs an image_url (an http(s), data: or "
                    f"file:// URL; file_id is not supported), got {part!r:.200}"
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise ValueError(
                f"{at}.content[{j}] must be an input_text, output_text or input_image part, "
                f"got {part!r:.200}"
            )
    return parts


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools -> chat's {"type": "function", "function": {...}};
    none (or []) -> None."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ValueError(
                f'tools[{i}]: only function tools ({{"type": "function", "name", "parameters"}}) '
                f"are served, got type {kind!r:.100}"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: ToolChoice | None, tools: list | None) -> str | dict[str, Any] | None:
    """{"type": "function", "name"} -> chat's {"type": "function", "function": {"name"}}.
    Without tools: none, unless it asks for a call (a 400 in vLLM's words)."""
    if not tools:
        if choice == "required":
            raise ValueError("Tool choice 'required' must be specified with 'tools' parameter.")
        if isinstance(choice, FunctionToolChoice):
            raise ValueError("Tool choice 'function' not found in 'tools' parameter.")
        return None
    if not isinstance(choice, FunctionToolChoice):
        return choice  # none / auto / required
    return {"type": "function", "function": {"name": choice.name}}


def echo_tool_choice(choice: ToolChoice | None, tools: list | None) -> ToolChoice:
    """The tool_choice the response shows: auto by default, none without tools (vLLM's)."""
    return (choice or "auto") if tools else "none"


def template_kwargs(request: ResponsesRequest) -> dict[str, Any] | None:
    """chat_template_kwargs over reasoning.effort as the template's reasoning_effort and
    enable_thinking (false for "none": templates such as Qwen3's read it)."""
    effort = request.reasoning.effort if request.reasoning is not None else None
    if effort is None:
        return request.chat_template_kwargs
    implied = {"reasoning_effort": effort, "enable_thinking": effort != "none"}
    return {**implied, **(request.chat_template_kwargs or {})}


def response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """text.format -> chat's response_format (the same structured outputs)."""
    fmt = text.format if text is not None else TextFormat()
    if isinstance(fmt, JsonSchemaFormat):
        spec = {k: v for k, v in msgspec.structs.asdict(fmt).items() if v is not None}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": "json_object"} if isinstance(fmt, JsonObjectFormat) else None


def echo_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The tools as the response shows them (every field of OpenAI's FunctionTool)."""
    keys = ("name", "description", "parameters", "strict")
    return [{"type": "function", **{k: t.get(k) for k in keys}} for t in tools or ()]
