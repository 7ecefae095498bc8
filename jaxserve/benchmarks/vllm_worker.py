"""vLLM's `LLM` behind a line protocol, run by the Python of vLLM's own venv (it does not import
jaxserve): the peer of `--backend vllm` in the benchmark scripts (`runners.VLLMRunner`).

    <vllm venv>/bin/python vllm_worker.py '<json engine kwargs>'

Replies one JSON line to each JSON request line on stdin:
    {"op": "generate", "prompts": [[ids...], ...], "output_len": N, "n": 1}  -> {"tokens": T}
    {"op": "reset_prefix_cache"}                                            -> {"ok": true}
The first line it writes is {"ready": true, "vllm": "<version>"} once the engine is up; vLLM's
own logs go to stderr. Sampling is bench_latency's: temperature 1, top_p 1, ignore_eos.
"""

import json
import os
import sys


def main() -> None:
    # Replies go to the original stdout; everything else written to fd 1 (vLLM logs there,
    # and so may its workers) goes to stderr.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(**json.loads(sys.argv[1]))
    print(json.dumps({"ready": True, "vllm": vllm.__version__}), file=reply, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "generate":
            params = SamplingParams(
                n=request.get("n", 1),
                temperature=1.0,
                top_p=1.0,
                ignore_eos=True,
                max_tokens=request["output_len"],
            )
            prompts = [{"prompt_token_ids": p} for p in request["prompts"]]
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            print(json.dumps({"tokens": tokens}), file=reply, flush=True)
        elif request["op"] == "reset_prefix_cache":
            print(json.dumps({"ok": bool(llm.reset_prefix_cache())}), file=reply, flush=True)
        else:
            print(json.dumps({"error": f"unknown op {request['op']!r}"}), file=reply, flush=True)


if __name__ == "__main__":
    main()
