"""Where a decode step's time goes: the engine's step against its parts, same process.

The EngineCore runs in this process. For each batch size, B requests of --input-len random
ids are prefilled and then decoded; once every request is decoding:

- engine: one `EngineCore.step()` (schedule, build the batch, dispatch, fetch, update), median
  over --iters steps;
- forward: the compiled forward executable alone, replayed on the last decode step's inputs;
  attention: the engine's attention op alone (the CPU kernel or the jnp reference, as its
  --attention-backend; the reference for pallas) on that step's metadata, times the layers;
- sampler: the compiled sampling executable of that step (LM head, the step's sampler
  variant, penalty and last-token bookkeeping), replayed the same way;
- fused (where the decode step runs its forward and sampling as one executable,
  worker/fused_sampling.py): that executable, replayed the same way; forward and sampler
  are then the two executables of the same shapes (the step's forward feeding the sampler);
- host: engine - forward - sampler, or engine - fused (scheduling, batch building,
  dispatch, fetch, update);
- grammar (with --constrained, part of host): building the step's structured-output token
  bitmask, replayed on the last step's requests. --constrained gives every request a regex
  that never completes in practice (letters, then the unlikely "ZQXJ!"), so decode goes on.
- general_forward (with --decode-only-forwards): decode steps run the runner's decode-only
  forward (whose attention is the decode path alone) even where the backend has none
  (model_runner.DECODE_ONLY_FORWARDS), and the general forward of the same bucket is timed on
  the same inputs, calls of the two alternating, both reported as the median (not at batch
  1: a 1-token step is always a decode, and has no general forward).

Each part is the median of --iters runs after one warm-up, block_until_ready each time.

With --trace-dir DIR, --trace-steps engine steps of the last batch size (in steady decode,
after the timed ones) run under `jax.profiler.trace(DIR, create_perfetto_trace=True)` (the
Python tracer off, so it does not slow the host between steps), and the trace's device time
is summarised by op class: attention kernel, matmuls, sampler, elementwise, copies, and the
gaps where the device is idle (jaxserve/benchmarks/trace_summary.py), a table printed after
`Trace summary:`.

    .venv/bin/python benchmarks/profile_decode.py --batch-sizes 1 8 32
    python3 benchmarks/profile_decode.py --model llama-3-8b --load-format dummy \
        --dtype bfloat16 --batch-sizes 256 --trace-dir /tmp/trace
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time

import jax
import numpy as np

from jaxserve.benchmarks.common import median_seconds
from jaxserve.entrypoints.cli_args import add_engine_args, engine_args_from
from jaxserve.layers.sampler import pick_variant
from jaxserve.worker import fused_sampling
from jaxserve.worker.executables import ExecutableRegistry


def median_ms(fn, *args, iters: int) -> float:
    return 1e3 * median_seconds(fn, *args, iters=iters)


def attention_op_ms(runner, inputs, iters: int) -> float:
    """One layer's attention on the step's metadata and KV cache (random q): the CPU kernel
    when the engine runs it, else the reference."""
    from pallas_kernels.paged_attention import ragged_paged_attention_reference
    from pallas_kernels.paged_attention.cpu import ragged_paged_attention_cpu

    c = runner.config
    k_cache, v_cache = runner.kv_caches
    md = inputs.attn.at_layer(0, k_cache, len(c.kv_layers))  # the first layer's blocks
    q = jax.random.normal(jax.random.key(0), (len(inputs.input_ids), c.num_heads, c.head_dim))
    op = ragged_paged_attention_reference
    if runner.engine_config.attention_backend == "cpu":
        op = ragged_paged_attention_cpu
    attend = functools.partial(op, sm_scale=c.head_dim**-0.5)
    return median_ms(
        attend, q.astype(c.dtype), k_cache, v_cache, md.kv_lens, md.block_tables,
        md.query_start_loc, md.num_seqs, iters=iters,
    )  # fmt: skip


class CapturingRegistry(ExecutableRegistry):
    """The runner's executables; while `capturing`, each call's (name, arguments) is kept
    per executable kind (the last call of each)."""

    def __init__(self):
        super().__init__()
        self.capturing = False
        self.captured: dict[str, tuple] = {}

    def __getitem__(self, name: tuple):
        executable = super().__getitem__(name)
        if not self.capturing:
            return executable

        def call(*call_args):
            self.captured[name[0]] = (name, call_args)
            return executable(*call_args)

        return call


def trace_steps(core, batch: int, args) -> None:
    """--trace-steps engine steps under the profiler; the trace summarised by op class."""
    from jaxserve.benchmarks.trace_summary import find_trace, summarise

    options = None
    with contextlib.suppress(AttributeError):  # a jax without ProfileOptions: its defaults
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
    core.step()  # nothing of the timed steps still in flight when the trace starts
    with jax.profiler.trace(args.trace_dir, create_perfetto_trace=True, profiler_options=options):
        for _ in range(args.trace_steps):
            core.step()
    path = find_trace(args.trace_dir)
    if path is None:
        raise FileNotFoundError(f"jax.profiler wrote no trace JSON under {args.trace_dir}")
    summary = summarise(path)
    print(f"Trace summary: decode step at batch {batch}, {args.trace_steps} engine steps, "
          f"{summary.ops} ops ({summary.source}), {path}")  # fmt: skip
    print("\n".join(summary.table(args.trace_steps)) + "\n", flush=True)


def profile_batch(core, batch: int, args, rng) -> dict:
    from jaxserve.ipc.messages import EngineCoreRequest
    from jaxserve.sampling_params import SamplingParams

    runner = core.runner
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=10**4)
    if args.constrained:
        from jaxserve.sampling_params import StructuredOutputsParams

        so = StructuredOutputsParams(regex=r"[a-z ,.]+ZQXJ!")
        params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=10**4,
                                structured_outputs=so)  # fmt: skip
    ids = [f"p{batch}-{i}" for i in range(batch)]
    vocab = runner.config.vocab_size
    for rid in ids:
        prompt = rng.integers(100 if vocab > 1000 else 0, min(vocab, 20000), args.input_len)
        core.add_request(EngineCoreRequest(rid, prompt.tolist(), params, None, time.time()))
    registry = runner.executables
    registry.capturing = True
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
        registry.capturing = False
    engine_ms = 1e3 * float(np.median(walls))
    if args.trace_dir and batch == args.batch_sizes[-1]:
        trace_steps(core, batch, args)
    captured = registry.captured
    fused_ms = 0.0
    if fused_sampling.NAME in captured:  # the step ran forward and sampling as one program
        fused_key, fused_args = captured[fused_sampling.NAME]
        weights, _, _, inputs, head, _, sample_inputs = fused_args
        forward_key = ("forward", *fused_key[1:3])
        s = sample_inputs.rows.shape[0]  # the cheapest sampler of the same passes
        variant = pick_variant(fused_key[3], ready=lambda v: ("sample", s, v) in registry)
        sample_key = ("sample", s, variant)
        fused = registry[fused_key]

        def run_fused():
            out = fused(weights, runner.kv_caches, runner.step_state, inputs, head,
                        runner.penalty_state, sample_inputs)  # fmt: skip
            _, runner.kv_caches, sampled, runner.penalty_state, runner.step_state, _ = out
            return sampled

        fused_ms = median_ms(run_fused, iters=args.iters)
    else:
        forward_key, (weights, _, _, inputs) = captured["forward"]
        sample_key, (head, _, _, _, sample_inputs) = captured["sample"]
    forward = registry[forward_key]

    def run_forward(fn=forward, x=inputs):
        *out, runner.kv_caches = fn(weights, runner.kv_caches, runner.step_state, x)
        return out

    forward_ms = median_ms(run_forward, iters=args.iters)
    general_ms = 0.0
    if args.decode_only_forwards and forward_key[1] > 1:  # the general forward, same inputs
        general = registry[(*forward_key[:2], False)]
        x = inputs._replace(attn=inputs.attn._replace(decode_only=False))
        times = {forward: [], general: []}
        for fn in (forward, general) * args.iters:
            start = time.perf_counter()
            jax.block_until_ready(run_forward(fn, x if fn is general else inputs))
            times[fn].append(time.perf_counter() - start)
        forward_ms, general_ms = (1e3 * float(np.median(times[f])) for f in (forward, general))
    attention_ms = runner.config.num_layers * attention_op_ms(runner, inputs, args.iters)
    last_hidden = run_forward()[0]
    sampler = registry[sample_key]

    def run_sampler():
        out, runner.penalty_state, runner.step_state, _ = sampler(
            head, last_hidden, runner.penalty_state, runner.step_state, sample_inputs
        )
        return out

    sampler_ms = median_ms(run_sampler, iters=args.iters)
    live = [r for r in ids if r in core.scheduler.requests]
    grammar_ms = 0.0
    if args.constrained:
        grammar_ms = median_ms(
            core.scheduler.grammar_bitmask, live, set(live), len(live), iters=args.iters
        )
    core.abort_requests(ids)
    while core.has_unfinished_requests():
        core.step()
    return dict(
        batch=batch, tokens_bucket=forward_key[1], seqs_bucket=sample_key[1],
        engine_ms=engine_ms, host_ms=engine_ms - (fused_ms or forward_ms + sampler_ms),
        forward_ms=forward_ms, fused_ms=fused_ms, attention_ms=attention_ms, sampler_ms=sampler_ms,
        sampler_variant=sample_key[2], grammar_ms=grammar_ms, general_forward_ms=general_ms,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=96, help="context at decode")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--constrained", action="store_true", help="every request constrained (grammar_ms)"
    )
    parser.add_argument(
        "--decode-only-forwards", action="store_true",
        help="decode steps run a decode-only forward; time the general one beside it",
    )  # fmt: skip
    parser.add_argument(
        "--trace-dir",
        default=None,
        help="trace the last batch size's decode steps here (jax.profiler)",
    )
    parser.add_argument("--trace-steps", type=int, default=10)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.max_num_seqs is None:
        args.max_num_seqs = max(args.batch_sizes)
    from jaxserve.engine.core import EngineCore
    from jaxserve.startup import StartupTimeline
    from jaxserve.worker.build import build_runner

    if args.decode_only_forwards:
        from jaxserve.worker import model_runner

        for backend in model_runner.DECODE_ONLY_FORWARDS:
            model_runner.DECODE_ONLY_FORWARDS[backend] = True
    config = engine_args_from(args).create_engine_config()
    runner = build_runner(config, StartupTimeline(), executables=CapturingRegistry())
    core = EngineCore(config, runner=runner)
    rng = np.random.default_rng(args.seed)
    rows = [profile_batch(core, b, args, rng) for b in args.batch_sizes]
    cols = ["batch", "engine_ms", "host_ms", "forward_ms", "attention_ms", "sampler_ms"]
    cols += ["fused_ms"] if any(r["fused_ms"] for r in rows) else []
    cols += ["grammar_ms"] if args.constrained else []
    cols += ["general_forward_ms"] if args.decode_only_forwards else []
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c])
                                for c in cols) + " |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
