"""LoRA adapters as a request names them (`LoRARequest`, vLLM's) and what their
`adapter_config.json` says (`read_adapter_config`): plain data the frontend checks before a
request reaches the engine, and the engine core loads the weights from (models/lora.py).
"""

from __future__ import annotations

import dataclasses
import json
import os

import msgspec

# The projections an adapter may target (PEFT's module names), by the fused layer holding
# them: q/k/v in qkv_proj, gate/up in gate_up_proj.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRARequest(msgspec.Struct, omit_defaults=True):
    """An adapter for one request: `LoRARequest(name, int_id, path)`, vLLM's.

    lora_int_id (> 0) identifies the loaded weights: the engine loads `lora_path` the first
    time an id is used and keeps it (on the device, then on the host) by that id. A server that
    loads a name again gives it a new id, so the KV a name's old weights computed is never
    reused (`cache_key`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def cache_key(self) -> str:
        """What separates this adapter's prefix-cache blocks: its name and load id."""
        return f"{self.lora_name}\x00{self.lora_int_id}"


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """A PEFT LoRA adapter's `adapter_config.json`, checked: rank r, lora_alpha, rsLoRA, and
    the targeted projections (a subset of LORA_TARGETS)."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        """What B @ A is multiplied by: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (self.r**0.5 if self.use_rslora else self.r)


def read_adapter_config(path: str, max_lora_rank: int | None = None) -> AdapterConfig:
    """The adapter directory `path`'s config, checked. FileNotFoundError when the directory
    or its adapter_config.json / adapter_model.safetensors is missing; ValueError naming
    anything this engine does not serve (a rank above max_lora_rank, modules_to_save, DoRA,
    per-module ranks, a bias, a target other than LORA_TARGETS)."""
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"no LoRA adapter at {path!r}: {config_file} does not exist")
    if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        raise FileNotFoundError(
            f"no LoRA adapter weights at {path!r}: adapter_model.safetensors does not exist "
            "(adapter_model.bin, a pickle, is not read)"
        )
    try:
        with open(config_file) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"the LoRA adapter config {config_file} cannot be read: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"the LoRA adapter config {config_file} is not a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"adapter {path!r} is a {peft_type} adapter; only LORA is supported")
    r = raw.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"adapter {path!r}: r must be a positive integer, got {r!r}")
    if max_lora_rank is not None and r > max_lora_rank:
        raise ValueError(
            f"LoRA rank {r} of adapter {path!r} is greater than max_lora_rank {max_lora_rank}"
        )
    refused = {
        "modules_to_save": "modules_to_save (fully trained layers) are not supported",
        "use_dora": "DoRA adapters are not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "layers_to_transform": "layers_to_transform is not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) is not supported",
        "lora_bias": "a bias on lora_B (lora_bias) is not supported",
        "layer_replication": "layer_replication is not supported",
        "trainable_token_indices": "trainable token embeddings are not supported",
        "target_parameters": "LoRA on parameters (target_parameters) is not supported",
    }
    for key, why in refused.items():
        if raw.get(key):
            raise ValueError(f"adapter {path!r}: {why} ({key}={raw[key]!r})")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"adapter {path!r}: bias={raw['bias']!r} is not supported, only 'none'")
    targets = raw.get("target_modules")
    if targets == "all-linear":
        targets = list(LORA_TARGETS)
    if isinstance(targets, str) or not targets:
        raise ValueError(
            f"adapter {path!r}: target_modules must be a list of module names, got {targets!r}"
        )
    unknown = sorted({str(t) for t in targets} - set(LORA_TARGETS))
    if unknown:
        raise ValueError(
            f"adapter {path!r} targets {', '.join(unknown)}: LoRA is supported on "
            f"{', '.join(LORA_TARGETS)} only"
        )
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"adapter {path!r}: lora_alpha must be a number, got {alpha!r}")
    return AdapterConfig(r, float(alpha), bool(raw.get("use_rslora")), tuple(sorted(targets)))
