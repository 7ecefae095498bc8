"""Chat templates rendered in a child process, bounded in time and memory.

A chat template is a program (Jinja in transformers' sandbox), and one from a request
(--trust-request-chat-template) or a loop over a long conversation can run for minutes:
`{% for i in range(99999) %}{% for j in range(99999) %}` is 10**10 steps, `'x' * 10**10` one
C-level allocation of 10 GB. A Python thread cannot be stopped, so the render runs in a child
process (transformers' own `render_jinja_template`, so the text is what `apply_chat_template`
gives): the child's address space is capped (RLIMIT_AS: a huge string is a MemoryError, not
the host's memory), and a render that passes its deadline has the child killed and a fresh
one started. Either way the request gets a ValueError (a 400); other requests are not
affected beyond waiting for the deadline on the tokenizer thread.

The child is this file run as a script; it imports only transformers' chat-template helpers
and msgspec. Frames on its stdin/stdout: a 4-byte big-endian length, then msgpack.
"""

from __future__ import annotations

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
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
            )  # fmt: skip
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


_shared: TemplateRenderer | None = None
_shared_lock = threading.Lock()


def shared_renderer() -> TemplateRenderer:
    """The process's renderer (the child is stateless: every job carries its template)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = TemplateRenderer()
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
