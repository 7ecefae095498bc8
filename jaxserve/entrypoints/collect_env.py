"""`jaxserve collect-env`: vLLM's `vllm collect-env`, what a bug report needs in one paste.

The system (OS, Python, CPU), the versions of jaxserve and the packages it runs on, the JAX
backend and its devices, the NVIDIA driver (nvidia-smi's report, when there is one) and the
environment variables that change jaxserve's or XLA's behaviour. Plain and fast: no network,
no model; on a machine without a GPU the GPU parts say so. JAX is asked not to preallocate
device memory (unless the user set XLA_PYTHON_CLIENT_PREALLOCATE), so this runs beside a
server that holds the GPU.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata

# The packages whose versions a report names (the jax CUDA plugins are found by name).
PACKAGES = ("jaxserve", "jax", "jaxlib", "flax", "transformers", "tokenizers", "torch", "numpy")
ENV_PREFIXES = ("JAXSERVE_", "XLA_", "JAX_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES",)


def _version(name: str) -> str:
    if name == "jaxserve":  # a checkout run in place may not be installed
        from jaxserve.version import __version__

        return __version__
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def cuda_plugins() -> list[tuple[str, str]]:
    """The installed jax CUDA plugins (jax-cuda12-plugin, jax-cuda12-pjrt, ...): (name,
    version)."""
    found = set()
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("jax-cuda"):
            found.add((name, dist.version))
    return sorted(found)


def env_vars(environ: dict[str, str]) -> list[tuple[str, str]]:
    """The set variables that change jaxserve's, XLA's or JAX's behaviour (jaxserve/envs.py
    lists jaxserve's); an API key's value is hidden."""
    keep = sorted(k for k in environ if k.startswith(ENV_PREFIXES) or k in ENV_NAMES)
    return [(k, "***" if "API_KEY" in k else environ[k]) for k in keep]


def cpu_info() -> tuple[str, int | None, int | None]:
    """The CPU's model name, its logical cores and those this process may use."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return model, os.cpu_count(), usable


def jax_devices() -> list[str]:
    """The JAX backend and its devices (kind, count, memory where the backend says), or why
    there are none."""
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU" lines
    try:
        import jax

        devices = jax.devices()
    except Exception as e:  # a broken install or plugin: the report says so
        return [f"JAX backend       : failed to initialise: {e!r}"]
    lines = [
        f"JAX backend       : {jax.default_backend()}",
        f"JAX devices       : {len(devices)} (process {jax.process_index()} of "
        f"{jax.process_count()})",
    ]
    for d in devices:
        memory = ""
        try:
            limit = (d.memory_stats() or {}).get("bytes_limit")
        except Exception:  # CPU devices have no memory stats on some jaxlibs
            limit = None
        if limit:
            memory = f", memory limit {limit / 2**30:.1f} GiB"
        lines.append(f"  {d.platform}:{d.id} {d.device_kind}{memory}")
    return lines


def nvidia_smi() -> str:
    """nvidia-smi's report (driver, CUDA version, every GPU), or why there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "nvidia-smi not found (no NVIDIA driver on this machine)"
    try:
        out = subprocess.run([smi], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi failed: {e!r}"
    return (out.stdout or out.stderr).rstrip() or f"nvidia-smi exited {out.returncode}"


def collect() -> str:
    """The whole report, as text."""
    environ = dict(os.environ)  # as the user set it, before the default below
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    model, cores, usable = cpu_info()
    section = lambda title: ["", f"=== {title} ==="]  # noqa: E731
    lines = [
        "=== System ===",
        f"OS                : {platform.platform()}",
        f"libc              : {' '.join(platform.libc_ver()) or 'unknown'}",
        f"Python            : {sys.version.split()[0]} ({sys.executable})",
        f"CPU               : {model}",
        f"CPU cores         : {cores} logical, {usable} usable by this process",
        *section("Versions"),
    ]
    lines += [f"{name:<18}: {_version(name)}" for name in PACKAGES]
    plugins = cuda_plugins()
    lines += [f"{n:<18}: {v}" for n, v in plugins] or ["jax CUDA plugin   : none"]
    lines += [*section("JAX"), *jax_devices(), *section("NVIDIA"), nvidia_smi()]
    lines += section("Environment variables")
    lines += [f"{k}={v}" for k, v in env_vars(environ)] or ["(none set)"]
    return "\n".join(lines)


def main() -> int:
    print("Collecting environment information...", flush=True)
    print(collect())
    return 0
