"""Where a decode step's time goes: the engine's step against its parts, same process.

The EngineCore runs in this process. For each batch size, B requests of --input-len random
ids are prefilled and then decoded; once every request is decoding:

- engine: one `EngineCore.step()` (schedule, build the batch, dispatch, fetch, update), median
  over --iters steps;
- compiled step: the jitted step alone, replayed on the last decode step's inputs (forward,
  logits, sampler, penalty bookkeeping; no host work); host = engine - compiled step;
- forward: the model and the logits of the last tokens only (jitted on the same inputs);
  attention: what the forward loses when the reference attention returns q unchanged (the
  KV write stays);
- sampler: `sample` alone on [S, V] logits with the step's sampling rows (K = max_logprobs);
- forward, unrolled: the same forward over per-layer weight arrays in a Python loop instead
  of `lax.scan` over the stacked [L, ...] weights. On XLA:CPU every scanned layer copies its
  weight slices out of the stack before the matmuls read them (dynamic-slice fusions); the
  difference is that copy. (Compiling unrolled takes ~6x longer, see cpu.md.)

Each part is the median of --iters runs after one warm-up, block_until_ready each time.

    .venv/bin/python benchmarks/profile_decode.py --batch-sizes 1 8 32
"""

from __future__ import annotations

import argparse
import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.benchmarks.common import median_seconds
from jaxserve.entrypoints.cli import add_engine_args, engine_args_from


def median_ms(fn, *args, iters: int) -> float:
    return 1e3 * median_seconds(fn, *args, iters=iters)


@contextlib.contextmanager
def attention_stubbed():
    """The reference attention returns q: what remains is everything but attention."""
    import jaxserve.layers.attention as attention

    real = attention.ragged_paged_attention_reference
    attention.ragged_paged_attention_reference = lambda q, *a, **k: q
    try:
        yield
    finally:
        attention.ragged_paged_attention_reference = real


def forward_ms(runner, inputs, iters: int, layers=None) -> float:
    """The model and the logits of the last tokens, jitted with the KV cache donated (as in
    the step); with `layers` (one state per layer) the layers run in a Python loop."""

    def forward(state, layers, kv, inputs):
        model = nnx.merge(runner.graphdef, state)
        if layers is None:
            hidden, kv = model(inputs.input_ids, inputs.positions, kv, inputs.attn)
        else:
            hidden, kv = unrolled_body(model, layers, inputs, kv)
        return model.compute_logits(hidden[inputs.logits_indices]), kv

    fn = jax.jit(forward, donate_argnums=(2,))

    def call():
        logits, runner.kv_caches = fn(runner.state, layers, runner.kv_caches, inputs)
        return logits

    return median_ms(call, iters=iters)


def unrolled_body(model, layers, inputs, kv):
    """LlamaForCausalLM.__call__ with a Python loop over per-layer weights: `layers` is a list
    of one state per layer (separate arrays, split once beforehand)."""
    k_all, v_all = kv
    num_layers, num_blocks, block_size = k_all.shape[:3]
    flat = (num_layers * num_blocks, *k_all.shape[2:])
    k_cache, v_cache = k_all.reshape(flat), v_all.reshape(flat)
    md = inputs.attn
    h = model.embed_tokens(inputs.input_ids)
    layer_graphdef = nnx.graphdef(model.layers)
    for i, state in enumerate(layers):
        offset = i * num_blocks
        layer_md = md._replace(
            block_tables=md.block_tables + offset,
            slot_mapping=jnp.where(md.slot_mapping >= 0, md.slot_mapping + offset * block_size, -1),
        )
        h, k_cache, v_cache = nnx.merge(layer_graphdef, state)(
            h, inputs.positions, k_cache, v_cache, layer_md
        )
    return model.norm(h), (k_cache.reshape(k_all.shape), v_cache.reshape(v_all.shape))


def profile_batch(core, batch: int, args, rng) -> dict:
    from jaxserve.ipc.messages import EngineCoreRequest
    from jaxserve.layers.sampler import sample
    from jaxserve.sampling_params import SamplingParams

    runner = core.runner
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=10**4)
    ids = [f"p{batch}-{i}" for i in range(batch)]
    vocab = runner.config.vocab_size
    for rid in ids:
        prompt = rng.integers(100 if vocab > 1000 else 0, min(vocab, 20000), args.input_len)
        core.add_request(EngineCoreRequest(rid, prompt.tolist(), params, None, time.time()))
    captured = {}
    real_run = runner._run

    def capturing_run(inputs):
        captured["inputs"] = inputs
        return real_run(inputs)

    runner._run = capturing_run
    try:
        while core.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
        ):
            core.step()
        for _ in range(3):  # settle into decode
            core.step()
        walls = []
        for _ in range(args.iters):
            start = time.perf_counter()
            core.step()
            walls.append(time.perf_counter() - start)
    finally:
        runner._run = real_run
    inputs = captured["inputs"]
    engine_ms = 1e3 * float(np.median(walls))

    def step_once():
        return runner._run(inputs)

    compiled_ms = median_ms(step_once, iters=args.iters)
    full_ms = forward_ms(runner, inputs, args.iters)
    with attention_stubbed():
        no_attn_ms = forward_ms(runner, inputs, args.iters)
    layers_state = runner.state["layers"]
    per_layer = [
        jax.tree.map(lambda x, i=i: x[i] + 0, layers_state) for i in range(runner.config.num_layers)
    ]  # separate arrays, copied once here
    unrolled_ms = forward_ms(runner, inputs, args.iters, per_layer)
    del per_layer
    logits = jax.random.normal(jax.random.key(0), (len(inputs.rows), runner.config.vocab_size))
    prompt_mask, output_counts = runner.penalty_state
    sampling = inputs.sampling._replace(
        prompt_mask=prompt_mask[inputs.rows], output_counts=output_counts[inputs.rows]
    )
    sampler = jax.jit(lambda lg, md, key: sample(lg, md, key, num_logprobs=runner.num_logprobs))
    sampler_ms = median_ms(sampler, logits, sampling, jax.random.PRNGKey(0), iters=args.iters)
    core.abort_requests(ids)
    while core.has_unfinished_requests():
        core.step()
    return dict(
        batch=batch, tokens_bucket=len(inputs.input_ids), seqs_bucket=len(inputs.rows),
        engine_ms=engine_ms, compiled_step_ms=compiled_ms, host_ms=engine_ms - compiled_ms,
        forward_ms=full_ms, attention_ms=full_ms - no_attn_ms, sampler_ms=sampler_ms,
        forward_unrolled_ms=unrolled_ms,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=96, help="context at decode")
    parser.add_argument("--iters", type=int, default=20)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.max_num_seqs is None:
        args.max_num_seqs = max(args.batch_sizes)
    from jaxserve.engine.core import EngineCore

    core = EngineCore(engine_args_from(args).create_engine_config())
    rng = np.random.default_rng(args.seed)
    rows = [profile_batch(core, b, args, rng) for b in args.batch_sizes]
    cols = ["batch", "engine_ms", "compiled_step_ms", "host_ms", "forward_ms", "attention_ms",
            "sampler_ms", "forward_unrolled_ms"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c])
                                for c in cols) + " |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
