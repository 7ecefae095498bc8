"""The errors the engine's clients raise to their callers (vLLM's `v1/engine/exceptions.py`).

Kept apart from the clients so that whoever maps them (the HTTP server's error responses,
AsyncLLM, the tests) imports only this, not the client machinery.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process is gone: every pending and future call fails with this."""

    def __init__(self, reason: str = "the engine core died"):
        super().__init__(f"EngineCore is dead ({reason}); see its log for the cause")


class RequestFailedError(RuntimeError):
    """One request failed while it was served (an exception in its own work in the engine
    core or the output processor: finish_reason "error"); the engine and every other request
    go on. A 500 over HTTP, with the error's message."""


class EngineAsleepError(RuntimeError):
    """A request sent while the engine sleeps (AsyncLLM.sleep, until wake_up): it fails at
    once, where it would otherwise wait for the wake-up; the engine stays up. A 503 over
    HTTP."""

    def __init__(self):
        super().__init__(
            "the engine is asleep: wake it up first (POST /wake_up, AsyncLLM.wake_up())"
        )
