"""The model runner's own host work per step, without the device: `dispatch` + `fetch` of a
decode step of N synthetic requests, with every executable replaced by a stub that returns
ready arrays at once, so what is timed is the runner's Python and numpy (applying the
scheduler output, building the batch and the per-row sampling arrays, picking the sampler
variant, unpacking the results). The simulated device step of bench_dp_scale swaps out the
whole runner, so it cannot see this.

The requests' sampling parameters are mixed (a quarter each): greedy; temperature + top-p;
seeded with top-k; repetition/frequency penalties with a logit bias and min_tokens.

It also times the batch builder alone where the tree has one (`InputBatch.update` +
`BatchBuilder.build`). It runs on an older tree too (PYTHONPATH=<checkout>, same script): a
runner without an executable registry has its `_executable` lookup stubbed instead, the only
way to reach it there; that is how the before figure of benchmarks/results/cpu.md was taken.

    .venv/bin/python benchmarks/bench_host_step.py --rows 256 512
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.layers.sampler import SamplerOutput
from jaxserve.models.loader import load_model
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.model_runner import ModelRunner
from jaxserve.worker.step_state import Settled

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
              hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
              tie_word_embeddings=True, torch_dtype="float32")  # fmt: skip
PROMPT, BLOCK = 32, 16


def sampling_params(i: int) -> SamplingParams:
    kind = i % 4
    if kind == 0:
        return SamplingParams(temperature=0.0, max_tokens=10**4)
    if kind == 1:
        return SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10**4)
    if kind == 2:
        return SamplingParams(temperature=1.0, top_k=40, seed=i, max_tokens=10**4)
    return SamplingParams(temperature=0.7, repetition_penalty=1.1, frequency_penalty=0.2,
                          logit_bias={5: 1.0, 7: -2.0}, min_tokens=4, max_tokens=10**4)  # fmt: skip


class Stubs:
    """Every executable: a function returning ready outputs of the right structure."""

    def __init__(self, runner: ModelRunner, rows: int):
        d, rep = runner.config.hidden_size, jnp.zeros
        self.last_hidden, self.hidden = rep((rows, d)), rep((rows, d))
        self.tokens = {}

    def get(self, name: tuple):
        kind = name[0]
        if kind == "forward":
            return lambda params, kv, last, inputs: (self.last_hidden, self.hidden, kv)
        if kind == "sample":
            return self.sample
        if kind == "init_penalty_row":
            return lambda state, *args: state
        raise KeyError(name)

    def sample(self, head, last_hidden, penalty_state, step_state, inputs):
        s = inputs.rows.shape[0]
        if s not in self.tokens:
            self.tokens[s] = jnp.full(s, 11, jnp.int32)
        none = jnp.zeros(inputs.settle.req_rows.shape[0], jnp.int32)
        settled = Settled(none, none, none, none)
        return SamplerOutput(self.tokens[s], None, None, None), penalty_state, step_state, settled

    def __contains__(self, name: tuple) -> bool:
        return True


def stub_runner(runner: ModelRunner, stubs: Stubs) -> None:
    if hasattr(runner, "executables"):  # an ExecutableRegistry: a subclass over the stubs
        from jaxserve.worker.executables import ExecutableRegistry

        class StubRegistry(ExecutableRegistry):
            __getitem__ = staticmethod(stubs.get)
            __contains__ = staticmethod(stubs.__contains__)

        runner.executables = StubRegistry()
    else:  # the runner before the registry: its private lookup is all there is to stub
        runner._executable = lambda *name: stubs.get(name)
        runner._compiled = stubs


def schedule(rows: int, step: int, blocks_per_req: int) -> SchedulerOutput:
    """Step 0: every request new with its whole prompt (and all its blocks); then one decode
    token each."""
    ids = [f"r{i}" for i in range(rows)]
    if step == 0:
        new = [
            NewRequestData(
                r,
                list(range(1, PROMPT + 1)),
                [],
                sampling_params(i),
                (list(range(1 + i * blocks_per_req, 1 + (i + 1) * blocks_per_req)),),
                0,
                2,
            )  # fmt: skip
            for i, r in enumerate(ids)
        ]
        return SchedulerOutput(new, [], dict.fromkeys(ids, PROMPT), rows * PROMPT, set(), set(),
                               sampled_req_ids=set(ids))  # fmt: skip
    cached = [CachedRequestData(r, (), PROMPT + step - 1) for r in ids]
    return SchedulerOutput([], cached, dict.fromkeys(ids, 1), rows, set(), set(),
                           sampled_req_ids=set(ids))  # fmt: skip


def time_rows(rows: int, iters: int, model_dir: Path) -> dict:
    max_model_len = PROMPT + 2 * iters + 8  # every timed step of both phases fits
    blocks = -(-max_model_len // BLOCK)
    args = EngineArgs(str(model_dir), load_format="dummy", dtype="float32", max_num_seqs=rows,
                      max_num_batched_tokens=rows * PROMPT, max_model_len=max_model_len,
                      block_size=BLOCK, num_gpu_blocks_override=rows * blocks + 1)  # fmt: skip
    config = args.create_engine_config()
    loaded = load_model(model_dir, dtype="float32", load_format="dummy", load_tokenizer=False)
    runner = ModelRunner(loaded, config)
    stub_runner(runner, Stubs(runner, rows))
    runner.kv_caches = (jnp.zeros(1), jnp.zeros(1))
    runner.fetch(runner.dispatch(schedule(rows, 0, blocks)))  # every request in, prefilled
    steps, dispatch = [], []
    for i in range(1, iters + 1):
        so = schedule(rows, i, blocks)
        start = time.perf_counter()
        pending = runner.dispatch(so)
        mid = time.perf_counter()
        runner.fetch(pending)
        steps.append(time.perf_counter() - start)
        dispatch.append(mid - start)
    out = dict(rows=rows, step_ms=1e3 * float(np.median(steps)),
               dispatch_ms=1e3 * float(np.median(dispatch)))  # fmt: skip
    if hasattr(runner, "builder"):  # the batch builder alone, on the same input batch
        ib, builder, builds = runner.input_batch, runner.builder, []
        for i in range(iters + 1, 2 * iters + 1):
            so = schedule(rows, i, blocks)
            start = time.perf_counter()
            ib.update(so)
            builder.build(so, ib, builder.buckets.tokens, i)
            builds.append(time.perf_counter() - start)
        out["build_ms"] = 1e3 * float(np.median(builds))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(CONFIG))
        results = [time_rows(n, args.iters, model_dir) for n in args.rows]
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; median of {args.iters} steps")
    for r in results:
        print(json.dumps(r))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
