"""vLLM's tokenization routes: what a prompt costs in tokens, and the tokenizer behind it.

- `POST /tokenize`: a prompt, or chat messages through the chat template exactly as
  /v1/chat/completions renders them (`tools`, `chat_template`, `chat_template_kwargs`,
  `add_generation_prompt`, or `continue_final_message` to leave the last assistant turn open)
  -> `{"count", "max_model_len", "tokens", "token_strs"}`; `token_strs` (the tokens' strings,
  `convert_ids_to_tokens`) only with `return_token_strs`, else null. `add_special_tokens`
  defaults to true for a prompt and false for messages (their template writes the special
  tokens itself), as in vLLM.
- `POST /detokenize`: `{"tokens"}` -> `{"prompt"}`.
- `GET /tokenizer_info` (--enable-tokenizer-info-endpoint; a 404 without it): the tokenizer's
  settings as its tokenizer_config.json holds them (special tokens as their text), without
  file paths, plus `tokenizer_class` and the server's chat template where one is set.

Tokenizing runs on the app's prepare threads (api_common.off_loop), off the event loop.
"""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jaxserve.entrypoints.openai.api_common import (
    MsgspecJSONResponse,
    decode_body,
    error_response,
    off_loop,
    serving_of,
)
from jaxserve.entrypoints.openai.chat_utils import check_tools
from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from jaxserve.entrypoints.openai.serving_models import model_name_of

# init_kwargs entries that are paths on the server, not settings of the tokenizer
_FILE_KWARGS = ("vocab_file", "merges_file", "tokenizer_file")


async def tokenize(request: Request) -> Response:
    s = serving_of(request)
    try:
        body = await decode_body(request, TokenizeRequest)
        s.check_model(body.model)
        if s.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        if body.messages is not None:
            chat = chat_request(body)
            txt, tokens = await off_loop(request, request.app.state.serving_chat.chat_prompt, chat)
            if body.add_special_tokens:  # on top of the template's (vLLM's default: false)
                tokens = (await off_loop(request, lambda: s.tokenizer(txt))).input_ids
        elif body.prompt is not None:
            s.engine.input_processor.check_text_length(body.prompt)
            special = body.add_special_tokens is not False
            encoded = await off_loop(
                request, lambda: s.tokenizer(body.prompt, add_special_tokens=special)
            )
            tokens = encoded.input_ids
        else:
            raise ValueError("tokenize needs prompt or messages")
        strs = None
        if body.return_token_strs:
            strs = await off_loop(request, s.tokenizer.convert_ids_to_tokens, tokens)
    except Exception as e:
        return error_response(e)
    answer = {"count": len(tokens), "max_model_len": s.max_model_len, "tokens": tokens}
    return MsgspecJSONResponse({**answer, "token_strs": strs})


def chat_request(body: TokenizeRequest) -> ChatCompletionRequest:
    """The chat completion whose prompt /tokenize counts. ValueError for settings that
    cannot go together and for tools chat completions refuse."""
    if body.continue_final_message and body.add_generation_prompt:
        raise ValueError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True. "
            "(add_generation_prompt is true unless set to false)"
        )
    chat = ChatCompletionRequest(
        messages=body.messages,
        tools=body.tools,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
    )
    if body.tools:  # (an empty list renders as no tools, as in vLLM)
        check_tools(chat, auto_tools=True)
    return chat


async def detokenize(request: Request) -> Response:
    s = serving_of(request)
    try:
        body = await decode_body(request, DetokenizeRequest)
        s.check_model(body.model)
        vocab = s.engine.config.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (size {vocab})")
        if s.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        text = await off_loop(request, s.tokenizer.decode, body.tokens)
    except Exception as e:
        return error_response(e)
    return MsgspecJSONResponse({"prompt": text})


async def tokenizer_info(request: Request) -> Response:
    if not request.app.state.options.enable_tokenizer_info_endpoint:
        raise HTTPException(404)  # as if the route were not there (vLLM's)
    s = serving_of(request)
    if s.tokenizer is None:
        return error_response(ValueError("this model has no tokenizer"))
    return MsgspecJSONResponse(
        tokenizer_config(s.tokenizer, request.app.state.serving_chat.chat_template)
    )


def tokenizer_config(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """vLLM's /tokenizer_info answer: the tokenizer's init_kwargs (what its
    tokenizer_config.json set) as JSON, less the paths of its files, with special tokens as
    their text, the bundled model's path as its hub name, `tokenizer_class` the tokenizer's
    class, and `chat_template` the server's (--chat-template, or the model directory's) where
    it has one of its own."""
    kwargs = getattr(tokenizer, "init_kwargs", None) or {}
    config = _as_json({k: v for k, v in kwargs.items() if k not in _FILE_KWARGS})
    if isinstance(config.get("name_or_path"), str):
        config["name_or_path"] = model_name_of(config["name_or_path"])
    config["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        config["chat_template"] = chat_template
    return config


def _as_json(value: Any) -> Any:
    """value as JSON data: an AddedToken as its text, mappings with string keys, anything
    else that is not JSON as its str()."""
    if isinstance(value, str | bool | int | float | type(None)):
        return value
    if hasattr(value, "content"):  # tokenizers' AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_as_json(v) for v in value]
    return str(value)


def tokenization_routes() -> list[Route]:
    """The routes api_server.build_app serves tokenization on."""
    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    ]
