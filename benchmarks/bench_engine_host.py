"""The engine's host time per decode step at large batch, by phase, with no model: the engine
core over the simulated runner (worker/simulated.py, a 0 ms device step that samples random
tokens) in this process, so every phase can be timed on its own:

- schedule: `Scheduler.schedule` (running requests' next slots, the step's SchedulerOutput);
- update: `Scheduler.update_from_output` (append tokens, stop checks, block hashes, frees);
- serialize: the EngineCoreOutputs encoded and decoded as the ZeroMQ path does (msgpack);
- frontend: `OutputProcessor.process_outputs` (detokenize, RequestOutputs).

Every request decodes `--output-len` tokens after a `--input-len` prompt, all admitted at
once (max_num_seqs = rows), with `ignore_eos` so the batch stays full; the figures are the
mean per step over the decode steps (the steps that admit prompts are left out), in this
thread's CPU time (`time.thread_time`: what other processes on the machine take is not in it;
the wall-clock figure is printed beside it).

    .venv/bin/python benchmarks/bench_engine_host.py --rows 256 512
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

os.environ.setdefault("JAXSERVE_SIMULATED_STEP", "0,0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def run(rows: int, input_len: int, output_len: int) -> dict[str, float]:
    from jaxserve.engine.arg_utils import EngineArgs
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.ipc.messages import EngineCoreOutputs
    from jaxserve.ipc.serialization import MsgpackDecoder, MsgpackEncoder
    from jaxserve.sampling_params import RequestOutputKind, SamplingParams

    args = EngineArgs(
        model="llama-3-8b", load_format="dummy", max_num_seqs=rows,
        max_model_len=input_len + output_len + 16, max_num_batched_tokens=rows * input_len,
    )  # fmt: skip
    engine = LLMEngine.from_engine_args(args, multiprocess=False)
    core = engine.engine_core.engine_core
    scheduler, processor = core.scheduler, engine.output_processor
    totals: dict[str, float] = defaultdict(float)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                totals[name] += time.thread_time() - t0

        return wrapper

    scheduler.schedule = timed("schedule", scheduler.schedule)
    scheduler.update_from_output = timed("update", scheduler.update_from_output)
    processor.process_outputs = timed("frontend", processor.process_outputs)
    params = SamplingParams(
        max_tokens=output_len, ignore_eos=True, temperature=0.0,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )  # fmt: skip
    vocab = engine.config.model.vocab_size
    for i in range(rows):
        ids = [(i * 7919 + j * 31) % (vocab - 10) + 5 for j in range(input_len)]
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    steps = 0
    while engine.has_unfinished_requests():
        outs = core.step()
        if outs is None:
            continue
        t0 = time.thread_time()
        outs = decoder.decode([bytes(f) for f in encoder.encode(outs)])
        totals["serialize"] += time.thread_time() - t0
        if steps == 1:  # the prompts' steps are done: start counting
            totals.clear()
            start, cpu_start = time.perf_counter(), time.thread_time()
        engine.output_processor.process_outputs(outs.outputs)
        steps += 1
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
    counted = steps - 2
    engine.shutdown()
    result = {k: 1e3 * v / counted for k, v in totals.items()}
    result["total"] = 1e3 * cpu / counted
    result["wall"] = 1e3 * wall / counted
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    results = {}
    for rows in args.rows:
        r = run(rows, args.input_len, args.output_len)
        results[rows] = r
        phases = ", ".join(f"{k} {v:.3f}" for k, v in r.items() if k not in ("total", "wall"))
        print(f"{rows} rows: {r['total']:.3f} ms of CPU a step ({phases}); {r['wall']:.3f} ms wall")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
