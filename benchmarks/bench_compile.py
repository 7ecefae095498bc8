"""Compile time of one model forward against depth: the layer scan keeps it flat.

Builds random-weight Llama models of SmolLM2-135M's width with 2, 8 and 30 layers (or --layers)
and times jit lowering + XLA compilation of a forward over a flat batch of --tokens tokens. The
peer, in the same run, is the same model with its layer scan fully unrolled (what a Python loop
over layers would compile).

    .venv/bin/python benchmarks/bench_compile.py --layers 2 8 30 --tokens 256
"""

from __future__ import annotations

import argparse
import functools
import platform
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import LlamaConfig

from jaxserve.config import ModelConfig
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.step_inputs import text_inputs

SMOLLM2_WIDTH = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
    architectures=["LlamaForCausalLM"],
)  # fmt: skip


def compile_seconds(num_layers: int, tokens: int, seqs: int = 16, num_blocks: int = 256) -> float:
    config = ModelConfig.from_hf(LlamaConfig(num_hidden_layers=num_layers, **SMOLLM2_WIDTH))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0))))
    # the engine's layout (worker/kv_cache.py): every layer's blocks in one leading axis
    cache = jax.ShapeDtypeStruct(
        (num_layers * num_blocks, 16, config.num_kv_heads, config.head_dim), config.dtype
    )
    i32 = jnp.int32
    md = AttentionMetadata(
        slot_mapping=jax.ShapeDtypeStruct((tokens,), i32),
        block_tables=jax.ShapeDtypeStruct((seqs, 64), i32),
        kv_lens=jax.ShapeDtypeStruct((seqs,), i32),
        query_start_loc=jax.ShapeDtypeStruct((seqs + 1,), i32),
        num_seqs=jax.ShapeDtypeStruct((1,), i32),
    )

    def forward(state, ids, pos, kv, md):
        model = nnx.merge(graphdef, state)
        hidden, kv = model(text_inputs(ids, pos, md), kv)
        return model.compute_logits(hidden[md.query_start_loc[1:] - 1]), kv

    ids = jax.ShapeDtypeStruct((tokens,), i32)
    start = time.perf_counter()
    jax.jit(forward, donate_argnums=(3,)).lower(state, ids, ids, (cache, cache), md).compile()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 30])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # measure real compiles
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({platform.processor()})")
    print("| layers | scan: compile s | unrolled: compile s | unrolled / scan |")
    print("|---|---|---|---|")
    unrolled_scan = functools.partial(jax.lax.scan, unroll=True)
    for n in args.layers:
        scan = np.median([compile_seconds(n, args.tokens) for _ in range(args.repeats)])
        with mock.patch.object(jax.lax, "scan", unrolled_scan):
            unrolled = np.median([compile_seconds(n, args.tokens) for _ in range(args.repeats)])
        print(f"| {n} | {scan:.2f} | {unrolled:.2f} | {unrolled / scan:.1f}x |")


if __name__ == "__main__":
    main()
