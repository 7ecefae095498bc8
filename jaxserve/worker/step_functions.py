"""The pure functions a step runs on the devices, each jitted and compiled per bucket at
start-up (worker/executables.py): the forward, the sampling (LM head + sampler), the two as
one program (a decode step's, worker/fused_sampling.py), prompt logprobs, and filling one
row's penalty state (a feature's own are in its module:
worker/step_feature.py). Nothing here touches the host.

Shapes: T tokens (the token bucket), R sampling rows the forward returns (max_sample_rows),
S sampling rows of a step (the sample bucket), D hidden size, V vocabulary, K logprobs, k
draft tokens, N input-batch rows (max_num_seqs).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxserve.layers.sampler import SamplerVariant, compute_prompt_logprobs, sample
from jaxserve.models.llama import lm_logits
from jaxserve.worker.step_state import resolve, settle
from jaxserve.worker.step_types import ForwardInputs, SampleInputs

PROMPT_LOGPROBS_CHUNK = 256  # positions whose [chunk, V] logits are live at once


class ModelDef(NamedTuple):
    """How to rebuild the model from its flat parameter list (static in every step)."""

    graphdef: Any
    params_def: Any  # the treedef of nnx.split's state
    aux_layers: tuple[int, ...] = ()  # an EAGLE-3 head's feature: these layers' inputs too

    def merge(self, params: list[jax.Array]) -> nnx.Module:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.params_def, params))


class HeadDef(NamedTuple):
    """The LM head's static options (the head array itself is an argument)."""

    tied: bool  # the head is the [V, D] embedding (else a [D, V] kernel)
    soft_cap: float | None  # Gemma 2's final logit soft cap


def forward(
    model_def: ModelDef, block_size: int, params, kv_caches, step_state, inputs: ForwardInputs
):
    """The model over T tokens. step_state: i32[N, k + 3] (worker/step_state.py: what a
    placeholder token reads). Returns (hidden [R, D] of each sampling row, hidden [T, D] of
    every token, kv_caches with this step's K/V written) and, with aux_layers, each token's
    and sampling row's EAGLE-3 features ([T, F], [R, F])."""
    model = model_def.merge(params)
    rows = inputs.logits_indices
    inputs = resolve(inputs, step_state, block_size)
    out = model(inputs, kv_caches, model_def.aux_layers)
    if model_def.aux_layers:
        hidden, kv_caches, aux = out
        return hidden[rows], hidden, kv_caches, aux, aux[rows]
    hidden, kv_caches = out
    return hidden[rows], hidden, kv_caches


def sample_rows(
    head_def: HeadDef,
    base_key,
    num_logprobs: int,
    head,
    last_hidden,
    penalty_state,
    step_state,
    inputs: SampleInputs,
    *,
    variant: SamplerVariant,
):
    """LM head and sampling for the first S rows of last_hidden [R, D]; penalty_state:
    (prompt_mask bool[N, V], output_counts i32[N, V]). Returns (SamplerOutput [S],
    penalty_state with this step's kept tokens counted, step_state with its outcome, the
    outcome: Settled, worker/step_state.py)."""
    s = inputs.rows.shape[0]
    logits = lm_logits(last_hidden[:s], head, tied=head_def.tied, soft_cap=head_def.soft_cap)
    sampling = inputs.sampling
    prompt_mask, output_counts = penalty_state
    if variant.penalties:
        counts = output_counts[inputs.rows]
        if inputs.prior_drafts.shape[1]:  # a draft row's earlier drafts count as output
            vocab = counts.shape[1]
            prior = jnp.where(inputs.prior_drafts >= 0, inputs.prior_drafts, vocab)
            counts = counts.at[jnp.arange(s)[:, None], prior].add(1, mode="drop")
        sampling = sampling._replace(prompt_mask=prompt_mask[inputs.rows], output_counts=counts)
    key = jax.random.fold_in(base_key, inputs.step)
    sampled = sample(
        logits,
        sampling,
        key,
        num_logprobs=num_logprobs,
        variant=variant,
        want_logprobs=inputs.want_logprobs,
    )
    if variant.penalties:
        output_counts = output_counts.at[inputs.rows, sampled.token_ids].add(
            inputs.appends.astype(jnp.int32)
        )
    step_state, settled = settle(step_state, sampled.token_ids, inputs.settle)
    return sampled, (prompt_mask, output_counts), step_state, settled


def forward_sample(
    model_def: ModelDef,
    block_size: int,
    head_def: HeadDef,
    base_key,
    num_logprobs: int,
    params,
    kv_caches,
    step_state,
    inputs: ForwardInputs,
    head,
    penalty_state,
    sample_inputs: SampleInputs,
    *,
    variant: SamplerVariant,
):
    """`forward` and `sample_rows` as one program (a decode step with no grammar bitmask: one
    executable, no device idle between them). Returns (hidden [T, D], kv_caches, then
    sample_rows' four outputs); the sampler reads the forward's step state, as the two
    programs in turn would."""
    last_hidden, hidden, kv_caches = forward(
        model_def, block_size, params, kv_caches, step_state, inputs
    )
    sampled = sample_rows(
        head_def,
        base_key,
        num_logprobs,
        head,
        last_hidden,
        penalty_state,
        step_state,
        sample_inputs,
        variant=variant,
    )
    return hidden, kv_caches, *sampled


def prompt_logprobs(head_def: HeadDef, num_logprobs: int, head, hidden, targets):
    """Logprob (and top-K) of the next prompt token at every position: hidden [T, D],
    targets i32[T] (-1: none) -> ([T, K+1] logprobs, [T, K+1] token ids, [T] ranks).

    Logits are computed PROMPT_LOGPROBS_CHUNK rows at a time: [T, V] at once would be
    gigabytes for an 8k-token step with a 128k vocabulary."""
    t = hidden.shape[0]
    chunk = min(t, PROMPT_LOGPROBS_CHUNK)
    padded = -(-t // chunk) * chunk
    h = jnp.pad(hidden, ((0, padded - t), (0, 0))).reshape(padded // chunk, chunk, -1)
    ids = jnp.pad(jnp.maximum(targets, 0), (0, padded - t)).reshape(-1, chunk)
    out = lax.map(
        lambda x: compute_prompt_logprobs(
            lm_logits(x[0], head, tied=head_def.tied, soft_cap=head_def.soft_cap),
            x[1],
            num_logprobs=num_logprobs,
        ),
        (h, ids),
    )
    return jax.tree.map(lambda a: a.reshape(padded, *a.shape[2:])[:t], out)


def init_penalty_row(penalty_state, row, token_ids, num_prompt, num_tokens):
    """Fill one row's penalty state from its tokens: i32[max_model_len], the first num_prompt
    the prompt, up to num_tokens its output so far (a request resumed after preemption)."""
    prompt_mask, output_counts = penalty_state
    vocab = prompt_mask.shape[1]
    idx = jnp.arange(token_ids.shape[0])
    in_prompt = jnp.where(idx < num_prompt, token_ids, vocab)  # vocab: dropped
    in_output = jnp.where((idx >= num_prompt) & (idx < num_tokens), token_ids, vocab)
    mask = jnp.zeros(vocab, bool).at[in_prompt].set(True, mode="drop")
    counts = jnp.zeros(vocab, jnp.int32).at[in_output].add(1, mode="drop")
    return prompt_mask.at[row].set(mask), output_counts.at[row].set(counts)


def jit_steps(
    model_def: ModelDef,
    head_def: HeadDef,
    base_key,
    num_logprobs: int,
    kv_sharding,
    replicated,
    block_size: int,
) -> dict[str, Any]:
    """Each step function jitted for one runner: its static parts bound, the KV cache and the
    state a step updates donated, outputs replicated (the KV cache in kv_sharding)."""
    rep = replicated
    outs = (rep, rep, kv_sharding) + (rep, rep) * bool(model_def.aux_layers)
    return {
        "forward": jax.jit(
            functools.partial(forward, model_def, block_size),
            donate_argnums=(1,),
            out_shardings=outs,
        ),
        "sample": jax.jit(
            functools.partial(sample_rows, head_def, base_key, num_logprobs),
            static_argnames=("variant",),
            donate_argnums=(2, 3),
            out_shardings=rep,
        ),
        "forward_sample": jax.jit(
            functools.partial(
                forward_sample, model_def, block_size, head_def, base_key, num_logprobs
            ),
            static_argnames=("variant",),
            donate_argnums=(1, 2, 5),  # the KV cache, the step state, the penalty state
            out_shardings=(rep, kv_sharding, rep, rep, rep, rep),
        ),
        "prompt_logprobs": jax.jit(
            functools.partial(prompt_logprobs, head_def, num_logprobs), out_shardings=rep
        ),
        "init_penalty_row": jax.jit(init_penalty_row, donate_argnums=(0,), out_shardings=rep),
    }
