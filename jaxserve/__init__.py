"""jaxserve: a high-throughput LLM inference server on JAX/XLA with vLLM V1's architecture."""

__version__ = "0.1.0"
