"""`jaxserve chat` and `jaxserve complete`: vLLM's interactive clients of a running server.

Each line read from stdin is one user message (chat: the conversation is kept, so the model
sees the history) or one prompt (complete); the answer streams to stdout as it is generated.
End of input (Ctrl-D) ends the session; `--quick MESSAGE` sends one message and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator

import httpx


def run(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=None) as http:
        try:
            model = args.model_name or _first_model(http)
        except httpx.HTTPError as e:
            print(f"cannot reach the server at {args.url}: {e}", file=sys.stderr)
            return 1
        print(f"Using model: {model}", file=sys.stderr)
        messages = []
        if args.command == "chat" and args.system_prompt:
            messages.append({"role": "system", "content": args.system_prompt})
        lines = [args.quick] if args.quick is not None else _input_lines()
        for line in lines:
            if args.command == "chat":
                messages.append({"role": "user", "content": line})
                body = {"model": model, "messages": messages}
                path = "/chat/completions"
            else:
                body, path = {"model": model, "prompt": line}, "/completions"
            if args.max_tokens is not None:
                body["max_tokens"] = args.max_tokens
            try:
                answer = "".join(_print_stream(http, path, body, args.command == "chat"))
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
                if args.command == "chat":
                    messages.pop()
                continue
            if args.command == "chat":
                messages.append({"role": "assistant", "content": answer})
    return 0


def _first_model(http: httpx.Client) -> str:
    response = http.get("/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _input_lines() -> Iterator[str]:
    while True:
        try:
            yield input("> ")
        except EOFError:
            print(file=sys.stderr)
            return


def _print_stream(http: httpx.Client, path: str, body: dict, chat: bool) -> Iterator[str]:
    """POST a streaming request, print each piece of text as it comes; yields the pieces."""
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            raise RuntimeError(json.loads(response.read())["error"]["message"])
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            for choice in event["choices"]:
                text = (choice["delta"].get("content") if chat else choice["text"]) or ""
                print(text, end="", flush=True)
                yield text
    print(flush=True)
