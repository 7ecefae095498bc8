"""Chat templates rendered in child processes, bounded in time and memory, none waiting on
another.

A chat template is a program (Jinja in transformers' sandbox), and one from a request
(--trust-request-chat-template) or a loop over a long conversation can run for minutes:
`{% for i in range(99999) %}{% for j in range(99999) %}` is 10**10 steps, `'x' * 10**10` one
C-level allocation of 10 GB. A Python thread cannot be stopped, so the render runs in a child
process (transformers' own `render_jinja_template`, so the text is what `apply_chat_template`
gives): the child's address space is capped (RLIMIT_AS: a huge string is a MemoryError, not
the host's memory), and a render that passes its deadline has the child killed and a fresh
one started. Either way the request gets a ValueError (a 400).

Renders do not take turns: `RendererPool` keeps up to MAX_RENDERERS children (about 60 MB
each, each capped at DEFAULT_MEMORY_BYTES more), one render at a time in each, started as
renders overlap (a spare is always importing while one is free to start); requests' own
templates use at most REQUEST_TEMPLATE_RENDERERS of them at once, so the server's template
always has a child. The app's prepare threads run one at a time (`PREPARE_TURN`: the HF
tokenizer is not meant to be shared across threads) except while one waits for its render,
so a slow render holds up only its own request.

The child is this file run as a script; it imports only transformers' chat-template helpers
and msgspec. Frames on its stdin/stdout: a 4-byte big-endian length, then msgpack.
"""

from __future__ import annotations

import contextlib
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec

DEFAULT_MEMORY_BYTES = 1 << 30  # address space the child may add to what it has after imports
MAX_RENDERERS = 4  # child processes at most
REQUEST_TEMPLATE_RENDERERS = 2  # of them, rendering requests' own templates at once
_START_TIMEOUT_S = 120.0  # the child's imports (transformers), on a busy host
_HEADER = struct.Struct(">I")


def _frame(obj: Any) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return _HEADER.pack(len(body)) + body


class TemplateRenderer:
    """One child process rendering one template at a time (callers take turns)."""

    def __init__(self, memory_bytes: int = DEFAULT_MEMORY_BYTES):
        self.memory_bytes = memory_bytes
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._ready = False

    def start(self) -> None:
        """Start the child now (its imports take a second or two), not on the first render."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self._proc is None:
            self._proc = subprocess.Popen(
                [sys.executable, "-P", os.path.abspath(__file__), str(self.memory_bytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
            )
            self._ready = False

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            proc.stdin.close()
            proc.stdout.close()

    def render(self, job: dict[str, Any], timeout_s: float) -> str:
        """The text of job = {"template", "messages", "tools", "add_generation_prompt",
        "continue_final_message", "kwargs"}; ValueError if the template fails, runs past
        timeout_s seconds or outgrows the memory cap."""
        try:
            request = _frame(job)
        except (TypeError, OverflowError) as e:
            raise ValueError(f"cannot render the chat template over these messages: {e}") from None
        with self._lock:
            self._start()
            if not self._ready:
                if self._receive(time.monotonic() + _START_TIMEOUT_S) is None:
                    self._kill()
                    raise RuntimeError("the chat template renderer process did not start")
                self._ready = True
            try:
                self._proc.stdin.write(request)
                self._proc.stdin.flush()
            except OSError:
                self._kill()
                raise RuntimeError("the chat template renderer process exited") from None
            reply = self._receive(time.monotonic() + timeout_s)
            if reply is None or reply.get("exit"):
                self._kill()
                self._start()  # a fresh child for the next request, importing meanwhile
            if reply is None:
                raise ValueError(
                    f"the chat template did not finish rendering within {timeout_s:g} s"
                )
        if "error" in reply:
            raise ValueError(f"cannot apply the chat template: {reply['error']}")
        return reply["text"]

    def _receive(self, deadline: float) -> dict[str, Any] | None:
        """The child's next frame, or None if it does not come by `deadline` (or the child
        exited)."""
        header = self._read(_HEADER.size, deadline)
        if header is None:
            return None
        body = self._read(_HEADER.unpack(header)[0], deadline)
        return None if body is None else msgspec.msgpack.decode(body)

    def _read(self, n: int, deadline: float) -> bytes | None:
        fd = self._proc.stdout.fileno()
        chunks, left = [], n
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:  # the child exited
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)


class PrepareTurn:
    """A lock the app's prepare threads hold while they run (api_common.off_loop), so the
    tokenizer is used by one thread at a time; `released()` lets it go while this thread
    waits for something that does not touch the tokenizer (a chat template's child)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held = threading.local()

    def run(self, fn, *args):
        """fn(*args), holding the turn."""
        with self._lock:
            self._held.value = True
            try:
                return fn(*args)
            finally:
                self._held.value = False

    @contextlib.contextmanager
    def released(self):
        """The turn given up (if this thread holds it) for the block, then taken back."""
        if not getattr(self._held, "value", False):
            yield
            return
        self._held.value = False
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            self._held.value = True


PREPARE_TURN = PrepareTurn()


class RendererPool:
    """Up to `size` TemplateRenderers, each rendering for one caller at a time; at most
    `request_templates` of them for requests' own templates at once."""

    def __init__(
        self, size: int = MAX_RENDERERS, request_templates: int = REQUEST_TEMPLATE_RENDERERS
    ):
        self.size, self.request_templates = size, request_templates
        self._idle: list[TemplateRenderer] = []
        self._started = 0  # idle and busy
        self._request_busy = 0
        self._changed = threading.Condition()

    def start(self, n: int = 2) -> None:
        """Start n children now (their imports take a second or two), not on first use."""
        with self._changed:
            while self._started < min(n, self.size):
                self._idle.append(self._new())

    def close(self) -> None:
        """Kill the idle children (a busy one finishes its render; it exits with this
        process, when its stdin closes)."""
        with self._changed:
            idle, self._idle = self._idle, []
            self._started -= len(idle)
        for renderer in idle:
            renderer.close()

    def render(self, job: dict[str, Any], timeout_s: float, request_template: bool = False):
        """TemplateRenderer.render in a free child (started if none is and there is room;
        else the first one freed), the caller's PREPARE_TURN given up meanwhile.
        request_template: the job's template is the request's own."""
        with PREPARE_TURN.released():
            renderer = self._take(request_template)
            try:
                return renderer.render(job, timeout_s)
            finally:
                self._give_back(renderer, request_template)

    def _take(self, request_template: bool) -> TemplateRenderer:
        with self._changed:
            while (request_template and self._request_busy >= self.request_templates) or not (
                self._idle or self._started < self.size
            ):
                self._changed.wait()
            self._request_busy += request_template
            renderer = self._idle.pop() if self._idle else self._new()
            if not self._idle and self._started < self.size:
                self._idle.append(self._new())  # a spare, importing meanwhile
            return renderer

    def _give_back(self, renderer: TemplateRenderer, request_template: bool) -> None:
        with self._changed:
            self._request_busy -= request_template
            self._idle.append(renderer)
            self._changed.notify_all()

    def _new(self) -> TemplateRenderer:
        renderer = TemplateRenderer()
        renderer.start()
        self._started += 1
        return renderer


_shared: RendererPool | None = None
_shared_lock = threading.Lock()


def shared_renderer() -> RendererPool:
    """The process's renderers (a child is stateless: every job carries its template)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = RendererPool()
        return _shared


# ---------------------------------------------------------------------- the child
def _child(memory_bytes: int) -> None:
    import resource

    from transformers.utils.chat_template_utils import render_jinja_template

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr, not into the frames
    inp = sys.stdin.buffer
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])  # the address space now
    limit = pages * os.sysconf("SC_PAGE_SIZE") + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

    def send(obj: Any) -> None:
        out.write(_frame(obj))
        out.flush()

    send({"ready": True})
    while header := inp.read(_HEADER.size):
        job = msgspec.msgpack.decode(inp.read(_HEADER.unpack(header)[0]))
        try:
            (text,), _ = render_jinja_template(
                conversations=[job["messages"]],
                tools=job["tools"],
                chat_template=job["template"],
                add_generation_prompt=job["add_generation_prompt"],
                continue_final_message=job["continue_final_message"],
                **job["kwargs"],
            )
            reply: dict[str, Any] = {"text": text}
        except MemoryError:
            reply = {"error": f"it needs more than {memory_bytes} bytes of memory", "exit": True}
        except RecursionError:
            reply = {"error": "it recursed too deeply", "exit": True}
        except Exception as e:  # the template's own error (raise_exception, a bad variable)
            reply = {"error": f"{type(e).__name__}: {e}"[:2000]}
        send(reply)
        if reply.get("exit"):
            return


if __name__ == "__main__":
    _child(int(sys.argv[1]))
