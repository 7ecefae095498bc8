"""OpenAI request and response bodies as msgspec Structs (vLLM's fields and defaults).

Requests decode with `decode_request(body, type)`: a wrong type is a ValidationError that
names the field (`Expected int, got str - at $.max_tokens`), but a boolean may come as
"true" or 1, as vLLM reads it (request_values.lax_bools); unknown fields are ignored and
logged (vLLM's words). `to_sampling_params` turns a request into SamplingParams, whose own
checks name bad values.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from typing import Any, Literal

import msgspec

# The chat message bodies live under every layer (the reasoning parsers build them); they are
# OpenAI bodies all the same, importable from here beside the others.
from jaxserve.chat_messages import (  # noqa: F401
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_tool_call_id,
)

# The completion and chat answers (with vLLM's nulls) live beside this module.
from jaxserve.entrypoints.openai.protocol_output import (  # noqa: F401
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    CompletionStreamChoice,
    PromptTokensDetails,
    ResponseMessage,
    UsageInfo,
)
from jaxserve.entrypoints.openai.request_values import (
    lax_bools,
    logit_bias_ids,
    out_of_int64,
)
from jaxserve.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

logger = logging.getLogger(__name__)
# Per request (a completion may carry many prompts, each with n choices): far above normal
# use, low enough that one request cannot queue an unbounded amount of work.
MAX_PROMPTS_PER_REQUEST = 2048
MAX_SEQUENCES_PER_REQUEST = 4096  # prompts x n


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """What completions and chat share. None = the model's generation_config default, then
    SamplingParams' default."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    # logprobs' tokens as "token_id:N"; None: --return-tokens-as-token-ids decides
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None  # prompt_token_ids and token_ids in the answer
    logprob_token_ids: list[int] | None = None  # refused (UNSUPPORTED)
    priority: int = 0
    cache_salt: str | None = None  # prefix-cache entries shared only within one salt
    user: str | None = None  # accepted, ignored
    # best_of: refused with a 400 (vLLM removed it); use_beam_search: completions only
    best_of: int | None = None
    use_beam_search: bool = False
    # Structured outputs (structured_outputs_params below); the guided_* fields are vLLM's
    # names before 0.12, still sent by many clients, so still honoured.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # -> structured_outputs.whitespace_pattern
    # Disaggregated prefill (vLLM's field): handed to the engine's KV connector, e.g. the P/D
    # proxy's {"do_remote_decode": true, ...} for a prefill instance.
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any] | None = None  # str, list[str], list[int] or list[list[int]]
    # base64 torch.save'd tensors [P, D] (--enable-prompt-embeds), beside or instead of prompt
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = 16
    length_penalty: float = 1.0  # with use_beam_search (entrypoints/beam_search.py)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    echo: bool = False  # the last message's content first, when its role is the answer's
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # unset: auto with tools, else none
    parallel_tool_calls: bool = True  # false: only the first call is returned
    include_reasoning: bool = True  # with --reasoning-parser: the reasoning field
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None  # the templated prompt as prompt_text
    mm_processor_kwargs: dict[str, Any] | None = None  # the image processor's options
    # OpenAI's; given to the chat template as `reasoning_effort` (gpt-oss's reads it)
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # OpenAI's deprecated forms of tools / tool_choice: refused with a 400 naming those
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's TokenizeCompletionRequest (prompt) and TokenizeChatRequest (messages, with the
    chat fields below) in one (serving_tokenization.py)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # unset: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False  # the tokens' strings too, as token_strs
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


# ---------------------------------------------------------------------- responses
class ExtractedToolCallInformation(msgspec.Struct):
    """A tool parser's reading of a whole completion: the calls, and any plain content."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


class ModelPermission(msgspec.Struct):
    """OpenAI's legacy permission record, as vLLM sends one with every model: fixed values."""

    id: str = msgspec.field(default_factory=lambda: random_id("modelperm"))
    object: str = "model_permission"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: None = None
    is_blocking: bool = False


class ModelCard(msgspec.Struct):
    """A /v1/models entry; a LoRA adapter's has its path as root, its base model as parent
    and no max_model_len (vLLM's)."""

    id: str
    max_model_len: int | None = None
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    root: str | None = None
    parent: str | None = None
    object: str = "model"
    permission: list[ModelPermission] = msgspec.field(default_factory=lambda: [ModelPermission()])


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    code: int
    param: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


UNSUPPORTED = {
    "suffix": "suffix is not supported by jaxserve yet",
    "logprob_token_ids": "logprob_token_ids is not supported by jaxserve yet: its engine "
    "returns the logprobs of the sampled and the top-k tokens only (logprobs, top_logprobs)",
    "functions": "functions is deprecated by OpenAI and not supported: use tools",
    "function_call": "function_call is deprecated by OpenAI and not supported: use tool_choice",
}


def check_supported(request: _SamplingFields) -> None:
    """ValueError for fields this engine cannot honour (rather than ignoring them) and for
    values no SamplingParams field checks."""
    for field, message in UNSUPPORTED.items():
        if getattr(request, field, None) not in (None, False, []):
            raise ValueError(message)
    if request.best_of is not None and request.best_of != request.n:
        raise ValueError(
            f"best_of is not supported (vLLM removed it): use n, got best_of={request.best_of}"
        )
    if request.cache_salt is not None and not request.cache_salt:
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
    for field in request.__struct_fields__:  # JSON ints are unbounded; msgpack's are not
        value = getattr(request, field)
        if isinstance(value, int) and (refusal := out_of_int64(field, value)):
            raise ValueError(refusal)
    if request.stream_options is not None and not request.stream:
        raise ValueError("stream_options is only allowed when stream is true")


def structured_outputs_params(request: _SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint from whichever field carries it: response_format,
    structured_outputs or a legacy guided_* field (two of them: a 400)."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = request.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ValueError(
                    'response_format of type "json_schema" needs a json_schema object with a '
                    f"schema, got {spec!r:.200}"
                )
            found.append(("response_format", {"json": spec["schema"]}))
        elif kind == "structural_tag":
            tag = {k: v for k, v in rf.items() if k != "type"}
            found.append(("response_format", {"structural_tag": json.dumps(tag)}))
        elif kind != "text":
            raise ValueError(
                "response_format.type must be text, json_object, json_schema or structural_tag, "
                f"got {kind!r}"
            )
    if request.structured_outputs is not None:
        found.append(("structured_outputs", request.structured_outputs))
    for legacy in ("json", "regex", "choice", "grammar"):
        value = getattr(request, f"guided_{legacy}")
        if value is not None:
            found.append((f"guided_{legacy}", {legacy: value}))
    if len(found) > 1:
        raise ValueError(
            f"only one output constraint per request; got {', '.join(f for f, _ in found)}"
        )
    if not found:
        return None
    field, value = found[0]
    if request.guided_whitespace_pattern is not None:
        value = {**value, "whitespace_pattern": request.guided_whitespace_pattern}
    try:
        return msgspec.convert(value, StructuredOutputsParams)
    except msgspec.ValidationError as e:
        raise ValueError(f"{field}: {e}") from None


def to_sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    defaults: dict[str, Any],
    *,
    max_tokens: int | None,
    logprobs: int | None,
) -> SamplingParams:
    """Request fields over the model's generation_config defaults over SamplingParams'."""
    fields: dict[str, Any] = {}
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(request, name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            fields[name] = value
    return SamplingParams(
        **fields,
        n=request.n,
        stop=[request.stop] if isinstance(request.stop, str) else request.stop,
        stop_token_ids=request.stop_token_ids,
        include_stop_str_in_output=request.include_stop_str_in_output,
        seed=request.seed,
        ignore_eos=request.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=request.prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        logit_bias=logit_bias_ids(request.logit_bias),
        allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
        structured_outputs=structured_outputs_params(request),
        output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
    )


def decode_request(body: bytes, cls: type[msgspec.Struct]) -> Any:
    """The body as a cls; fields cls lacks are ignored, and logged once per request as vLLM
    does (one decode when there are none)."""
    try:
        return msgspec.json.decode(body, type=_strict(cls))
    except msgspec.ValidationError:
        try:
            request = msgspec.json.decode(body, type=cls)
        except msgspec.ValidationError:  # booleans as "true" or 1 (vLLM's lax mode), or real
            body = lax_bools(body, cls) or body
            request = msgspec.json.decode(body, type=cls)
    fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    ignored = set(fields) - set(cls.__struct_fields__)
    if ignored:
        logger.warning("The following fields were present in the request but ignored: %s", ignored)
    return request


@functools.cache
def _strict(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """cls refusing unknown fields (a subclass: what it decodes is still a cls)."""
    return type(cls.__name__, (cls,), {}, forbid_unknown_fields=True)


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """/v1/embeddings (a pooling server: --runner pooling)."""

    input: str | list[Any]  # str, list[str], list[int] or list[list[int]]
    model: str | None = None
    encoding_format: str = "float"  # float | base64 (little-endian float32)
    dimensions: int | None = None  # keep the first this many (Matryoshka)
    user: str | None = None
    normalize: bool | None = None  # vLLM's extension; None: the model's pooler config
    priority: int = 0


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo
    object: str = "list"
