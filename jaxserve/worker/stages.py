"""Where a model runner's forward runs (the runner composes one `Stages`): the whole model as
one program on the runner's mesh (`OneStage`, every runner's but a pipeline's) or the decoder
layers split into stage programs on devices of their own (pipeline_stages.py).

The runner passes itself to each call (its parameters, KV caches, buckets and executables);
a `Stages` object holds no reference back to it."""

from __future__ import annotations

import functools
from typing import Any, Protocol

import jax

from jaxserve.worker.kv_cache import determine_num_blocks

# `runner` below is the ModelRunner composing the stages (not imported: it imports this module)
ModelRunner = Any


class Stages(Protocol):
    """A runner's forward programs, their KV caches and the devices they run on."""

    samples: bool  # this process runs the last stage: it samples and holds the step state
    followers_need_sampled: bool  # other processes learn the sampled tokens from rank 0's

    def place_head(self, head: jax.Array) -> jax.Array:
        """The LM head [V, D] or [D, V] on the devices that sample."""
        ...

    def kv_bytes_per_block(self, runner: ModelRunner) -> int: ...
    def determine_num_blocks(self, runner: ModelRunner) -> int: ...
    def allocate(self, runner: ModelRunner, num_blocks: int) -> Any:
        """The KV caches (runner.kv_caches)."""
        ...

    def lowerings(self, runner: ModelRunner, padding: dict) -> dict[tuple, Any]:
        """The forward step shapes' lowerings; padding: (t, decode_only) -> inputs."""
        ...

    def devices_of(self, runner: ModelRunner, name: tuple) -> list: ...
    def cache_key(self) -> dict[str, str]: ...
    def forward(self, runner: ModelRunner, batch) -> tuple:
        """The step's forward: (last_hidden [R, D], hidden [T, D], *EAGLE-3 features), the
        runner's KV caches updated; (None, None) where this process does not sample."""
        ...

    def dummy_step(self, runner: ModelRunner) -> None: ...


class OneStage:
    """The model as one program over the runner's mesh."""

    samples = True
    followers_need_sampled = False

    def place_head(self, head: jax.Array) -> jax.Array:
        return head

    def kv_bytes_per_block(self, runner: ModelRunner) -> int:
        return runner.kv.bytes_per_block()

    def determine_num_blocks(self, runner: ModelRunner) -> int:
        """Blocks that fit the budget (per device: this process's), after weights and compiled
        steps."""
        return determine_num_blocks(
            runner.engine_config.cache,
            runner.mesh.local_devices[0],
            runner.kv_bytes_per_block(),
            runner.max_blocks_per_req * len(runner.input_batch.block_table) + 1,  # every group
            runner.max_model_len,
            runner.kv.state_bytes(),
        )

    def allocate(self, runner: ModelRunner, num_blocks: int) -> tuple[jax.Array, ...]:
        return runner.kv.allocate(num_blocks)

    def lowerings(self, runner: ModelRunner, padding: dict) -> dict[tuple, Any]:
        kv, last = shapes(runner.kv_caches), shapes(runner.step_state)
        lower = runner._jits["forward"].lower
        return {
            ("forward", t, decode_only): functools.partial(lower, runner.params, kv, last, inputs)
            for (t, decode_only), inputs in padding.items()
        }

    def devices_of(self, runner: ModelRunner, name: tuple) -> list:
        return list(runner.mesh.devices.flat)

    def cache_key(self) -> dict[str, str]:
        return {}

    def forward(self, runner: ModelRunner, batch) -> tuple:
        outs = runner.executables["forward", batch.num_tokens, batch.forward.attn.decode_only](
            runner.params, runner.kv_caches, runner.step_state, batch.forward
        )
        runner.kv_caches = outs[2]
        return (*outs[:2], *outs[3:])

    def dummy_step(self, runner: ModelRunner) -> None:
        """The smallest forward over padding (no KV written, nothing sampled), run to its
        end."""
        t, decode_only = runner.ready_token_buckets()[0], runner.decode_only_forwards
        outs = runner.executables["forward", t, decode_only](
            runner.params, runner.kv_caches, runner.step_state, runner._padding(t, decode_only)
        )
        runner.kv_caches = outs[2]
        jax.block_until_ready(outs[0])


def shapes(tree):
    """`tree`'s arrays as shapes (what a lowering captures instead of donated arrays)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
