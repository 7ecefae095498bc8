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
