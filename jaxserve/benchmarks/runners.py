"""The two backends a benchmark times on the same prompts: jaxserve's `LLM` and HF's
`generate`. Each has `config` (the ModelConfig, for the roofline), `generate(prompts,
output_len, n)` (blocks until every token is out), `reset_prefix_cache()` (so a repeated
prompt is prefilled in full again, as HF always does) and `close()`."""

from __future__ import annotations

import dataclasses

from jaxserve.engine.arg_utils import EngineArgs


class JaxserveRunner:
    def __init__(self, engine_args: EngineArgs):
        from jaxserve.entrypoints.llm import LLM

        self.llm = LLM(**dataclasses.asdict(engine_args))
        self.config = self.llm.llm_engine.config.model
        self.max_num_seqs = self.llm.llm_engine.config.scheduler.max_num_seqs

    def generate(self, prompts: list[list[int]], output_len: int, n: int = 1, *,
                 use_tqdm: bool = False) -> None:  # fmt: skip
        from jaxserve.sampling_params import SamplingParams

        params = SamplingParams(
            n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len
        )
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=use_tqdm)  # fmt: skip
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
        from jaxserve.models.loader import read_model_config, resolve_model_path

        a = engine_args
        self.model = load_hf_model(a.model, dtype=a.dtype, load_format=a.load_format)
        dtype = "float32" if a.dtype == "auto" else a.dtype  # what load_hf_model used
        self.config = read_model_config(resolve_model_path(a.model, a.load_format), dtype)
        self.max_num_seqs = None  # one generate batch, whatever its size

    def generate(self, prompts: list[list[int]], output_len: int, n: int = 1, *,
                 use_tqdm: bool = False) -> None:  # fmt: skip
        from jaxserve.benchmarks.hf_peer import hf_generate

        hf_generate(self.model, prompts, output_len, n)

    def reset_prefix_cache(self) -> None:
        pass  # HF keeps nothing between generate calls

    def close(self) -> None:
        del self.model


def make_runner(backend: str, engine_args: EngineArgs):
    if backend not in ("jaxserve", "hf"):
        raise ValueError(f"backend must be jaxserve or hf, got {backend!r}")
    return HFRunner(engine_args) if backend == "hf" else JaxserveRunner(engine_args)
