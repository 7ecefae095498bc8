"""4-bit checkpoints' packed weights -> the "int4" kernel of layers/linear.py (uint8 [in / 2,
out], two nibbles a byte; scale and offset f32 [in / group, out]: w = u * scale + offset), and
MXFP4's -> its "mxfp4" kernel (e2m1 codes packed the same way, e8m0 exponents per group).

Three layouts, each as its own library writes it (tests/data/quantized/ holds one of each,
made by it):
- compressed-tensors pack-quantized (llm-compressor's W4A16): `weight_packed` int32 [out,
  in / 8] (packed along the input), `weight_scale` [out, in / group], `weight_zero_point` int32
  [out / 8, in / group] (packed along the output) when asymmetric, else 8, and with
  `actorder: group` `weight_g_idx` [in] (the group of each input column);
- GPTQ (AutoGPTQ / GPTQModel, quant_method "gptq"): `qweight` int32 [in / 8, out] (packed
  along the input), `qzeros` int32 [in / group, out / 8] (packed along the output; the "gptq"
  format stores zero - 1 in each nibble, "gptq_v2" the zero), `scales` [in / group, out] and
  `g_idx` [in];
- AWQ (AutoAWQ / GPTQModel, quant_method "awq", version "gemm"): `qweight` int32 [in, out / 8]
  and `qzeros` int32 [in / group, out / 8], both packed along the output with columns
  0 2 4 6 1 3 5 7 of each 8 in nibbles 0..7, `scales` [in / group, out].
In every layout nibble i of a 32-bit word is bits 4i..4i+3 and w = (u - zero) * scale.
One group per output channel (GPTQ / AWQ group_size -1, compressed-tensors strategy
"channel") stores a single group of `in` rows.
"""

from __future__ import annotations

import numpy as np

from jaxserve.models.llama import HFWeight

_AWQ_COLUMNS = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # the output column of nibble i in a word


def _pack_rows(u: np.ndarray) -> np.ndarray:
    """4-bit values [..., in, out] -> uint8 [..., in / 2, out]: row 2i in the low nibble, 2i + 1
    high (a stack of experts packs each expert's rows)."""
    return (u[..., 0::2, :] | (u[..., 1::2, :] << 4)).astype(np.uint8)


def _nibbles(packed: np.ndarray, axis: int) -> np.ndarray:
    """int32 words -> uint8 nibbles, each word's 8 in place of it along `axis` (low first)."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    shape = [1] * (words.ndim + 1)
    shape[axis + 1] = 8
    shifts = (4 * np.arange(8, dtype=np.uint32)).reshape(shape)
    u = (np.expand_dims(words, axis + 1) >> shifts) & 0xF
    shape = list(words.shape)
    shape[axis] *= 8
    return u.reshape(shape).astype(np.uint8)


def _compressed_tensors(source, base: str):
    """-> (u [in, out] uint8, scale [in / group, out] f32, zero: the same shape or 8, g_idx
    [in] or None), as stored but transposed."""
    if base + "weight_packed" not in source:
        raise ValueError(
            f"{base}weight_packed is missing: a pack-quantized checkpoint must quantize "
            "every decoder linear layer (none may be in its ignore list)"
        )
    out, d_in = (int(v) for v in np.asarray(source.get(base + "weight_shape")))
    u = _nibbles(np.asarray(source.get(base + "weight_packed")), 1)[:, :d_in]
    scale = np.asarray(source.get(base + "weight_scale"), np.float32)
    zero = np.full_like(scale, 8.0)  # symmetric: the signed value's zero, stored as 8
    if base + "weight_zero_point" in source:
        zero = _nibbles(np.asarray(source.get(base + "weight_zero_point")), 0)[:out]
    g_idx = source.get(base + "weight_g_idx") if base + "weight_g_idx" in source else None
    return u.T, scale.T, zero.T.astype(np.float32), g_idx


def _gptq_or_awq(source, base: str, layout: str):
    """-> (u [in, out] uint8, scale, zero [in / group, out] f32, g_idx [in] or None)."""
    if base + "qweight" not in source:
        raise ValueError(
            f"{base}qweight is missing: a {layout} checkpoint must quantize every decoder "
            "linear layer (modules_to_not_convert / dynamic exclusions are not supported)"
        )
    qweight = np.asarray(source.get(base + "qweight"))
    scale = np.asarray(source.get(base + "scales"), np.float32)  # [in / group, out]
    if layout == "awq":
        u = _nibbles(qweight, 1)  # [in, out], columns in AWQ's order within each word
        zero = _nibbles(np.asarray(source.get(base + "qzeros")), 1)
        order = (np.arange(u.shape[1]) // 8 * 8).reshape(-1, 8) + _AWQ_COLUMNS
        natural = np.argsort(order.reshape(-1))
        return u[:, natural], scale, zero[:, natural].astype(np.float32), None
    u = _nibbles(qweight, 0)  # [in, out]
    zeros = np.ascontiguousarray(np.asarray(source.get(base + "qzeros"))).view(np.uint32)
    if layout == "gptq":  # zero - 1 in each nibble, subtracted from the whole word
        zeros = zeros + np.uint32(0x11111111)
    g_idx = source.get(base + "g_idx") if base + "g_idx" in source else None
    return u, scale, _nibbles(zeros, 1).astype(np.float32), g_idx


def _grouped(base: str, stored, group: int, act_order: bool, per_channel: bool):
    """A layer's (u [in, out], scale, zero [groups, out], g_idx) as stored -> (u [out, in],
    scale, zero [out, in / group], perm int32 [in] or None) in the kernel's groups: with
    act_order the input rows sorted by g_idx (perm: the input row of each), one group per
    channel repeated over groups of `group` rows."""
    u, scale, zero, g_idx = stored
    d_in, names = u.shape[0], f"{base}scales / zero points"
    stored_group = d_in if per_channel else group
    if scale.shape != (d_in // stored_group, u.shape[1]) or zero.shape != scale.shape:
        raise ValueError(
            f"{names} have shapes {scale.shape} / {zero.shape}, not "
            f"{(d_in // stored_group, u.shape[1])} for a [{u.shape[0]}, {u.shape[1]}] weight "
            f"in groups of {stored_group}"
        )
    perm = None
    g_idx = None if g_idx is None else np.asarray(g_idx)
    if act_order:
        if g_idx is None or not (np.bincount(g_idx, minlength=d_in // group) == group).all():
            raise ValueError(
                f"{base}g_idx does not put {group} input rows (group_size) in each group"
            )
        perm = np.argsort(g_idx, kind="stable").astype(np.int32)
        u = u[perm]  # the rows of group g are now rows g * group ...
    elif g_idx is not None and not np.array_equal(g_idx, np.arange(d_in) // stored_group):
        raise ValueError(
            f"{base}g_idx is not input row // group_size ({stored_group}), and the config "
            "does not ask for activation order (desc_act / actorder group)"
        )
    if per_channel:
        scale, zero = (np.repeat(x, d_in // group, axis=0) for x in (scale, zero))
    return u.T, scale.T, zero.T, perm


def read_mxfp4(source, weight: HFWeight, group: int) -> tuple[np.ndarray, np.ndarray]:
    """compressed-tensors mxfp4-pack-quantized: each HF layer's `weight_packed` uint8 [out,
    in / 2] (two e2m1 codes a byte, the even input column in the low nibble) and
    `weight_scale` uint8 [out, in / group] (e8m0 exponents) -> (kernel uint8 [in / 2, out],
    packed as int4's; scale uint8 [in / group, out]), fused and transposed."""
    codes, scales = [], []
    for name in weight.names:
        base = name.removesuffix("weight")
        if base + "weight_packed" not in source:
            raise ValueError(
                f"{base}weight_packed is missing: an MXFP4 checkpoint must quantize every "
                "decoder linear layer (none may be in its ignore list)"
            )
        packed = np.asarray(source.get(base + "weight_packed"))
        scale = np.asarray(source.get(base + "weight_scale"))
        if packed.dtype != np.uint8 or scale.dtype != np.uint8:
            raise ValueError(
                f"{base}weight_packed / weight_scale are {packed.dtype} / {scale.dtype}, not "
                "uint8 (e2m1 pairs, e8m0 exponents)"
            )
        out, d_in = packed.shape[0], packed.shape[1] * 2
        if scale.shape != (out, d_in // group):
            raise ValueError(
                f"{base}weight_scale has shape {scale.shape}, not {(out, d_in // group)}"
            )
        codes.append(np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(out, d_in))
        scales.append(scale)
    build = weight.build or (lambda x: x)
    return _pack_rows(build(*codes)), build(*scales).astype(np.uint8)


def read_int4(
    source,
    weight: HFWeight,
    group: int,
    layout: str,
    act_order: bool = False,
    per_channel: bool = False,
) -> tuple[np.ndarray, ...]:
    """Each HF layer of `weight` in `layout` -> (kernel uint8 [in / 2, out], scale, offset f32
    [in / group, out]), fused and transposed like the float weights; with act_order (GPTQ
    desc_act, compressed-tensors actorder group) also perm int32 [in], the input row of each
    kernel row, which the layers fused into one kernel (q, k, v; gate, up: one input, so one
    activation order) must share; per_channel: the checkpoint's one scale per output channel
    (group_size -1) repeated over the kernel's groups of `group` rows."""
    values, scales, offsets, perms = [], [], [], []
    for name in weight.names:
        base = name.removesuffix("weight")
        if layout == "compressed-tensors":
            stored = _compressed_tensors(source, base)
        else:
            stored = _gptq_or_awq(source, base, layout)
        u, scale, zero, perm = _grouped(base, stored, group, act_order, per_channel)
        if act_order and perms and not np.array_equal(perm, perms[0]):
            raise ValueError(
                f"{base}g_idx differs from {weight.names[0].removesuffix('weight')}g_idx: "
                "layers fused into one kernel need one activation order"
            )
        perms.append(perm)
        values.append(u)
        scales.append(scale)
        offsets.append(-zero * scale)
    build = weight.build or (lambda x: x)
    out = (
        _pack_rows(build(*values)),
        build(*scales).astype(np.float32),
        build(*offsets).astype(np.float32),
    )
    return (*out, perms[0]) if act_order else out
