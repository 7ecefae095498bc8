"""Pipeline layouts over several processes against one process (seeded sampling: tokens and
logprobs). Run from the repository root; README.md beside this file has the commands.

  pp4-nnodes2       -pp 4 over 2 processes: two stages a process (a device_put within a
                    process, a StageLink between them); 4 CPU devices a process
  tp2-pp2-nnodes4   -tp 2 -pp 2 over 4 processes: each stage spans two processes (the last
                    one's sampler on ranks 0 and 1); 1 CPU device a process
"""

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
LAYOUTS = {  # name: (nnodes, parallel sizes, model layers)
    "pp4-nnodes2": (2, {"pipeline_parallel_size": 4}, 6),
    "tp2-pp2-nnodes4": (4, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 3),
}


def main(layout: str) -> None:
    nnodes, parallel, layers = LAYOUTS[layout]
    model = str(make_tiny_hf("llama", Path(tempfile.mkdtemp()), num_hidden_layers=layers,
                             tie_word_embeddings=True))  # fmt: skip
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, logprobs=1,
                            presence_penalty=0.5, ignore_eos=True)  # fmt: skip
    one = LLM(model, **ENGINE)
    want = one.generate(PROMPTS, params, use_tqdm=False)
    one.llm_engine.shutdown()
    port = free_ports(3)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**ENGINE, **parallel}.items()]
    with open(os.devnull, "w") as log:
        followers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jaxserve.entrypoints.cli",
                    "serve",
                    model,
                    "--headless",
                    "--nnodes",
                    str(nnodes),
                    "--node-rank",
                    str(rank),
                    "--master-port",
                    str(port),
                    *flags,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            for rank in range(1, nnodes)
        ]
        llm = LLM(model, nnodes=nnodes, master_port=port, **parallel, **ENGINE)
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        llm.llm_engine.shutdown()
        print("followers exit", [f.wait(60) for f in followers])
    pairs = [(a.outputs[0], b.outputs[0]) for a, b in zip(got, want, strict=True)]
    same = all(a.token_ids == b.token_ids for a, b in pairs)
    diff = max(
        abs(x[t].logprob - y[t].logprob)
        for a, b in pairs
        for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids, strict=True)
    )
    print(f"{layout}: 8 prompts x 24 seeded tokens: same tokens: {same}; "
          f"max |logprob diff|: {diff:.2e}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
