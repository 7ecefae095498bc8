"""A chat answer's role and what `echo` repeats, by vLLM's rules: the answer continues the
last message when there is no generation prompt, so it takes that message's role, and
`echo: true` puts that message's text before the generated content (whole answers and
streams alike, serving_chat.py)."""

from __future__ import annotations

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest


def response_role(request: ChatCompletionRequest) -> str:
    """The answer's role (vLLM's): the assistant's after a generation prompt, else the last
    message's, the one the answer continues."""
    if request.add_generation_prompt or not request.messages:
        return "assistant"
    last = request.messages[-1]
    return last.get("role", "assistant") if isinstance(last, dict) else "assistant"


def echoed(request: ChatCompletionRequest) -> str:
    """What `echo` puts before each choice's content (vLLM's rule): the last message's text
    (its text parts joined by newlines) when its role is the answer's, else nothing."""
    last = request.messages[-1] if request.echo and request.messages else None
    if not isinstance(last, dict) or last.get("role") != response_role(request):
        return ""
    content = last.get("content")
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
    return content if isinstance(content, str) else ""
