"""A multimodal model's images on the device: the encoder cache and the image encoder's
compiled steps (part of lifecycle steps 6 and 7).

The encoder cache is one buffer [C, D] (C rows of the language model's hidden size); the
scheduler's `core/encoder_cache_manager.py` says which rows hold which image. A step first
runs the encoder for the images the scheduler listed (`SchedulerOutput.
scheduled_encoder_inputs`): one compiled `encode` per image bucket (the model's
`encoder_buckets`: a fixed image size is one bucket, Qwen2.5-VL's dynamic sizes are padded
patch counts), which writes the image's rows in place (the buffer donated). The forward then
reads, for each token, the cache row its placeholder takes (`ForwardInputs.mm_rows`, -1 for
text) instead of its embedding. Per input-batch row this keeps each position's cache row
(`mm_map`), for M-RoPE models (Qwen2.5-VL) each position's three rotary positions, and for
bidirectional images (Gemma 3) each image token's last image position, from which the
attention's `causal_ext` lets the token see the rest of its image.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.distributed.sharding import put
from jaxserve.multimodal.inputs import MultiModalFeature
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.step_feature import LoweringInputs, StepFeature
from jaxserve.worker.step_types import ForwardInputs, StepBatch


def encode(model_def, params, buffer: jax.Array, inputs: dict, rows: jax.Array) -> jax.Array:
    """The image encoder over one padded image; its output rows written at `rows` of the
    encoder cache buffer [C, D] (rows i32[n]: C for padding, dropped)."""
    out = model_def.merge(params).encode(**inputs)  # [n, D]
    return buffer.at[rows].set(out.astype(buffer.dtype), mode="drop")


class EncoderRunner(StepFeature):
    name = "encoder"

    def __init__(
        self,
        model: Any,
        max_num_batched_tokens: int,
        max_num_reqs: int,
        max_model_len: int,
        mesh,
        model_dir: str | None = None,
    ):
        """model: a multimodal model (its `encode`, `encoder_buckets`, `encoder_inputs`,
        `mrope_positions` for M-RoPE); the cache holds max(max_num_batched_tokens, the
        largest image's tokens) rows, as vLLM's encoder cache. model_dir: where the image
        processor's config says how large an image it makes (`image_token_cap`: Qwen2.5-VL's
        max_pixels), so no larger shape is compiled."""
        self.model_cls = type(model)
        self.mm_config = model.config.hf_config.multimodal_config
        tokens = max_num_batched_tokens  # an image's tokens run in the steps after it
        cap = getattr(self.model_cls, "image_token_cap", None)
        if cap is not None and model_dir is not None:  # no shape past the processor's largest
            tokens = min(tokens, cap(_preprocessor_config(model_dir)) or tokens)
        self.buckets = self.model_cls.encoder_buckets(self.mm_config, tokens)
        self.bidirectional = bool(getattr(model, "bidirectional_images", False))
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        width = model.config.hidden_size * (1 + model.deepstack_layers)  # (DeepStack's too)
        self._allocate(
            model.config, max_num_batched_tokens, max_num_reqs, max_model_len, mesh, width
        )

    def _allocate(
        self,
        config,
        max_num_batched_tokens: int,
        max_num_reqs: int,
        max_model_len: int,
        mesh,
        width: int | None = None,
    ) -> None:
        """The cache buffer [C, width] (default: the hidden size D; Qwen3-VL's rows hold its
        DeepStack features after the embedding) and the per-row maps, once `buckets` is set."""
        self.max_image_tokens = max(tokens for tokens, _ in self.buckets.values())
        self.num_rows = max(max_num_batched_tokens, self.max_image_tokens)
        self.budget = self.num_rows
        self.max_step_tokens = max_num_batched_tokens
        rep = NamedSharding(mesh, P())
        d, dtype = width or config.hidden_size, config.dtype
        self.buffer = put(np.zeros((self.num_rows, d), dtype), rep)
        self._buffer_spec = jax.ShapeDtypeStruct((self.num_rows, d), dtype, sharding=rep)
        self.features: dict[str, list[MultiModalFeature]] = {}
        self.mm_map = np.full((max_num_reqs, max_model_len), -1, np.int32)
        self.mrope = (
            np.zeros((max_num_reqs, 3, max_model_len), np.int32) if self.uses_mrope else None
        )
        # Bidirectional images: each position's image's last position (-1: text)
        self.image_last = np.full((max_num_reqs, max_model_len), -1, np.int32)
        self._arange = np.arange(max_model_len, dtype=np.int32)
        self._rep = rep

    def jit(self, model_def) -> Callable:
        return jax.jit(
            functools.partial(encode, model_def), donate_argnums=(1,), out_shardings=self._rep
        )

    def lowerings(self, inputs: LoweringInputs) -> dict[tuple, Callable[[], Any]]:
        """("encode", bucket) -> its lowering, for every image bucket."""
        jitted, params = self.jit(inputs.model_def), inputs.params
        return {
            ("encode", name): functools.partial(
                jitted.lower, params, self._buffer_spec, data, np.zeros(tokens, np.int32)
            )
            for name, (tokens, data) in self.buckets.items()
        }

    def check(self, feature: MultiModalFeature) -> None:
        """ValueError when the image cannot be served (no bucket holds it)."""
        self.model_cls.encoder_bucket(self.mm_config, feature.data, self.buckets)

    def check_images(self, features: list[MultiModalFeature]) -> None:
        """ValueError for images this runner cannot serve: no compiled shape holds one, or
        more image tokens than the encoder cache or one step holds."""
        for f in features:
            self.check(f)
            if f.length > self.budget:
                raise ValueError(
                    f"an image of {f.length} tokens exceeds the encoder cache ({self.budget})"
                )
            if self.bidirectional and f.length > self.max_step_tokens:
                raise ValueError(
                    f"an image of {f.length} tokens must run in one step, but a step runs at "
                    f"most max_num_batched_tokens={self.max_step_tokens} tokens"
                )

    # ------------------------------------------------------------------ a serving step
    def prepare(self, so: SchedulerOutput, ib: InputBatch, params, executables) -> None:
        """The step's images: remembered, pointed at, and run through the encoder."""
        self.update(so, ib)
        self.run(so, params, executables)

    def update(self, so: SchedulerOutput, ib: InputBatch) -> None:
        """After `ib.update(so)`: remember the new requests' images (and fill their M-RoPE
        positions), and point each scheduled placeholder token at its cache row."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.features.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            row = ib.req_id_to_row[new.req_id]
            self.features[new.req_id] = new.mm_features
            self.mm_map[row] = -1
            if self.bidirectional:
                self.image_last[row] = -1
                for f in new.mm_features:
                    self.image_last[row, f.offset : f.end] = f.end - 1
            if self.mrope is not None:
                pos, delta = self.model_cls.mrope_positions(
                    self.mm_config, new.prompt_token_ids, new.mm_features
                )
                n = pos.shape[1]
                self.mrope[row, :, :n] = pos
                self.mrope[row, :, n:] = self._arange[n:] + delta
        if not so.encoder_rows:
            return
        for req_id in so.num_scheduled_tokens:
            for f in self.features.get(req_id, ()):
                rows = so.encoder_rows.get(f.identifier)
                if rows is not None:
                    self.mm_map[ib.req_id_to_row[req_id], f.offset : f.end] = rows

    def run(self, so: SchedulerOutput, params, executables) -> None:
        """The step's scheduled images through the encoder, into the cache."""
        for req_id, indices in so.scheduled_encoder_inputs.items():
            for i in indices:
                f = self.features[req_id][i]
                name, inputs = self.model_cls.encoder_inputs(self.mm_config, f.data, self.buckets)
                tokens = self.buckets[name][0]
                rows = np.full(tokens, self.num_rows, np.int32)
                rows[: f.length] = so.encoder_rows[f.identifier]
                self.buffer = executables["encode", name](params, self.buffer, inputs, rows)

    def forward_inputs(
        self,
        forward: ForwardInputs,
        batch: StepBatch | None,
        ib: InputBatch | None = None,
        *,
        spec: bool = False,
    ) -> ForwardInputs:
        """`forward` with each token's cache row and the buffer (and its M-RoPE positions);
        batch None: padding; spec: the buffer's shape alone (what start-up lowers with)."""
        t = forward.input_ids.shape[0]
        mm_rows = np.full(t, -1, np.int32)
        mrope = None if self.mrope is None else np.zeros((3, t), np.int32)
        ext = np.zeros(t, np.int32) if self.bidirectional else None
        if batch is not None:
            n = int(batch.num_scheduled.sum())
            row_of_token = np.repeat(batch.rows, batch.num_scheduled)
            pos = forward.positions[:n]
            mm_rows[:n] = self.mm_map[row_of_token, pos]
            if mrope is not None:
                mrope[:, :n] = self.mrope[row_of_token, :, pos].T
            if ext is not None:
                last = self.image_last[row_of_token, pos]
                ext[:n] = np.where(last >= 0, last - pos, 0)
        buffer = self._buffer_spec if spec else self.buffer
        attn = forward.attn if ext is None else forward.attn._replace(causal_ext=ext)
        return forward._replace(attn=attn, mm_rows=mm_rows, mm_embeds=buffer, mrope_positions=mrope)


def _preprocessor_config(model_dir: str) -> dict:
    """The model's preprocessor_config.json ({} when it has none or it is unreadable)."""
    try:
        return json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    except (OSError, ValueError):
        return {}
