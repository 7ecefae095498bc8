"""`jaxserve run-batch`: vLLM's `vllm run-batch`, OpenAI's Batch API file format run offline.

Each line of the input file is one request, `{"custom_id", "method": "POST", "url", "body"}`;
the output file gets one line per input line, in the input's order, `{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}`. A line that fails (not JSON, an
unknown url, a stream, a body the API refuses, a failed generation) gets its error in its own
output line, as vLLM writes it: the status code in `response`, the error JSON the server
would answer in `error`; the run goes on.

There is no second request path and no HTTP: `api_server.build_app` builds the server's app
over one AsyncLLM (its `app.state`, its lifespan: the chat template process, the engine
watcher), and each line is handed to the route handler the server routes its url to, as a
request whose body is the line's `body`. Every line runs concurrently (at most twice
--max-num-seqs at once, as vLLM); results are written as soon as the lines before them are.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from typing import IO, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from tqdm import tqdm

from jaxserve import envs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai import api_server, serving_score
from jaxserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, random_id
from jaxserve.entrypoints.openai.server_setup import load_chat_template
from jaxserve.transformers_utils.model_path import DEFAULT_MODEL_NAME

logger = logging.getLogger("jaxserve.run_batch")

Handler = Callable[[Request], Awaitable[Response]]

# The urls a batch line may name, and the server's route for each (vLLM's run-batch takes
# chat completions, embeddings, any url ending in /score or /rerank; completions too here).
ROUTES: dict[str, Handler] = {
    "/v1/chat/completions": api_server.chat_completions,
    "/v1/completions": api_server.completions,
    "/v1/embeddings": api_server.embeddings,
    **dict.fromkeys(("/score", "/v1/score"), serving_score.score),
    **dict.fromkeys(("/rerank", "/v1/rerank", "/v2/rerank"), serving_score.rerank),
}

# vLLM's: a plain bar with a newline, readable in a log
_BAR_FORMAT = (
    "{desc}: {percentage:3.0f}% Completed | {n_fmt}/{total_fmt} "
    "[{elapsed}<{remaining}, {rate_fmt}]\n"
)


class BatchRequestInput(msgspec.Struct):
    """One line of the input file (OpenAI's and vLLM's BatchRequestInput); the body stays
    raw JSON, for the route to decode as it decodes an HTTP body."""

    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class BatchResponseData(msgspec.Struct):
    """The HTTP response a line got: its status and, on success, the API's response JSON."""

    status_code: int
    request_id: str
    body: msgspec.Raw | None = None


class BatchRequestOutput(msgspec.Struct):
    """One line of the output file (OpenAI's and vLLM's BatchRequestOutput)."""

    id: str
    custom_id: str | None
    response: BatchResponseData | None
    error: Any = None


_encode = msgspec.json.Encoder().encode


def error_output(custom_id: str | None, status: int, error: msgspec.Raw) -> bytes:
    """An output line for a line that failed with `status`; error: the error JSON."""
    response = BatchResponseData(status, random_id("batch"))
    return _encode(BatchRequestOutput(_batch_id(), custom_id, response, error))


def _batch_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


_KINDS = {400: "BadRequestError", 405: "MethodNotAllowedError", 500: "InternalServerError"}


def _refused(custom_id: str | None, message: str, status: int = 400) -> bytes:
    """A line refused before reaching a route, with the server's error JSON."""
    body = ErrorResponse(ErrorInfo(message, _KINDS[status], status))
    return error_output(custom_id, status, msgspec.Raw(_encode(body)))


def _custom_id_of(line: bytes) -> str | None:
    """The custom_id of a line that is not a valid request, if it has a string one."""
    with contextlib.suppress(msgspec.DecodeError):
        value = msgspec.json.decode(line)
        if isinstance(value, dict) and isinstance(value.get("custom_id"), str):
            return value["custom_id"]
    return None


def _request(app, url: str, body: bytes) -> Request:
    """The request the server's route would get for a POST of `body` to `url`. Its client
    never disconnects: once the body is read, receive() waits forever."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": url,
        "raw_path": url.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": None,
        "server": None,
        "app": app,
    }
    return Request(scope, receive)


async def run_request(app, line: bytes) -> bytes:
    """One input line -> its output line (never raises)."""
    try:
        request = msgspec.json.decode(line, type=BatchRequestInput)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return _refused(_custom_id_of(line), f"invalid batch request line: {e}")
    handler = ROUTES.get(request.url)
    if handler is None:
        return _refused(
            request.custom_id,
            f"URL {request.url} was used. Supported endpoints: {', '.join(ROUTES)}",
        )
    if request.method.upper() != "POST":
        return _refused(request.custom_id, f"{request.method} is not allowed on {request.url}", 405)
    try:
        response = await handler(_request(app, request.url, bytes(request.body)))
    except Exception as e:  # a route answers its errors itself; this is a bug's
        logger.exception("batch line %r failed", request.custom_id)
        return _refused(request.custom_id, f"internal error: {e!r}", 500)
    if isinstance(response, StreamingResponse):  # nothing was queued yet: its body runs it
        with contextlib.suppress(Exception):
            await response.body_iterator.aclose()
        return _refused(request.custom_id, "Request must not be sent in stream mode")
    if response.status_code != 200:
        return error_output(request.custom_id, response.status_code, msgspec.Raw(response.body))
    data = BatchResponseData(200, random_id("batch"), msgspec.Raw(response.body))
    return _encode(BatchRequestOutput(_batch_id(), request.custom_id, data))


class OrderedWriter:
    """Writes output lines in input order as they arrive: a line waits only for the lines
    before it (at most the lines in flight are held)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.next = 0
        self.waiting: dict[int, bytes] = {}

    def add(self, index: int, line: bytes) -> None:
        self.waiting[index] = line
        while self.next in self.waiting:
            self.file.write(self.waiting.pop(self.next) + b"\n")
            self.next += 1


def _input_lines(path: str) -> int:
    """The input file's requests (non-blank lines), for the progress bar."""
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def check_files(args: argparse.Namespace) -> None:
    """SystemExit naming the flag, before minutes of loading: a URL (vLLM reads and uploads
    them; local paths only here), a missing input, an output directory that is not one."""
    for flag, path in (("--input-file", args.input_file), ("--output-file", args.output_file)):
        if path.startswith(("http://", "https://")):
            raise SystemExit(f"{flag} {path}: only a local path is supported, not a URL")
    if not os.path.isfile(args.input_file):
        raise SystemExit(f"--input-file {args.input_file}: no such file")
    for flag, folder in (
        ("--output-file", os.path.dirname(args.output_file) or "."),
        ("--output-tmp-dir", args.output_tmp_dir or "."),
    ):
        if not os.path.isdir(folder):
            raise SystemExit(f"{flag}: {folder} is not a directory")


async def run_batch(app, input_file: str, output: IO[bytes]) -> int:
    """Run every line of `input_file` through the app's routes, writing `output` in order.
    The app's lifespan (chat template process, engine watcher, stats log) spans the run and
    shuts the engine down at its end. Returns the number of lines written."""
    total = _input_lines(input_file)
    engine = app.state.serving.engine
    limit = asyncio.Semaphore(2 * engine.config.scheduler.max_num_seqs)
    writer = OrderedWriter(output)
    bar = tqdm(total=total, unit="req", desc="Running batch", mininterval=5, bar_format=_BAR_FORMAT)

    async def one(index: int, line: bytes) -> None:
        try:
            writer.add(index, await run_request(app, line))
        finally:
            limit.release()
            bar.update()

    async with app.router.lifespan_context(app):
        tasks: list[asyncio.Task] = []
        with open(input_file, "rb") as f, bar:
            for line in filter(None, map(bytes.strip, f)):
                await limit.acquire()
                tasks.append(asyncio.create_task(one(len(tasks), line)))
            await asyncio.gather(*tasks)
    return writer.next


def run(args: argparse.Namespace, engine_args) -> int:
    """`jaxserve run-batch`: start the engine, run the file, write the output (into
    --output-tmp-dir first, then moved into place, when given). Exit status 1 if the engine
    core died during the run (its lines carry the error)."""
    check_files(args)
    engine = AsyncLLM.from_engine_args(engine_args)
    try:  # the app's lifespan shuts the engine down from here on; until then, this does
        app = api_server.build_app(
            engine,
            args.served_model_name or [args.model or DEFAULT_MODEL_NAME],
            chat_template=load_chat_template(args.chat_template),
            chat_template_content_format=args.chat_template_content_format,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            log_stats_interval=envs.JAXSERVE_LOG_STATS_INTERVAL,
        )
        if args.output_tmp_dir:
            target = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed below, then moved)
                "wb",
                dir=args.output_tmp_dir,
                prefix="tmp_batch_output_",
                suffix=".jsonl",
                delete=False,
            )
        else:
            target = open(args.output_file, "wb")  # noqa: SIM115
    except BaseException:
        engine.shutdown()
        raise
    with target:
        written = asyncio.run(run_batch(app, args.input_file, target))
    if args.output_tmp_dir:
        shutil.move(target.name, args.output_file)
    logger.info("batch complete: %d lines written to %s", written, args.output_file)
    if app.state.engine_died:
        print("the engine core died during the batch", file=sys.stderr)
        return 1
    return 0
