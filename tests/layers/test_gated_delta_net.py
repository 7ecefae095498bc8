"""The gated delta rule's chunked form (prefill chunks) against its recurrent form (one
token at a time, as HF's torch_recurrent_gated_delta_rule runs it) on a ragged batch:
sequences that continue earlier states, start fresh at position 0, span several chunks or
end mid-chunk, beside padding sequences; outputs and the states each row is left with."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers import gated_delta_net
from jaxserve.layers.gated_delta_net import gated_delta_scan

HK, HV, DK, DV, K = 2, 4, 8, 4, 4
C = 2 * HK * DK + HV * DV


@pytest.mark.parametrize(("chunk", "group"), [(4, 2), (64, 4)])
def test_chunked_form_equals_the_recurrent_form(chunk, group, monkeypatch):
    """Chunks of 4 tokens and 2 multi-token sequences a pass (2 passes), or one pass."""
    monkeypatch.setattr(gated_delta_net, "GROUP", group)
    rng = np.random.default_rng(0)
    q_lens, first_pos = [9, 1, 4, 13], [0, 30, 7, 0]  # seq 0 and 3 fresh: their states drop
    rows = [3, 0, 5, 1]  # input-batch rows of 6
    t = sum(q_lens) + 3  # 3 padding tokens
    qsl = np.array([0, *np.cumsum(q_lens), t - 3, t - 3], np.int32)  # 2 padding sequences
    token_rows = np.concatenate([[r] * n for r, n in zip(rows, q_lens, strict=True)] + [[0] * 3])
    positions = np.concatenate([p + np.arange(n) for p, n in zip(first_pos, q_lens, strict=True)]
                               + [[0] * 3])  # fmt: skip
    args = (
        jnp.asarray(rng.standard_normal((t, C)), jnp.float32),
        jnp.asarray(rng.standard_normal((t, HV)), jnp.float32),
        jnp.asarray(rng.standard_normal((t, HV)), jnp.float32),
        jnp.asarray(rng.standard_normal((K, C)) * 0.5, jnp.float32),
        jnp.asarray(rng.standard_normal(HV) * 0.3, jnp.float32),
        jnp.asarray(rng.standard_normal(HV), jnp.float32),
        jnp.asarray(qsl), jnp.asarray([4], np.int32), jnp.asarray(token_rows, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(rng.standard_normal((6, K - 1, C)), jnp.float32),
        jnp.asarray(rng.standard_normal((6, HV, DK, DV)), jnp.float32),
    )  # fmt: skip
    dims = dict(num_k_heads=HK, k_head_dim=DK, v_head_dim=DV)
    run = jax.jit(gated_delta_scan, static_argnames=("num_k_heads", "k_head_dim",
                                                      "v_head_dim", "chunk"))  # fmt: skip
    want = run(*args, **dims, chunk=None)
    got = run(*args, **dims, chunk=chunk)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-5)
    out, conv, rec = got
    assert not np.asarray(out)[-3:].any()  # padding tokens
    untouched = [2, 4]  # rows no sequence holds keep their state
    np.testing.assert_array_equal(np.asarray(rec)[untouched], np.asarray(args[-1])[untouched])
    np.testing.assert_array_equal(np.asarray(conv)[untouched], np.asarray(args[-2])[untouched])
