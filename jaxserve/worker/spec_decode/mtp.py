"""MTP drafting (speculative method `mtp`): the target's own multi-token-prediction layer
(DeepSeek-V3, GLM-4.5; models/mtp.py) drafts from the target's hidden states.

It is EAGLE-1's drafting (spec_decode/eagle.py) with the MTP head in place of an EAGLE head:
the head's cache entry at position p pairs the embedding of x_{p+1} with the target's final
hidden state at p, every target forward is mirrored into it, and after verification the one
MTP layer runs k one-token steps, each feeding back its own output (as vLLM reuses its one
layer k times); drafts are the argmax of the target's LM head on shared_head.norm of it.
What differs is the cache: one layer of the target's kind (MLA's latent cache for DeepSeek,
its V empty), in the target's block layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.worker.spec_decode.eagle import EagleProposer


class MtpProposer(EagleProposer):
    """head: the loaded MTP head (LoadedModel of models/mtp.py's MtpHead); the rest as
    EagleProposer's."""

    def kv_bytes_per_block(self, block_size: int) -> int:
        c = self.config
        kv_heads = self.num_cache_kv_heads // self.mesh.shape["tp"]
        return block_size * kv_heads * sum(c.cache_dims) * jnp.dtype(c.dtype).itemsize

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """K and V of its one layer (cache_dims: MLA's V has no values)."""
        c = self.config
        rows = (num_blocks, block_size, self.num_cache_kv_heads)

        def zeros(dim: int) -> jax.Array:
            make = jax.jit(
                lambda: jnp.zeros((*rows, dim), c.dtype), out_shardings=self._kv_sharding
            )
            return make()

        self.kv_caches = tuple(zeros(dim) for dim in c.cache_dims)
