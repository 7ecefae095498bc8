"""Speculative decoding's configuration (`--speculative-config`, vLLM's fields)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.json_flag import json_object

SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# The methods whose draft keeps a KV cache in the target's blocks (k lookahead slots a step).
KV_DRAFT_METHODS = ("draft_model", "eagle", "eagle3", "mtp")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config`): a proposer drafts up to
    num_speculative_tokens tokens per request and step, the target model scores them in the
    next step and keeps the prefix its own sampling agrees with (spec_decode/).

    ngram (prompt lookup): the longest suffix of a request's tokens, between prompt_lookup_min
    and prompt_lookup_max tokens long, that occurred earlier in them; the tokens that followed
    its latest occurrence are the draft. Both unset: 5 and 5; one set: the other copies it.

    draft_model: `model` (an HF dir or .gguf of the target's vocabulary, resolved) drafts
    greedily with its own KV cache in the target's blocks (spec_decode/draft_model.py).

    eagle / eagle3: `model` is an EAGLE-1 / EAGLE-3 head (HF dir, models/eagle.py) for a
    target that declares them (models/interfaces.py::supports_eagle: the Llama family and
    the MoE families on its forward); it drafts greedily from the target's hidden states
    (spec_decode/eagle.py).

    mtp: the target's own multi-token-prediction layer (DeepSeek-V3, GLM-4.5: models/mtp.py)
    drafts the k tokens, reused k times as vLLM does (spec_decode/mtp.py); `model`, when
    given, is the target's path (vLLM's form), else none is needed."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft_model / eagle / eagle3: the draft's path

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported; jaxserve "
                f"implements {', '.join(SPEC_METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be a positive integer, got {k!r}"
            )
        if self.method in KV_DRAFT_METHODS:
            if not self.model and self.method != "mtp":
                raise ValueError(f"speculative_config method {self.method} needs a model")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("speculative_config prompt_lookup_min/max are for method ngram")
            return
        if self.model is not None:
            raise ValueError(f"speculative_config model {self.model!r}: method ngram takes none")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {n!r}")
        if lo > hi:
            raise ValueError(
                f"speculative_config prompt_lookup_min={lo} exceeds prompt_lookup_max={hi}"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def parse(cls, config: dict | str) -> SpeculativeConfig:
        """From `--speculative-config` JSON or its dict (vLLM's field names)."""
        config = dict(json_object(config, "speculative_config"))
        method = config.pop("method", None)
        if config.get("model") == "ngram":  # vLLM's older spelling of method ngram
            del config["model"]
            method = method or "ngram"
        elif method is None and config.get("model"):
            method = "draft_model"  # vLLM refines this to eagle etc. from the checkpoint
        if method is None:
            raise ValueError(
                f"speculative_config {config!r} names no method; jaxserve implements "
                f"{', '.join(SPEC_METHODS)}"
            )
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs num_speculative_tokens")
        unknown = sorted(set(config) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config: unknown or unsupported fields {unknown}")
        return cls(method=method, **config)


# A target architecture with multi-token-prediction layers -> its MTP head's (models/mtp.py).
MTP_ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "DeepSeekMTPModel",
    "DeepseekV32ForCausalLM": "DeepSeekV32MTPModel",
    "Glm4MoeForCausalLM": "Glm4MoeMTPModel",
    "GlmMoeDsaForCausalLM": "GlmMoeDsaMTPModel",
}


def num_mtp_layers(hf_config) -> int:
    """A checkpoint's MTP layers (`num_nextn_predict_layers`, transformers' `num_mtp_layers`;
    0 when it names none)."""
    n = getattr(hf_config, "num_nextn_predict_layers", None)
    if n is None:
        n = getattr(hf_config, "num_mtp_layers", None)
    return int(n or 0)


def mtp_architecture(target) -> str:
    """The MTP head architecture of `target` (a ModelConfig) for method mtp; ValueError
    naming the target's architecture where it has no MTP layers."""
    arch = MTP_ARCHITECTURES.get(target.architecture)
    if arch is None:
        raise ValueError(
            f"speculative_config method mtp needs a target with multi-token-prediction "
            f"layers ({', '.join(MTP_ARCHITECTURES)}); {target.architecture} is not one"
        )
    if num_mtp_layers(target.hf_config) < 1:
        raise ValueError(
            f"speculative_config method mtp: {target.architecture} has no "
            "multi-token-prediction layers (num_nextn_predict_layers is 0)"
        )
    return arch
