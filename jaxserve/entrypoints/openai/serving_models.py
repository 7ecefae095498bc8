"""The models a server answers to (vLLM's `serving_models.py`): the base model's served names
and the LoRA adapters (--lora-modules at start-up, /v1/load_lora_adapter at run time).

A request's `model` picks one: a base name (or no name) runs the base model, an adapter's
name runs it with that adapter's `LoRARequest`, any other name is a 404. Each adapter gets a
fresh `lora_int_id` from a counter that starts at 1 and never goes back, so an adapter loaded
again under a name it had before gets a new id and the engine never reuses the KV its old
weights computed. Each API-server process has its own registry (`--api-server-count`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterable
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from jaxserve.entrypoints.openai.protocol import ModelCard, ModelList
from jaxserve.lora_request import LoRARequest, read_adapter_config

if TYPE_CHECKING:
    from jaxserve.engine.async_llm import AsyncLLM

logger = logging.getLogger("jaxserve.api_server")

LORA_MODULE_FORMS = 'name=path or JSON {"name": ..., "path": ..., "base_model_name": ...}'


class ModelNotFound(LookupError):
    """A 404: an unknown model or adapter name, or no adapter at a path."""


class LoRAModulePath(msgspec.Struct, forbid_unknown_fields=True):
    """One --lora-modules value: the adapter's name, its directory and (for /v1/models'
    `parent`) the base model it was trained on."""

    name: str
    path: str
    base_model_name: str | None = None


class LoadLoRAAdapterRequest(msgspec.Struct):
    """POST /v1/load_lora_adapter's body (vLLM's)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct):
    """POST /v1/unload_lora_adapter's body (vLLM's); lora_int_id, when given, must be the
    adapter's."""

    lora_name: str
    lora_int_id: int | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """One --lora-modules value, `name=path` or the JSON form; ValueError naming the value
    when it is neither."""
    text = value.strip()
    if text.startswith("{"):
        try:
            module = msgspec.json.decode(text, type=LoRAModulePath)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ValueError(
                f"invalid --lora-modules value {value!r} ({e}): expected {LORA_MODULE_FORMS}"
            ) from None
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(
                f"invalid --lora-modules value {value!r}: expected {LORA_MODULE_FORMS}"
            )
        module = LoRAModulePath(name.strip(), path.strip())
    if not module.name or not module.path:
        raise ValueError(
            f"invalid --lora-modules value {value!r}: both a name and a path are needed "
            f"({LORA_MODULE_FORMS})"
        )
    return module


def check_lora_modules(
    modules: Iterable[LoRAModulePath], base_names: Iterable[str], max_lora_rank: int | None
) -> None:
    """--lora-modules at start-up: names unique and none a served model name; each path an
    adapter this engine serves (read_adapter_config). ValueError naming the module."""
    base_names, seen = set(base_names), set()
    for m in modules:
        if m.name in base_names:
            raise ValueError(f"--lora-modules: {m.name!r} is the served model's name")
        if m.name in seen:
            raise ValueError(f"--lora-modules: the name {m.name!r} is given twice")
        seen.add(m.name)
        try:
            read_adapter_config(m.path, max_lora_rank)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"--lora-modules {m.name}: {e}") from None


def model_name_of(model_path: str) -> str:
    """The root of a model whose argument is unknown (a server built without ServeOptions):
    the bundled default's hub name for its GGUF file, else the path."""
    from jaxserve.transformers_utils.model_path import DEFAULT_MODEL_NAME, default_model_path

    try:
        return DEFAULT_MODEL_NAME if Path(model_path) == default_model_path() else model_path
    except FileNotFoundError:  # the bundled model is not installed
        return model_path


class OpenAIServingModels:
    """The registry: the base model's served names and the adapters by name."""

    def __init__(
        self,
        engine: AsyncLLM,
        base_model_names: list[str],
        lora_modules: Iterable[LoRAModulePath] = (),
    ):
        """lora_modules: --lora-modules, checked already (check_lora_modules); they need the
        engine's LoRA config (--enable-lora)."""
        self.engine = engine
        self.base_model_names = list(base_model_names)
        self.model_id: str | None = None  # serve's model argument (ServeOptions.model)
        self.lora_requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        lora_modules = list(lora_modules)
        if lora_modules and engine.config.lora is None:
            raise ValueError("--lora-modules needs --enable-lora")
        for m in lora_modules:
            if m.name in self.base_model_names or m.name in self.lora_requests:
                raise ValueError(f"--lora-modules: the name {m.name!r} is taken")
            self.lora_requests[m.name] = LoRARequest(
                m.name, next(self._ids), m.path, m.base_model_name
            )

    async def load_start_up_adapters(self) -> None:
        """--lora-modules' weights loaded and checked by the engines (AsyncLLM.add_lora) as
        the server starts: a bad adapter stops it, named, rather than failing each request
        that names it."""
        for lora in list(self.lora_requests.values()):
            try:
                await self.engine.add_lora(lora)
            except ValueError as e:
                raise ValueError(f"--lora-modules {lora.lora_name}: {e}") from None

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names: None for a base model's name (or no name);
        ModelNotFound (a 404) for a name that is neither."""
        if model is None or model in self.base_model_names:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise ModelNotFound(f"The model `{model}` does not exist.")
        return lora

    def model_list(self, max_model_len: int) -> ModelList:
        """GET /v1/models: the base names (root: the model as the user named it, vLLM's),
        then the adapters (root: the adapter's path; parent: its base_model_name, else the
        first served name)."""
        created = int(time.time())
        root = self.model_id or model_name_of(self.engine.config.model_path)
        cards = [ModelCard(n, max_model_len, created, root=root) for n in self.base_model_names]
        cards += [
            ModelCard(
                lora.lora_name,
                None,
                created,
                root=lora.lora_path,
                parent=lora.base_model_name or self.base_model_names[0],
            )
            for lora in list(self.lora_requests.values())
        ]
        return ModelList(cards)

    async def load_lora_adapter(
        self, request: LoadLoRAAdapterRequest, executor: Executor | None = None
    ) -> str:
        """Add an adapter under a new name: its config read on `executor` (off the event
        loop), then its weights loaded and checked by the engines (AsyncLLM.add_lora, as
        vLLM's), so a bad one is refused here and never listed. ValueError (a 400): LoRA off,
        a name in use, an adapter this engine does not serve (rank above --max-lora-rank,
        ...), a tensor of the wrong shape or dtype, a NaN, a file that is no safetensors
        file; ModelNotFound (a 404): no adapter there."""
        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise ValueError("Both 'lora_name' and 'lora_path' must be provided.")
        config = self.engine.config.lora
        if config is None:
            raise ValueError("LoRA is not enabled: start the server with --enable-lora")
        async with self._lock:
            if name in self.lora_requests or name in self.base_model_names:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(
                    executor, read_adapter_config, path, config.max_lora_rank
                )
            except FileNotFoundError as e:
                raise ModelNotFound(str(e)) from None
            lora = LoRARequest(name, next(self._ids), path)
            await self.engine.add_lora(lora)  # ValueError naming what is wrong with it
            self.lora_requests[name] = lora
        logger.info("loaded LoRA adapter %r (id %d) from %s", name, lora.lora_int_id, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        """Remove an adapter: new requests naming it get a 404 at once, running ones finish;
        then the engines drop its weights (AsyncLLM.remove_lora; should that call fail, its
        error is the answer, and the name is gone all the same). ModelNotFound (a 404): no
        adapter of that name (and lora_int_id, when given)."""
        name = request.lora_name
        if not name:
            raise ValueError("'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._lock:
            lora = self.lora_requests.get(name)
            if lora is None or request.lora_int_id not in (None, lora.lora_int_id):
                raise ModelNotFound(f"The lora adapter '{name}' cannot be found.")
            del self.lora_requests[name]
        logger.info("removed LoRA adapter %r (id %d)", name, lora.lora_int_id)
        await self.engine.remove_lora(lora.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."
