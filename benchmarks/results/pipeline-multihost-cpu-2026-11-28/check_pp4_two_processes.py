"""-pp 4 (tp 1) over two processes, two stages each (a device_put within a process, a link
between them), against one process: greedy tokens and logprobs. Run from the repository root
(README.md beside this file has the command)."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, ".")
from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.entrypoints.openai.test_api_server import free_ports  # noqa: E402
from tests.helpers import make_tiny_hf  # noqa: E402

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
              num_gpu_blocks_override=64)  # fmt: skip
PROMPTS = [{"prompt_token_ids": [1 + i, 2, 3 + 2 * i, 4, 5]} for i in range(8)]


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    model = str(make_tiny_hf("llama", tmp, num_hidden_layers=6, tie_word_embeddings=True))
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, ignore_eos=True)
    one = LLM(model, **ENGINE)
    want = one.generate(PROMPTS, params, use_tqdm=False)
    one.llm_engine.shutdown()
    port = free_ports(3)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    with open(os.devnull, "w") as log:
        follower = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", model, "--headless",
             "--nnodes", "2", "--node-rank", "1", "--master-port", str(port), "-pp", "4",
             *flags],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        llm = LLM(model, nnodes=2, master_port=port, pipeline_parallel_size=4, **ENGINE)
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        llm.llm_engine.shutdown()
        print("follower exit", follower.wait(30))
    pairs = [(a.outputs[0], b.outputs[0]) for a, b in zip(got, want, strict=True)]
    same = all(a.token_ids == b.token_ids for a, b in pairs)
    diff = max(
        abs(x[t].logprob - y[t].logprob)
        for a, b in pairs
        for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids, strict=True)
    )
    print(f"8 prompts x 24 tokens: same greedy tokens: {same}; max |logprob diff|: {diff:.2e}")


if __name__ == "__main__":
    main()
