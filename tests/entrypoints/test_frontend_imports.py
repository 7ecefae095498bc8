"""The frontend processes (the HTTP server, an `LLM` whose engine core runs in its own
process) import no model runner, no model or layer code, no Pallas and no kernel: those load
in the engine core process only."""

import json
import subprocess
import sys

FRONTEND = (
    "jaxserve.entrypoints.cli",
    "jaxserve.entrypoints.openai.api_server",
    "jaxserve.entrypoints.openai.multi_server",
    "jaxserve.entrypoints.llm",
    "jaxserve.engine.async_llm",
    "jaxserve.engine.llm_engine",
)
ENGINE_SIDE = ("jaxserve.worker", "jaxserve.models", "jaxserve.layers", "pallas_kernels",
               "jax.experimental.pallas", "jax._src.pallas", "flax")  # fmt: skip


def test_the_frontend_imports_no_runner_model_pallas_or_kernel():
    code = (
        "import importlib, json, sys\n"
        f"for name in {FRONTEND!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.splitlines()[-1])
    assert set(FRONTEND) <= set(loaded)
    engine_side = [m for m in loaded if m.startswith(ENGINE_SIDE)]
    assert engine_side == []


def test_the_engine_core_imports_no_transformers_once_the_config_is_cached(tmp_path, monkeypatch):
    """An engine core started on a HF directory whose config.json was read before (the config
    cache) loads without importing transformers or torch: 2-4 s of each start where torch is
    installed."""
    from jaxserve.transformers_utils.config import read_hf_config
    from tests.helpers import make_tiny_hf

    model = make_tiny_hf("llama", tmp_path / "model")  # with a generation_config.json
    monkeypatch.setenv("JAXSERVE_CONFIG_CACHE", str(tmp_path / "configs"))
    read_hf_config(model)  # an earlier start
    code = (
        "import sys\n"
        "from jaxserve.engine.arg_utils import EngineArgs\n"
        "from jaxserve.engine.core import EngineCore\n"
        f"args = EngineArgs(model={str(model)!r}, max_num_seqs=2, max_num_batched_tokens=8,\n"
        "                  max_model_len=32, num_gpu_blocks_override=8)\n"
        "EngineCore(args.create_engine_config(), None, 0)\n"
        "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-1] == "[]"
