"""LoRA serving's configuration (`--enable-lora` and vLLM's --max-loras, --max-lora-rank,
--max-cpu-loras, --lora-dtype)."""

from __future__ import annotations

import dataclasses

LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")
# The architectures adapters apply to: the dense Llama family (models/llama.py's layers).
LORA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """max_loras: adapters resident on the devices at once (the device slots; a step holds
    at most this many distinct adapters); max_lora_rank: the rank every slot is padded to
    (an adapter of a higher rank is refused); max_cpu_loras: adapters kept on the host
    (loaded, fused, ready to copy into a slot), at least max_loras; lora_dtype: the slots'
    dtype ("auto": the model's)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(
                f"lora_dtype {self.lora_dtype!r} is not supported; choose from "
                f"{', '.join(LORA_DTYPES)}"
            )

    @property
    def cpu_loras(self) -> int:
        """Adapters kept on the host: max_cpu_loras, default max_loras."""
        return self.max_cpu_loras or self.max_loras
