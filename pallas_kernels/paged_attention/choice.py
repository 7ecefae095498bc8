"""Which Pallas GPU kernel serves a device: the Mosaic GPU kernel (`mosaic.py`: Hopper's TMA
and wgmma) or the Triton-backend one (`kernel.py`: any CUDA GPU, and the fallback).

`kernel_choice.json` beside this file is the table: {"devices": {device kind: {"kernel":
"mosaic" | "triton", what was measured}}}, the device kind as jax names it
(`jax.devices()[0].device_kind`, e.g. "NVIDIA H100 80GB HBM3"). `scripts/gpu_suite.sh` writes
a device's row from its kernel benchmark (the faster kernel over the decode and mixed cases;
Mosaic only when the GPU tests passed in the same run; its header has the format), and the
row is committed with the suite's report.

A device kind the table does not name (a user's first start on a new GPU) gets the Triton
kernel, the one that has run on GPUs, and one log line saying how to measure both there.
`$JAXSERVE_PALLAS_KERNEL` ("mosaic" or "triton") overrides the table. A call the Mosaic kernel
cannot serve goes to the Triton kernel whatever the table says: float32 or fp8 (q or cache),
Llama 4's attention_chunk, MLA (latent_dim), a head_dim that is not a multiple of 64, a block
size that is not a power of two from 8 to 256, or a GPU before sm_90.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

from jaxserve import envs

logger = logging.getLogger(__name__)

TABLE = Path(__file__).with_name("kernel_choice.json")
KERNELS = ("mosaic", "triton")


@functools.cache
def mosaic_kernel():
    """mosaic.ragged_paged_attention, or None on a jax without Mosaic GPU (imported on first
    use: only a GPU's forward needs it)."""
    try:
        from pallas_kernels.paged_attention.mosaic import ragged_paged_attention
    except ImportError as e:
        if not (e.name or "").startswith("jax"):
            raise
        return None
    return ragged_paged_attention


@functools.cache
def measured_choice(device_kind: str, table: Path = TABLE) -> str | None:
    """The table's kernel for a device kind, or None when it has no row for it."""
    try:
        devices = json.loads(table.read_text()).get("devices", {})
    except FileNotFoundError:
        devices = {}
    choice = devices.get(device_kind)
    if isinstance(choice, dict):  # the suite's row: {"kernel": ..., what it measured}
        choice = choice.get("kernel")
    if choice is not None and choice not in KERNELS:
        raise ValueError(f"{table}: {device_kind!r} -> {choice!r} is not one of {KERNELS}")
    return choice


def mosaic_refusal(
    *,
    q_dtype: str,
    cache_dtype: str,
    head_dim: int,
    block_size: int,
    attention_chunk: int | None,
    latent_dim: int | None,
    compute_capability: str | None,
) -> str | None:
    """Why the Mosaic kernel cannot serve a call (None: it can). Dtypes by name."""
    if q_dtype not in ("bfloat16", "float16") or cache_dtype != q_dtype:
        return f"q {q_dtype} over a {cache_dtype} cache (it takes bf16/f16 for both)"
    if attention_chunk is not None:
        return "attention_chunk"
    if latent_dim is not None:
        return "MLA (latent_dim)"
    if head_dim % 64:
        return f"head_dim {head_dim} (a multiple of 64)"
    if not (8 <= block_size <= 256 and block_size & (block_size - 1) == 0):
        return f"block size {block_size} (a power of two from 8 to 256)"
    if compute_capability is not None and float(compute_capability) < 9.0:
        return f"compute capability {compute_capability} (TMA and wgmma need sm_90)"
    return None


def choose_kernel(
    device_kind: str, *, override: str | None = None, table: Path = TABLE, **call
) -> str:
    """ "mosaic" or "triton" for a call on a device (`call`: mosaic_refusal's arguments);
    override: $JAXSERVE_PALLAS_KERNEL's value (by default read here)."""
    if override is None:
        override = envs.JAXSERVE_PALLAS_KERNEL
    if override is not None and override not in KERNELS:
        raise ValueError(f"$JAXSERVE_PALLAS_KERNEL={override!r} is not one of {KERNELS}")
    wanted = override or measured_choice(device_kind, table)
    if wanted is None:
        _log_once(
            f"no kernel measured for {device_kind!r} in {table.name}: the Triton kernel "
            "serves it (bash scripts/gpu_suite.sh --steps kernel_bench measures both; "
            "$JAXSERVE_PALLAS_KERNEL=mosaic tries the other)"
        )
        return "triton"
    if wanted == "mosaic" and (reason := mosaic_refusal(**call)) is not None:
        _log_once(f"the Mosaic GPU kernel cannot serve {reason}: the Triton kernel does")
        return "triton"
    return wanted


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)
