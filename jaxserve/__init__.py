"""jaxserve: a high-throughput LLM inference server on JAX/XLA with vLLM V1's architecture.

`from jaxserve import LLM, SamplingParams` as in vLLM. The names are imported on first use, so
`import jaxserve.<submodule>` stays light.
"""

import importlib

from jaxserve.version import __version__

_EXPORTS = {
    "LLM": "jaxserve.entrypoints.llm",
    "SamplingParams": "jaxserve.sampling_params",
    "RequestOutputKind": "jaxserve.sampling_params",
    "RequestOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
    "EngineArgs": "jaxserve.engine.arg_utils",
    "AsyncEngineArgs": "jaxserve.engine.arg_utils",
    "AsyncLLM": "jaxserve.engine.async_llm",
    "LoRARequest": "jaxserve.lora_request",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
