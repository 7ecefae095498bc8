"""Every `JAXSERVE_*` environment variable jaxserve reads, with its default and type (vLLM's
`vllm/envs.py` pattern); docs/environment_variables.md has them in one table.

    import jaxserve.envs as envs
    if envs.JAXSERVE_ENABLE_MULTIPROCESSING: ...

Each attribute is read from the environment when it is accessed (the module's `__getattr__`
over `environment_variables`), not at import: a test's monkeypatch.setenv, a benchmark's
os.environ.setdefault or a parent that sets a variable for its children is seen by the next
read. This module imports nothing of jaxserve, so every layer may read it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the types (and defaults) the attributes have, for type checkers
    JAXSERVE_ENABLE_MULTIPROCESSING: bool = True
    JAXSERVE_LOG_LEVEL: str = "INFO"
    JAXSERVE_SHUTDOWN_TIMEOUT: float = 30.0
    JAXSERVE_API_KEY: str | None = None
    JAXSERVE_LOG_STATS_INTERVAL: float = 10.0
    JAXSERVE_CHAT_TEMPLATE_TIMEOUT_S: float = 5.0
    JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING: bool = False
    JAXSERVE_ENABLE_RESPONSES_API_STORE: bool = False
    JAXSERVE_RESPONSES_STORE_MAX_BYTES: int = 256 * 2**20
    JAXSERVE_SERVER_DEV_MODE: bool = False
    JAXSERVE_IMAGE_FETCH_TIMEOUT: float = 5.0
    JAXSERVE_MEDIA_URL_ALLOW_REDIRECTS: bool = True
    JAXSERVE_MEDIA_URL_ALLOW_PRIVATE_IPS: bool = False
    JAXSERVE_COMPILE_CACHE: str = "~/.cache/jaxserve/xla"
    JAXSERVE_WEIGHT_CACHE: str | None = "~/.cache/jaxserve/weights"
    JAXSERVE_KERNEL_CACHE: str = "~/.cache/jaxserve/kernels"
    JAXSERVE_CONFIG_CACHE: str | None = "~/.cache/jaxserve/configs"
    JAXSERVE_SIMULATED_STEP: str | None = None
    JAXSERVE_PP_LAYER_PARTITION: str | None = None
    JAXSERVE_PALLAS_KERNEL: str | None = None
    JAXSERVE_MOE_KERNEL: str | None = None
    JAXSERVE_SPARSE_MLA_KERNEL: str | None = None
    JAXSERVE_METRICS_LEGACY_PREFIX: bool = False
    JAXSERVE_VLLM_PYTHON: str = ".venv-vllm/bin/python"
    JAXSERVE_TEST_FAIL_AFTER_STEPS: int = -1
    JAXSERVE_TEST_STEP_DELAY_S: float = 0.0
    JAXSERVE_MINIMAL_COMPILE: bool = False
    JAXSERVE_FUSED_SAMPLING: str = "auto"
    JAXSERVE_TEST_REQUIRE_ALL: bool = False


# jaxserve's variables that have a vLLM twin: each reads vLLM's name when its own is unset, so
# a vLLM deployment's environment (VLLM_API_KEY first) keeps its meaning here
VLLM_NAMES: dict[str, str] = {
    "JAXSERVE_ENABLE_MULTIPROCESSING": "VLLM_ENABLE_V1_MULTIPROCESSING",
    "JAXSERVE_LOG_LEVEL": "VLLM_LOGGING_LEVEL",
    "JAXSERVE_CPU_KVCACHE_SPACE": "VLLM_CPU_KVCACHE_SPACE",
    "JAXSERVE_API_KEY": "VLLM_API_KEY",
    "JAXSERVE_LOG_STATS_INTERVAL": "VLLM_LOG_STATS_INTERVAL",
    "JAXSERVE_CHAT_TEMPLATE_TIMEOUT_S": "VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT",
    "JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING": "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "JAXSERVE_ENABLE_RESPONSES_API_STORE": "VLLM_ENABLE_RESPONSES_API_STORE",
    "JAXSERVE_SERVER_DEV_MODE": "VLLM_SERVER_DEV_MODE",
    "JAXSERVE_IMAGE_FETCH_TIMEOUT": "VLLM_IMAGE_FETCH_TIMEOUT",
    "JAXSERVE_MEDIA_URL_ALLOW_REDIRECTS": "VLLM_MEDIA_URL_ALLOW_REDIRECTS",
    "JAXSERVE_PP_LAYER_PARTITION": "VLLM_PP_LAYER_PARTITION",
}


def _get(name: str, default: str | None = None) -> str | None:
    """The variable `name`, else (unset or empty) its vLLM twin's (VLLM_NAMES), else
    `default`. vLLM's
    VLLM_CPU_KVCACHE_SPACE=0 means its default, as unset."""
    value = os.environ.get(name)
    if not value and os.environ.get(VLLM_NAMES.get(name, "")):  # unset or empty: vLLM's
        value = os.environ[VLLM_NAMES[name]]
        if name == "JAXSERVE_CPU_KVCACHE_SPACE" and value == "0":
            value = None
    return default if value is None else value


def _cache_dir(name: str) -> str:
    """~/.cache/jaxserve/<name>, resolved when read (HOME may be set by then)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", name)


def _optional_cache(variable: str, name: str) -> Callable[[], str | None]:
    """`variable`'s directory; "0": no cache (None); unset or empty: ~/.cache/jaxserve/<name>."""

    def read() -> str | None:
        value = os.environ.get(variable)
        if value == "0":
            return None
        return value or _cache_dir(name)

    return read


environment_variables: dict[str, Callable[[], Any]] = {
    # Run the engine core in its own process (LLM / LLMEngine); "0": in the caller's process.
    "JAXSERVE_ENABLE_MULTIPROCESSING": lambda: _get("JAXSERVE_ENABLE_MULTIPROCESSING", "1") != "0",
    # Log level of the engine core and DP coordinator processes (logging's level names).
    "JAXSERVE_LOG_LEVEL": lambda: _get("JAXSERVE_LOG_LEVEL", "INFO"),
    # Seconds an engine core asked to shut down lets in-flight requests finish before it
    # aborts them (engine/core_proc.py).
    "JAXSERVE_SHUTDOWN_TIMEOUT": lambda: float(os.environ.get("JAXSERVE_SHUTDOWN_TIMEOUT", "30")),
    # GiB of host memory for the KV cache on CPU when no --kv-cache-memory-bytes or
    # --num-gpu-blocks-override is given (vLLM's VLLM_CPU_KVCACHE_SPACE).
    "JAXSERVE_CPU_KVCACHE_SPACE": lambda: float(_get("JAXSERVE_CPU_KVCACHE_SPACE", "1")),
    # The API key the HTTP server requires on every route but its probes when --api-key is not
    # given (entrypoints/openai/middleware.py); unset: none.
    "JAXSERVE_API_KEY": lambda: _get("JAXSERVE_API_KEY"),
    # Seconds between the HTTP server's throughput log lines.
    "JAXSERVE_LOG_STATS_INTERVAL": lambda: float(_get("JAXSERVE_LOG_STATS_INTERVAL", "10")),
    # Seconds a chat template may take to render before its request fails (a 400) and the
    # renderer process is replaced (entrypoints/openai/template_worker.py).
    "JAXSERVE_CHAT_TEMPLATE_TIMEOUT_S": lambda: float(
        _get("JAXSERVE_CHAT_TEMPLATE_TIMEOUT_S", "5")
    ),
    # "1" or "true": `jaxserve serve` adds POST /v1/load_lora_adapter and
    # /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; docs/lora.md).
    "JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING": lambda: (
        _get("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")
    ),
    # "1" or "true": /v1/responses keeps responses in memory (bounded, least recently used
    # evicted: entrypoints/openai/responses_store.py) for previous_response_id and
    # GET /v1/responses/{id} (vLLM's VLLM_ENABLE_RESPONSES_API_STORE).
    "JAXSERVE_ENABLE_RESPONSES_API_STORE": lambda: (
        _get("JAXSERVE_ENABLE_RESPONSES_API_STORE", "0").strip().lower() in ("1", "true")
    ),
    # The bytes the response store may hold (each response as its JSON, plus a small
    # overhead; least recently used evicted first): entrypoints/openai/responses_store.py.
    "JAXSERVE_RESPONSES_STORE_MAX_BYTES": lambda: int(
        os.environ.get("JAXSERVE_RESPONSES_STORE_MAX_BYTES", str(256 * 2**20))
    ),
    # "1" or "true": the server's development routes (vLLM's VLLM_SERVER_DEV_MODE): /sleep,
    # /wake_up, /pause, /resume, weight transfer, /collective_rpc, /reset_prefix_cache
    # (entrypoints/openai/dev_routes.py); the server refuses them without an API key. For
    # trainers on a trusted network only.
    "JAXSERVE_SERVER_DEV_MODE": lambda: (
        _get("JAXSERVE_SERVER_DEV_MODE", "0").strip().lower() in ("1", "true")
    ),
    # Seconds an image URL of a chat message may take to fetch, in all (connecting, every
    # redirect, the body); past it the request fails with a 400 (vLLM's
    # VLLM_IMAGE_FETCH_TIMEOUT; multimodal/media.py).
    "JAXSERVE_IMAGE_FETCH_TIMEOUT": lambda: float(_get("JAXSERVE_IMAGE_FETCH_TIMEOUT", "5")),
    # "0" or "false": an image URL that answers with a redirect fails instead of being
    # followed (vLLM's VLLM_MEDIA_URL_ALLOW_REDIRECTS).
    "JAXSERVE_MEDIA_URL_ALLOW_REDIRECTS": lambda: (
        _get("JAXSERVE_MEDIA_URL_ALLOW_REDIRECTS", "1").strip().lower() not in ("0", "false")
    ),
    # "1" or "true": image URLs may reach loopback, private, link-local and other non-public
    # addresses (multimodal/url_policy.py; newer vLLM's VLLM_MEDIA_URL_ALLOW_PRIVATE_IPS).
    # Cloud metadata addresses stay refused.
    "JAXSERVE_MEDIA_URL_ALLOW_PRIVATE_IPS": lambda: (
        os.environ.get("JAXSERVE_MEDIA_URL_ALLOW_PRIVATE_IPS", "0").strip().lower() in ("1", "true")
    ),
    # jax's persistent compilation cache, and the runner's saved executables under its
    # executables/ (worker/).
    "JAXSERVE_COMPILE_CACHE": lambda: os.environ.get("JAXSERVE_COMPILE_CACHE", _cache_dir("xla")),
    # Where a GGUF's dequantized weights are cached (models/weight_cache.py); "0": no cache
    # (None); unset or empty: ~/.cache/jaxserve/weights.
    "JAXSERVE_WEIGHT_CACHE": _optional_cache("JAXSERVE_WEIGHT_CACHE", "weights"),
    # Where the model configs transformers resolved are kept as plain JSON, so a start-up
    # whose config.json was read before imports no transformers (transformers_utils/config.py);
    # "0": no cache; unset or empty: ~/.cache/jaxserve/configs.
    "JAXSERVE_CONFIG_CACHE": _optional_cache("JAXSERVE_CONFIG_CACHE", "configs"),
    # Where the CPU attention kernel is built (pallas_kernels/paged_attention/cpu.py).
    "JAXSERVE_KERNEL_CACHE": lambda: os.environ.get("JAXSERVE_KERNEL_CACHE", _cache_dir("kernels")),
    # "BASE_MS,PER_TOKEN_MS": the engine core runs a runner that only simulates a device
    # step's time (worker/simulated.py), for benchmarks of the serving layers at scale.
    "JAXSERVE_SIMULATED_STEP": lambda: os.environ.get("JAXSERVE_SIMULATED_STEP"),
    # Pipeline parallelism's layers per stage, comma-separated ("7,9,9,5"), instead of vLLM's
    # even split (config/pipeline.py; vLLM's VLLM_PP_LAYER_PARTITION).
    "JAXSERVE_PP_LAYER_PARTITION": lambda: _get("JAXSERVE_PP_LAYER_PARTITION") or None,
    # "mosaic" or "triton": the Pallas GPU attention kernel, whatever
    # pallas_kernels/paged_attention/kernel_choice.json measured for the device (choice.py).
    "JAXSERVE_PALLAS_KERNEL": lambda: os.environ.get("JAXSERVE_PALLAS_KERNEL") or None,
    # "tiles", "tokamax", "mosaic" or "xla": the MoE layers' grouped matmul where it can run,
    # instead of the platform's choice (pallas_kernels/grouped_matmul).
    "JAXSERVE_MOE_KERNEL": lambda: os.environ.get("JAXSERVE_MOE_KERNEL") or None,
    # "mosaic" or "xla": DeepSeek Sparse Attention's Mosaic GPU kernels (the indexer's scores,
    # the attention over the chosen tokens) on a Hopper GPU (layers/sparse_mla.py); "xla"
    # (the jnp references) until a GPU has run them.
    "JAXSERVE_SPARSE_MLA_KERNEL": lambda: os.environ.get("JAXSERVE_SPARSE_MLA_KERNEL") or None,
    # "1": /metrics also exports every metric under the `jaxserve:` prefix (before vLLM's
    # `vllm:` names; jaxserve/metrics/prometheus.py).
    "JAXSERVE_METRICS_LEGACY_PREFIX": lambda: (
        os.environ.get("JAXSERVE_METRICS_LEGACY_PREFIX", "0") not in ("", "0")
    ),
    # The python of the vLLM venv the benchmarks' --backend vllm runs (benchmarks/runners.py).
    "JAXSERVE_VLLM_PYTHON": lambda: os.environ.get("JAXSERVE_VLLM_PYTHON", ".venv-vllm/bin/python"),
    # Tests: an engine core process raises after this many steps (-1: never), to test how
    # the frontend handles a dead core.
    "JAXSERVE_TEST_FAIL_AFTER_STEPS": lambda: int(
        os.environ.get("JAXSERVE_TEST_FAIL_AFTER_STEPS", "-1")
    ),
    # Tests: seconds an engine core process sleeps after each step, to make requests slow.
    "JAXSERVE_TEST_STEP_DELAY_S": lambda: float(os.environ.get("JAXSERVE_TEST_STEP_DELAY_S", "0")),
    # Compile few step shapes: token buckets max_num_seqs' and the largest (and 1 + k with k
    # draft tokens), the largest sample bucket, all-greedy and all-pass sampling; every step
    # is padded up to them. A start several times faster, slower steps. The test suite's
    # engines run so (tests/conftest.py), but for the tests of compilation.
    "JAXSERVE_MINIMAL_COMPILE": lambda: os.environ.get("JAXSERVE_MINIMAL_COMPILE", "0") == "1",
    # A decode step's forward and sampling as one executable (worker/fused_sampling.py):
    # "auto" with the Pallas attention backend (GPU), "1" always, "0" never.
    "JAXSERVE_FUSED_SAMPLING": lambda: os.environ.get("JAXSERVE_FUSED_SAMPLING") or "auto",
    # Tests: the skips a broken install would cause (no C++ compiler, `openai` missing) fail
    # instead (tests/require.py); CI (.ci/run) sets it.
    "JAXSERVE_TEST_REQUIRE_ALL": lambda: (
        os.environ.get("JAXSERVE_TEST_REQUIRE_ALL", "0") not in ("", "0")
    ),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
