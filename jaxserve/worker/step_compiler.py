"""Lifecycle step 7's start-up, after KV cache sizing: every step shape of a model runner
lowered at the buckets (buckets.py) from the pure step functions (step_functions.py), then
compiled or loaded (executables.py) under a key of what the executables depend on; serving
calls only these executables, a step padding to the next ready token bucket while the rest
compile in the background."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxserve import cache_keys
from jaxserve.layers.sampler import COMPILED_VARIANTS, FULL_VARIANT
from jaxserve.worker import executable_cache, fused_sampling
from jaxserve.worker.stages import shapes
from jaxserve.worker.step_feature import LoweringInputs
from jaxserve.worker.step_state import Settled

# The executables compiled per token bucket (name[1]): a step of T tokens runs them at T's.
TOKEN_BUCKET_STEPS = ("forward", "prompt_logprobs", "pool")


class StepCompiler:
    """ModelRunner's step shapes (a base of it: it reads the runner's buckets, builder,
    parameters, caches, step functions and optional parts, set by ModelRunner.__init__)."""

    def compile_all(self, background: bool = False) -> None:
        """Every step shape's executable, so no serving step ever compiles (executables.py).

        background: return once the shapes that can serve any step are ready (the forward and
        prompt logprobs of token buckets 1, 4, 16, .. and max_num_seqs', all-greedy and
        all-pass sampling, drafts); the rest follow in a background thread, each used as soon
        as it is ready (a step pads to the next ready token bucket, `max_step_tokens` grows
        with the larger buckets, `pick_variant` takes the cheapest ready sampler)."""
        top = self.buckets.tokens[-1] + 1
        lowerings = self.lowerings()
        if self.minimal_compile:  # coarse buckets (self.buckets); of the samplers, two
            lowerings = {
                n: f for n, f in lowerings.items() if n[0] != "sample" or self._serves_any_step(n)
            }
        self.executables.compile_all(
            lowerings,
            self.executables_key(),
            self.devices_of,
            urgent=self._serves_any_step if background else None,
            order=lambda n: n[1] if n[0] in TOKEN_BUCKET_STEPS else top,
        )

    def devices_of(self, name: tuple) -> list:
        """The devices step shape `name` runs on (a pipeline's differ by stage)."""
        return self.stages.devices_of(self, name)

    def _serves_any_step(self, name: tuple) -> bool:
        """Whether step shape `name` is among those compile_all(background=True) waits for."""
        if name[0] in TOKEN_BUCKET_STEPS:  # 1, 4, 16, .. and max_num_seqs' bucket: a step
            # pads to the next of these until the buckets between are in
            top, t = self.buckets.decode_top, name[1]
            drafting = self.proposer.num_speculative_tokens > 0
            return drafting or t == top or (t < top and t.bit_length() % 2 == 1)
        if name[0] == "sample":
            return name[2] in (COMPILED_VARIANTS[0], FULL_VARIANT)
        return name[0] != fused_sampling.NAME  # a step runs without its fused executable

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for compile_all's background shapes; whether all are ready."""
        return self.executables.wait(timeout)

    def ready_token_buckets(self) -> list[int]:
        """The token buckets whose steps are all ready (all once compile_all is done)."""
        if not self.executables.compiling:
            return list(self.buckets.tokens)
        missing = {n[1] for n in self.executables.missing() if n[0] in TOKEN_BUCKET_STEPS}
        return [t for t in self.buckets.tokens if t not in missing]

    def max_step_tokens(self) -> int:
        """The most tokens one step can schedule now: the largest ready token bucket."""
        return self.ready_token_buckets()[-1]

    def executables_key(self) -> str:
        """What the step executables depend on beyond the environment: the configuration
        (engine, model, proposer) and the layout of every argument array."""
        proposer = self.proposer
        return executable_cache.signature(
            engine=repr(self.engine_config),
            model_files=cache_keys.file_stats(self.engine_config.model_path),
            model=repr(self.config),
            params=executable_cache.abstract((self.params, self.head, self.kv_caches)),
            state=executable_cache.abstract((self.penalty_state, self.step_state)),
            param_tree=str(self.model_def.params_def),
            draft=executable_cache.abstract(
                [getattr(proposer, a, None) for a in ("params", "kv_caches", "embedding")]
            ),
            draft_model=repr(getattr(proposer, "config", None)),
            mesh=repr(self.mesh),
            **({"compile_set": "minimal"} if self.minimal_compile else {}),
            **({"fused_sampling": repr(self.fused.shapes)} if self.fused else {}),
            **{k: v for feature in self.features for k, v in feature.cache_key().items()},
            **self.stages.cache_key(),
        )

    def lowerings(self) -> dict[tuple, Callable[[], Any]]:
        """Every step shape's name -> a function lowering it (called in compile_all's
        background thread too: the donated state is captured as shapes, not arrays)."""
        rep, d, dtype = self._replicated, self.config.hidden_size, self.config.dtype
        padding = {v: self._padding(*v, spec=True) for v in self.forward_variants()}
        out = self.stages.lowerings(self, padding)  # the forwards (a pipeline's per stage)
        if not self.samples:
            return out
        kv, penalty = shapes(self.kv_caches), shapes(self.penalty_state)
        last = shapes(self.step_state)
        last_hidden = jax.ShapeDtypeStruct((self.buckets.max_sample_rows, d), dtype, sharding=rep)
        jits = self._jits
        hidden = lambda t: jax.ShapeDtypeStruct((t, d), dtype, sharding=rep)  # noqa: E731
        for t in self.buckets.tokens:
            out["prompt_logprobs", t] = functools.partial(
                jits["prompt_logprobs"].lower, self.head, hidden(t), np.full(t, -1, np.int32)
            )
        for s in self.buckets.samples:
            inputs = self.builder.padding_sample(s, self.input_batch.sampling)
            for variant in COMPILED_VARIANTS:
                out["sample", s, variant] = functools.partial(
                    jits["sample"].lower,
                    self.head,
                    last_hidden,
                    penalty,
                    last,
                    inputs,
                    variant=variant,
                )
        for name in self.fused.names() if self.fused else ():
            _, t, decode_only, variant = name
            s = self.fused.shapes[t, decode_only]
            out[name] = functools.partial(
                jits["forward_sample"].lower,
                self.params,
                kv,
                last,
                padding[t, decode_only],
                self.head,
                penalty,
                self.builder.padding_sample(s, self.input_batch.sampling),
                variant=variant,
            )
        q = jax.ShapeDtypeStruct((self.buckets.seqs[-1],), np.int32, sharding=rep)
        out.update(
            self.proposer.lowerings(
                padding, list(self.buckets.seqs), self.max_blocks_per_req, last, Settled(q, q, q, q)
            )
        )
        lowering = LoweringInputs(
            self.params, self.model_def, kv, tuple(self.buckets.tokens), hidden
        )
        for feature in self.features:
            out.update(feature.lowerings(lowering))
        zero = np.int32(0)
        out["init_penalty_row",] = functools.partial(
            jits["init_penalty_row"].lower,
            penalty,
            zero,
            np.zeros(self.max_model_len, np.int32),
            zero,
            zero,
        )
        return out

    def forward_variants(self) -> list[tuple[int, bool]]:
        """(token bucket, decode_only) of every forward (BucketTable.forward_variants)."""
        return self.buckets.forward_variants(self.decode_only_forwards)

    def _padding(self, t: int, decode_only: bool, spec: bool = False):
        """Forward inputs of bucket t that run nothing (with the features' fields)."""
        inputs = self.builder.padding_forward(t, decode_only)
        for feature in self.features:
            inputs = feature.forward_inputs(inputs, None, None, spec=spec)
        return inputs
