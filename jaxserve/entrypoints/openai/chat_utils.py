"""Chat requests with tools and reasoning: what /v1/chat/completions adds on top of text.

- `check_tools`: tool and tool_choice rules (400s, as vLLM): tools [] or tool_choice without
  tools, a named tool that is not in tools, "auto" without --enable-auto-tool-choice and
  --tool-call-parser, a named or required choice beside another output constraint.
- `tool_choice_constraint`: "required" and a named function are structured outputs (a JSON
  array of calls, or the function's parameters: tool_schema.py), so the output parses unless
  max_tokens cuts it short, and then it is no call (vLLM's).
- `template_messages`: messages as chat templates take them (assistant tool_calls with
  their arguments as dicts, content strings or lists of text and image parts per the
  content format).
- `render_chat`: the chat template over them, in one of template_worker's bounded children,
  with the request's chat_template_kwargs checked (`check_template_kwargs`).
- `ChoiceParser`: one choice's text -> reasoning, content and tool calls, whole or as
  streamed deltas (the reasoning parser first, then the tool parser on the content).
"""

from __future__ import annotations

import json
import re
from typing import Any

from jaxserve import envs
from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_tool_call_id,
)
from jaxserve.entrypoints.openai.template_worker import shared_renderer
from jaxserve.entrypoints.openai.tool_schema import required_calls_schema, tool_parameters
from jaxserve.sampling_params import StructuredOutputsParams

CONTENT_FORMATS = ("auto", "string", "openai")


# ---------------------------------------------------------------------- request checks
def tool_choice(request: ChatCompletionRequest) -> str | dict:
    """none / auto / required / {"type": "function", "function": {"name"}}; unset: auto
    with tools, none without (vLLM's defaults)."""
    if request.tool_choice is None:
        return "auto" if request.tools else "none"
    return request.tool_choice


def named_tool(request: ChatCompletionRequest) -> str | None:
    choice = tool_choice(request)
    return choice["function"]["name"] if isinstance(choice, dict) else None


def check_tools(request: ChatCompletionRequest, *, auto_tools: bool) -> None:
    """ValueError (a 400) for tool settings vLLM refuses; auto_tools: the server has
    --enable-auto-tool-choice and a --tool-call-parser."""
    tools = request.tools
    if tools is not None:
        if not tools:
            raise ValueError("tools must not be empty (leave it out for no tools)")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or tool.get("type", "function") != "function":
                raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools[{i}].function.name must be a non-empty string")
            params = fn.get("parameters", {})
            if not isinstance(params, dict):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    choice = tool_choice(request)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError(
                'tool_choice must be none, auto, required or {"type": "function", '
                f'"function": {{"name": ...}}}}, got {choice!r:.200}'
            )
    elif choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be none, auto, required or a function, got {choice!r}")
    if choice != "none" and not tools:
        raise ValueError(f"tool_choice {choice!r:.100} needs tools")
    if isinstance(choice, dict):
        names = [t["function"]["name"] for t in tools]
        if choice["function"]["name"] not in names:
            raise ValueError(
                f"tool_choice names {choice['function']['name']!r}, which is not in tools "
                f"({', '.join(names)})"
            )
    if choice == "auto" and request.tool_choice is not None and not auto_tools:
        raise ValueError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )


def tool_choice_constraint(request: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The structured output that enforces tool_choice "required" (a JSON array of one or
    more {"name", "parameters"} calls; one with parallel_tool_calls false) or a named
    function (its parameters object)."""
    choice = tool_choice(request)
    functions = {t["function"]["name"]: t["function"] for t in request.tools or []}
    if isinstance(choice, dict):
        return StructuredOutputsParams(json=tool_parameters(functions[choice["function"]["name"]]))
    if choice != "required":
        return None
    parallel = request.parallel_tool_calls is not False
    return StructuredOutputsParams(json=required_calls_schema(functions, parallel=parallel))


# ---------------------------------------------------------------------- messages
def content_format(template: str | None, requested: str) -> str:
    """--chat-template-content-format: "string" (parts joined into one string) or "openai"
    (a list of {"type": "text", "text"} parts); auto: openai when the template loops over a
    message's content, as vLLM detects."""
    if requested != "auto":
        return requested
    loops = re.search(r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)", template or "")
    return "openai" if loops else "string"


# Names the template machinery sets or reads itself (apply_chat_template's and the renderer's
# arguments, the template's globals): a request's chat_template_kwargs may not set them.
_RESERVED_KWARGS = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "sanitize_control_tokens", "raise_exception", "strftime_now", "dict",
    "namespace", "range", "cycler", "joiner", "lipsum",
})  # fmt: skip
_SCALARS = (str, bool, int, float, type(None))


def check_template_kwargs(kwargs: dict[str, Any] | None, special_tokens: list[str]) -> None:
    """ValueError unless every chat_template_kwargs entry is plain data a template reads as a
    variable: a key that is not one of the machinery's own names (chat_template and tokenize
    with vLLM's message; the tokenizer's special tokens such as bos_token: the template's
    markup is not the client's to change), a value that is a JSON scalar or a list of them."""
    if not kwargs:
        return
    unexpected = {"chat_template", "tokenize"} & kwargs.keys()
    if unexpected:
        raise ValueError(f"Found unexpected chat template kwargs from request: {unexpected}")
    for key, value in kwargs.items():
        if key in _RESERVED_KWARGS or key in special_tokens:
            raise ValueError(
                f"chat_template_kwargs may not set {key!r}: the chat template machinery sets it"
            )
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, _SCALARS) for v in items):
            raise ValueError(
                f"chat_template_kwargs[{key!r}] must be a string, number, boolean, null or a "
                f"list of them, got {value!r:.100}"
            )


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    template: str | None,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    kwargs: dict[str, Any] | None,
    request_template: bool = False,
) -> str:
    """What tokenizer.apply_chat_template(..., tokenize=False) gives (template None: the
    tokenizer's), rendered in a bounded child process: ValueError if the template fails,
    runs past $JAXSERVE_CHAT_TEMPLATE_TIMEOUT_S or outgrows the child's memory.
    request_template: `template` is the request's own (it renders in the children kept for
    those, template_worker.py)."""
    special = tokenizer.special_tokens_map
    check_template_kwargs(kwargs, list(special))
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    encoding = getattr(tokenizer, "chat_encoding", None)  # --tokenizer-mode's, as code
    if encoding is not None:
        if template is not None:
            raise ValueError("a chat template does not apply: the tokenizer mode encodes prompts")
        return encoding(messages, tools, kwargs, continue_final_message)
    try:
        template = tokenizer.get_chat_template(template, tools)
    except ValueError as e:
        raise ValueError(f"cannot apply the chat template: {e}") from None
    job = {
        "template": template,
        # As apply_chat_template: a key whose value is None is left out.
        "messages": [{k: v for k, v in m.items() if v is not None} for m in messages],
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "kwargs": {**special, **(kwargs or {})},
    }
    timeout = envs.JAXSERVE_CHAT_TEMPLATE_TIMEOUT_S
    return shared_renderer().render(job, timeout, request_template=request_template)


def template_messages(
    messages: list[Any], fmt: str, image_placeholder: str | None = None
) -> list[dict[str, Any]]:
    """image_placeholder: the model's image marker, for {"type": "image"} parts (what
    chat_media.extract_images leaves of image parts) under the "string" format."""
    return [_template_message(i, m, fmt, image_placeholder) for i, m in enumerate(messages)]


def _template_message(i: int, message: Any, fmt: str, placeholder: str | None) -> dict[str, Any]:
    """Any role (a custom one reaches the template as it is, as in vLLM); content a string
    or text and image parts per `fmt` (null -> ""; as one string, the image markers first,
    as vLLM puts them); assistant tool_calls with arguments as dicts; reasoning_content
    renamed reasoning (vLLM), and an assistant's reasoning also as `thinking`, the field
    gpt-oss's template renders as the analysis channel."""
    if not isinstance(message, dict):
        raise ValueError(f"messages[{i}] must be an object, got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r:.100}")
    out = dict(message)
    content = message.get("content")
    parts: list[dict[str, str]] = []  # {"type": "text", "text"} or {"type": "image"}
    if isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                parts.append({"type": "image"})
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise ValueError(
                    f"messages[{i}].content[{j}] must be a text or image_url part "
                    f'({{"type": "text", "text": ...}} or {{"type": "image_url", "image_url": '
                    f'{{"url": ...}}}}), got {part!r:.200}'
                )
    elif content is not None:
        raise ValueError(
            f"messages[{i}].content must be a string, a list of parts or null, "
            f"got {type(content).__name__}"
        )
    if fmt == "openai":
        out["content"] = parts
    else:
        images = [p for p in parts if p["type"] == "image"]
        if images and placeholder is None:
            raise ValueError(
                "the chat template takes message content as one string, and this model's "
                "image marker is not known: serve it with a chat template that renders "
                '{"type": "image"} parts (--chat-template-content-format openai)'
            )
        texts = [placeholder] * len(images) + [p["text"] for p in parts if p["type"] == "text"]
        out["content"] = "\n".join(texts)
    if "reasoning_content" in out and "reasoning" not in out:
        out["reasoning"] = out.pop("reasoning_content")
    if role == "assistant" and isinstance(out.get("reasoning"), str):
        out.setdefault("thinking", out["reasoning"])
    if role == "assistant" and out.get("tool_calls"):
        if not isinstance(out["tool_calls"], list):
            raise ValueError(f"messages[{i}].tool_calls must be a list")
        out["tool_calls"] = [_template_tool_call(i, j, c) for j, c in enumerate(out["tool_calls"])]
    return out


def _template_tool_call(i: int, j: int, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"messages[{i}].tool_calls[{j}] needs a function with a name")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments: {e}") from None
    return {**call, "function": {**fn, "arguments": args}}


# ---------------------------------------------------------------------- responses
class ChoiceParser:
    """Reasoning, content and tool calls of one choice, from its whole text (`full`) or as
    it streams (`delta`, then `finish`)."""

    def __init__(
        self, request: ChatCompletionRequest, tool_parser_cls, reasoning_parser_cls, tokenizer
    ):
        self.request = request
        self.choice = tool_choice(request)
        self.named = named_tool(request)
        self.reasoner = None
        if reasoning_parser_cls is not None:
            kwargs = request.chat_template_kwargs or {}
            self.reasoner = reasoning_parser_cls(tokenizer, chat_template_kwargs=kwargs)
        self.tool_parser = None
        if self.choice == "auto" and request.tools and tool_parser_cls is not None:
            self.tool_parser = tool_parser_cls(tokenizer)
        self.text = ""  # everything generated so far
        self.content = ""  # the part after the reasoning
        self.tools_called = False
        self.named_sent = False

    # -------------------------------------------------------------- whole text
    def full(self, text: str) -> tuple[ChatMessage, bool]:
        """The message for a finished choice, and whether it called tools."""
        reasoning, content = None, text
        if self.reasoner is not None:
            reasoning, content = self.reasoner.extract_reasoning(text, self.request)
        calls: list[ToolCall] = []
        if self.named is not None:
            # Arguments cut short (by max_tokens or a stop string) are no call (vLLM's)
            calls = [ToolCall(FunctionCall(self.named, content))] if _is_json(content) else []
            content = ""
        elif self.choice == "required":
            calls, content = _required_calls(content or ""), ""  # (vLLM's "", not null)
        elif self.tool_parser is not None and content:
            info = self.tool_parser.extract_tool_calls(content, self.request)
            if info.tools_called:
                calls, content = info.tool_calls, info.content
        if calls and self.request.parallel_tool_calls is False:
            calls = calls[:1]
        message = ChatMessage("assistant", content, reasoning, reasoning, calls)
        return message, bool(calls) and self.named is None

    # -------------------------------------------------------------- streaming
    def delta(self, delta_text: str, delta_ids: list[int]) -> DeltaMessage | None:
        """What to send for a new piece of text (None: nothing yet)."""
        previous, self.text = self.text, self.text + delta_text
        reasoning, content_delta = None, delta_text
        if self.reasoner is not None:
            d = self.reasoner.extract_reasoning_streaming(
                previous, self.text, delta_text, [], [], delta_ids
            )
            reasoning, content_delta = (d.reasoning, d.content) if d is not None else (None, None)
        out = DeltaMessage(reasoning=reasoning, reasoning_content=reasoning)
        if content_delta:
            self._content_delta(content_delta, out)
        return out if _has_news(out) else None

    def _content_delta(self, delta: str, out: DeltaMessage) -> None:
        previous, self.content = self.content, self.content + delta
        if self.named is not None:  # the arguments themselves
            call = DeltaToolCall(0, function=DeltaFunctionCall(arguments=delta))
            if not self.named_sent:
                self.named_sent = True
                call = DeltaToolCall(
                    0, random_tool_call_id(), "function", DeltaFunctionCall(self.named, delta)
                )
            out.tool_calls = [call]
        elif self.choice == "required":
            pass  # sent whole by finish(): the array is only certain once complete
        elif self.tool_parser is not None:
            d = self.tool_parser.extract_tool_calls_streaming(
                previous, self.content, delta, [], [], [], self.request
            )
            if d is not None:
                self._merge(d, out)
        else:
            out.content = delta

    def finish(self) -> DeltaMessage | None:
        """What is still held back when the choice ends (a partial tag, unsent arguments,
        the calls of tool_choice "required")."""
        out = DeltaMessage()
        if self.reasoner is not None:
            d = self.reasoner.flush_streaming(self.text)
            if d is not None:
                out.reasoning = out.reasoning_content = d.reasoning
                if d.content:
                    self._content_delta(d.content, out)
        if self.choice == "required":  # (a named call streamed as it came; nothing: no call)
            calls = _required_calls(self.content)
            if self.request.parallel_tool_calls is False:
                calls = calls[:1]
            out.tool_calls = [
                DeltaToolCall(
                    i, c.id, "function", DeltaFunctionCall(c.function.name, c.function.arguments)
                )
                for i, c in enumerate(calls)
            ]
            self.tools_called = bool(calls)
        elif self.tool_parser is not None:
            d = self.tool_parser.flush_streaming(self.content, self.request)
            if d is not None:
                self._merge(d, out)
        return out if _has_news(out) else None

    def _merge(self, d: DeltaMessage, out: DeltaMessage) -> None:
        if d.content:
            out.content = (out.content or "") + d.content
        calls = d.tool_calls
        if self.request.parallel_tool_calls is False:
            calls = [c for c in calls if c.index == 0]
        if calls:
            self.tools_called = True
            out.tool_calls = list(out.tool_calls) + list(calls)


def _has_news(m: DeltaMessage) -> bool:
    return bool(m.content or m.reasoning or m.tool_calls)


def _is_json(text: str | None) -> bool:
    try:
        json.loads(text or "")
    except (ValueError, RecursionError):  # (JSONDecodeError; nested past Python's stack)
        return False
    return True


def _required_calls(text: str) -> list[ToolCall]:
    """The calls of a tool_choice "required" output: [{"name", "parameters"}, ...]."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return []  # cut short by max_tokens
    return [
        ToolCall(FunctionCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)))
        for c in calls
        if isinstance(c, dict) and "name" in c and "parameters" in c
    ]
