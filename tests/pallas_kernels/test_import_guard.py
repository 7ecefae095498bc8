"""A jax without Pallas' Triton backend still imports jaxserve and runs on CPU (its C++ kernel
or the reference); asking for the Pallas kernel then fails with an error that names what is
missing."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
sys.modules["jax.experimental.pallas.triton"] = None  # as if this jax had no Triton backend
import pytest
from jaxserve.engine.arg_utils import EngineArgs
from pallas_kernels.paged_attention import PALLAS_IMPORT_ERROR, ragged_paged_attention

assert PALLAS_IMPORT_ERROR is not None
model = dict(model=sys.argv[1], load_format="dummy")
assert EngineArgs(**model).create_engine_config().attention_backend in ("cpu", "reference")
for call in (lambda: ragged_paged_attention(), lambda: EngineArgs(
        **model, attention_backend="pallas").create_engine_config()):
    with pytest.raises(ImportError, match="jax.experimental.pallas.triton") as e:
        call()
    assert "--attention-backend reference" in str(e.value)
print("ok")
"""


def test_missing_triton_backend_leaves_the_reference_usable(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
              "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
