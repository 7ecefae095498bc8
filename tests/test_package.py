"""The top-level names a vLLM snippet starts from."""

import subprocess
import sys


def test_vllms_top_level_names():
    from jaxserve import (  # noqa: F401
        LLM,
        AsyncEngineArgs,
        AsyncLLM,
        CompletionOutput,
        EngineArgs,
        RequestOutput,
        SamplingParams,
    )

    assert issubclass(AsyncEngineArgs, EngineArgs)
    assert AsyncEngineArgs(model="m", max_model_len=64).max_model_len == 64
    assert SamplingParams(temperature=0).greedy


def test_import_stays_light():
    code = "import sys, jaxserve; print('jax' in sys.modules, jaxserve.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "False"
