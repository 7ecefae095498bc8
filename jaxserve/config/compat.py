"""Which optional features run together: one table of every pair, allowed or refused (with the
reason), the only place a pair is refused.

  FEATURES          the features, each with its short name and what turns it on
  TABLE             (feature, feature, status, reason or note) for every pair of them
  active_features   the features an engine's arguments and model turn on, each with the
                    setting that does
  check(features)   ValueError naming the first refused pair and its reason: called once, as
                    the engine config is built (engine/arg_utils.py::create_engine_config)
  reason(a, b)      a refused pair's reason (None: allowed), for the refusals only a running
                    engine can meet (engine/core_control.py's weight updates)

docs/features.md is this table as a grid: `python -m jaxserve.config.compat --markdown >
docs/features.md` writes it (tests/config/test_compat.py checks that it is current).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Mapping
from typing import Any

from jaxserve.config.lora import LORA_ARCHITECTURES

# (name, short name for the grid, what turns it on)
FEATURES = [
    ("pipeline parallel", "PP", "`--pipeline-parallel-size` (`-pp`) > 1"),
    ("data parallel", "DP", "`--data-parallel-size` (`-dp`) > 1"),
    ("several hosts", "nnodes", "`--nnodes` > 1"),
    ("async scheduling", "async", "`--async-scheduling` (default: on a GPU, without PP or ngram)"),
    ("draft model", "draft", "`--speculative-config`, any method but `ngram` (`eagle`, ...)"),
    ("ngram speculation", "ngram", "`--speculative-config` method `ngram`"),
    ("LoRA", "LoRA", "`--enable-lora`"),
    ("images", "mm", "an image model (LLaVA-1.5, Qwen2.5-VL, Gemma 3 / 4, Qwen3.5, Qwen3-VL)"),
    ("prompt embeddings", "embeds", "`--enable-prompt-embeds`"),
    ("pooling", "pooling", "`--runner pooling` (embeddings; classifiers' `auto` too)"),
    ("KV connectors", "KV", "`--kv-transfer-config` or `--kv-offloading-size`"),
    ("sleep mode", "sleep", "`--enable-sleep-mode`"),
    ("hybrid models", "hybrid", "a model with linear-attention layers (Qwen3-Next, Qwen3.5)"),
    ("shared-KV models", "sharedKV",
     "a model whose later layers read earlier layers' KV, with per-layer inputs (Gemma 4)"),
]  # fmt: skip
NAMES = [name for name, _, _ in FEATURES]
ALLOWED, REFUSED = "allowed", "refused"

# Reasons several pairs share
_PP = "pipeline_parallel_size > 1 is not supported yet with "
_SD_PP = "speculative_config is not supported with pipeline_parallel_size > 1"
_NGRAM_ASYNC = (
    "async_scheduling is not supported with speculative method ngram: its drafts come from "
    "the tokens the step before accepted, on the host (the other methods draft on the devices)"
)
_SD_POOLING = "speculative_config needs a generating runner, not runner='pooling'"
_SD_HYBRID = "speculative_config: a hybrid model's linear-attention state cannot be rolled back"
_EMBEDS = "enable_prompt_embeds: only generating text models, without speculative decoding"
_SLEEP = (
    "enable_sleep_mode: not with a pooling runner or a draft model / EAGLE head (their "
    "weights are not slept yet)"
)
_LORA = f"enable_lora: LoRA is for the dense {', '.join(LORA_ARCHITECTURES)} models"

# Every pair of FEATURES once: (feature, feature, status, reason if refused, else a note or "")
TABLE = [
    ("pipeline parallel", "data parallel", REFUSED, _PP + "data_parallel_size > 1"),
    ("pipeline parallel", "several hosts", ALLOWED,
     "each host holds whole stages, or each stage spans whole hosts (docs/distributed.md)"),
    ("pipeline parallel", "async scheduling", REFUSED,
     "async_scheduling: with pipeline_parallel_size > 1 the engine core keeps that many "
     "micro-batches in flight instead (its batch queue)"),
    ("pipeline parallel", "draft model", REFUSED, _SD_PP),
    ("pipeline parallel", "ngram speculation", REFUSED, _SD_PP),
    ("pipeline parallel", "LoRA", REFUSED, _PP + "enable_lora"),
    ("pipeline parallel", "images", REFUSED, _PP + "image inputs"),
    ("pipeline parallel", "prompt embeddings", REFUSED, _PP + "enable_prompt_embeds"),
    ("pipeline parallel", "pooling", REFUSED, _PP + "runner='pooling'"),
    ("pipeline parallel", "KV connectors", REFUSED, _PP + "kv_transfer_config"),
    ("pipeline parallel", "sleep mode", REFUSED,
     "sleep, wake_up and weight updates are not supported with pipeline stages yet"),
    ("pipeline parallel", "hybrid models", REFUSED, _PP + "a hybrid model's linear attention"),
    ("pipeline parallel", "shared-KV models", REFUSED,
     _PP + "Gemma 4 (its layers read other layers' KV and the first stage's per-layer inputs)"),
    ("data parallel", "several hosts", REFUSED,
     "data parallelism over several hosts is not supported; run one server per host"),
    ("data parallel", "async scheduling", ALLOWED, ""),
    ("data parallel", "draft model", ALLOWED, ""),
    ("data parallel", "ngram speculation", ALLOWED, ""),
    ("data parallel", "LoRA", ALLOWED, ""),
    ("data parallel", "images", ALLOWED, ""),
    ("data parallel", "prompt embeddings", ALLOWED, ""),
    ("data parallel", "pooling", ALLOWED, ""),
    ("data parallel", "KV connectors", ALLOWED, ""),
    ("data parallel", "sleep mode", ALLOWED, ""),
    ("data parallel", "hybrid models", ALLOWED, ""),
    ("data parallel", "shared-KV models", ALLOWED, ""),
    ("several hosts", "async scheduling", ALLOWED, ""),
    ("several hosts", "draft model", ALLOWED, "not tried yet"),
    ("several hosts", "ngram speculation", ALLOWED, ""),
    ("several hosts", "LoRA", REFUSED,
     "enable_lora across several hosts (nnodes > 1) is not supported"),
    ("several hosts", "images", ALLOWED, ""),
    ("several hosts", "prompt embeddings", ALLOWED, ""),
    ("several hosts", "pooling", ALLOWED, ""),
    ("several hosts", "KV connectors", REFUSED,
     "KV connectors are not supported over several hosts"),
    ("several hosts", "sleep mode", REFUSED,
     "sleep, wake_up and weight updates are single-host only for now"),
    ("several hosts", "hybrid models", ALLOWED, ""),
    ("several hosts", "shared-KV models", ALLOWED, ""),
    ("async scheduling", "draft model", ALLOWED,
     "drafts proposed on the devices while the host schedules the next step; a request "
     "with a seed, penalties, a grammar or min_tokens to reach waits for its drafted step"),
    ("async scheduling", "ngram speculation", REFUSED, _NGRAM_ASYNC),
    ("async scheduling", "LoRA", ALLOWED, ""),
    ("async scheduling", "images", ALLOWED, ""),
    ("async scheduling", "prompt embeddings", ALLOWED, ""),
    ("async scheduling", "pooling", ALLOWED, ""),
    ("async scheduling", "KV connectors", ALLOWED, ""),
    ("async scheduling", "sleep mode", ALLOWED, ""),
    ("async scheduling", "hybrid models", ALLOWED, ""),
    ("async scheduling", "shared-KV models", ALLOWED, ""),
    ("draft model", "ngram speculation", ALLOWED, "one method per engine: never both"),
    ("draft model", "LoRA", ALLOWED, ""),
    ("draft model", "images", REFUSED,
     "a draft model or EAGLE head would not see the images; use method 'ngram'"),
    ("draft model", "prompt embeddings", REFUSED, _EMBEDS),
    ("draft model", "pooling", REFUSED, _SD_POOLING),
    ("draft model", "KV connectors", REFUSED,
     "the draft model's KV is not transferred; use ngram or no speculation"),
    ("draft model", "sleep mode", REFUSED, _SLEEP),
    ("draft model", "hybrid models", REFUSED, _SD_HYBRID),
    ("draft model", "shared-KV models", ALLOWED,
     "a draft model (a Gemma 4 too); no EAGLE head is published for Gemma 4 (refused by method)"),
    ("ngram speculation", "LoRA", ALLOWED, ""),
    ("ngram speculation", "images", ALLOWED, ""),
    ("ngram speculation", "prompt embeddings", REFUSED, _EMBEDS),
    ("ngram speculation", "pooling", REFUSED, _SD_POOLING),
    ("ngram speculation", "KV connectors", ALLOWED, ""),
    ("ngram speculation", "sleep mode", ALLOWED, ""),
    ("ngram speculation", "hybrid models", REFUSED, _SD_HYBRID),
    ("ngram speculation", "shared-KV models", ALLOWED, ""),
    ("LoRA", "images", REFUSED, _LORA),
    ("LoRA", "prompt embeddings", ALLOWED, ""),
    ("LoRA", "pooling", ALLOWED, ""),
    ("LoRA", "KV connectors", ALLOWED, ""),
    ("LoRA", "sleep mode", ALLOWED, ""),
    ("LoRA", "hybrid models", REFUSED, _LORA),
    ("LoRA", "shared-KV models", REFUSED, _LORA),
    ("images", "prompt embeddings", REFUSED, _EMBEDS),
    ("images", "pooling", ALLOWED, ""),
    ("images", "KV connectors", ALLOWED, ""),
    ("images", "sleep mode", ALLOWED, ""),
    ("images", "hybrid models", ALLOWED, "no model has both yet"),
    ("images", "shared-KV models", ALLOWED, ""),
    ("prompt embeddings", "pooling", REFUSED, _EMBEDS),
    ("prompt embeddings", "KV connectors", ALLOWED, ""),
    ("prompt embeddings", "sleep mode", ALLOWED, ""),
    ("prompt embeddings", "hybrid models", ALLOWED, ""),
    ("prompt embeddings", "shared-KV models", REFUSED,
     "enable_prompt_embeds: Gemma 4's per-layer inputs are looked up by token id"),
    ("pooling", "KV connectors", REFUSED,
     "a KV connector needs a generating runner, not runner='pooling'"),
    ("pooling", "sleep mode", REFUSED, _SLEEP),
    ("pooling", "hybrid models", ALLOWED, ""),
    ("pooling", "shared-KV models", ALLOWED, ""),
    ("KV connectors", "sleep mode", ALLOWED, ""),
    ("KV connectors", "hybrid models", REFUSED,
     "kv_transfer_config: a hybrid model's linear-attention state cannot be transferred"),
    ("KV connectors", "shared-KV models", ALLOWED,
     "its KV-sharing layers hold no blocks: a position moves its cached layers' blocks"),
    ("sleep mode", "hybrid models", ALLOWED, ""),
    ("sleep mode", "shared-KV models", ALLOWED, ""),
    ("hybrid models", "shared-KV models", ALLOWED, "no model has both yet"),
]  # fmt: skip

_PAIRS = {frozenset((a, b)): (status, text) for a, b, status, text in TABLE}


def entry(a: str, b: str) -> tuple[str, str]:
    """(status, reason or note) of two different features, in either order."""
    for name in (a, b):
        if name not in NAMES:
            raise KeyError(f"{name!r} is not a feature of the table; it has {', '.join(NAMES)}")
    return _PAIRS[frozenset((a, b))]


def reason(a: str, b: str) -> str | None:
    """Why a and b are refused together; None when they are allowed."""
    status, text = entry(a, b)
    return text if status == REFUSED else None


def active_features(
    args: Any, model: Any, *, speculative: Any, pooling: bool, async_scheduling: bool
) -> dict[str, str]:
    """The features EngineArgs `args` turn on for ModelConfig `model`, each with the setting
    or model that does (named in check's message). speculative: the parsed SpeculativeConfig
    or None; pooling: whether the runner pools; async_scheduling: its value, resolved."""
    method = speculative.method if speculative is not None else None
    on = {
        "pipeline parallel": args.pipeline_parallel_size > 1
        and f"pipeline_parallel_size={args.pipeline_parallel_size}",
        "data parallel": args.data_parallel_size > 1
        and f"data_parallel_size={args.data_parallel_size}",
        "several hosts": args.nnodes > 1 and f"nnodes={args.nnodes}",
        "async scheduling": async_scheduling and "async_scheduling=True",
        "ngram speculation": method == "ngram" and "speculative_config method ngram",
        "draft model": method not in (None, "ngram") and f"speculative_config method {method}",
        "LoRA": args.enable_lora and "enable_lora",
        "images": getattr(model.hf_config, "multimodal_config", None) is not None
        and model.architecture,
        "prompt embeddings": args.enable_prompt_embeds and "enable_prompt_embeds",
        "pooling": pooling and "runner='pooling'",
        "KV connectors": (args.kv_offloading_size is not None and "kv_offloading_size")
        or (args.kv_transfer_config is not None and "kv_transfer_config"),
        "sleep mode": args.enable_sleep_mode and "enable_sleep_mode",
        "hybrid models": model.linear_attn is not None and model.architecture,
        "shared-KV models": model.gemma4 is not None and model.architecture,
    }
    return {name: setting for name, setting in on.items() if setting}


def check(features: Mapping[str, str]) -> None:
    """ValueError for the first refused pair of `features` (name -> the setting that turns it
    on), naming both and the table's reason."""
    for a, b in itertools.combinations(NAMES, 2):
        if a in features and b in features and (why := reason(a, b)):
            raise ValueError(f"{a} ({features[a]}) with {b} ({features[b]}): {why}")


def markdown() -> str:
    """docs/features.md: the table as a grid, refusals' reasons and notes as footnotes."""
    footnotes: dict[str, int] = {}

    def cell(a: str, b: str) -> str:
        if a == b:
            return ""
        status, text = entry(a, b)
        mark = "✅" if status == ALLOWED else "❌"
        if not text:
            return mark
        return f"{mark}[^{footnotes.setdefault(text, len(footnotes) + 1)}]"

    shorts = [short for _, short, _ in FEATURES]
    rows = [name if name == short else f"{name} ({short})" for name, short, _ in FEATURES]
    lines = [
        "<!-- Generated by `python -m jaxserve.config.compat --markdown > docs/features.md`",
        "     from jaxserve/config/compat.py: edit the table there, not this file. -->",
        "",
        "# Feature compatibility",
        "",
        "Which optional features run together. ✅: allowed (a footnote is a note); ❌: refused",
        "at start-up with a ValueError naming both features and the footnote's reason. The",
        "table is jaxserve/config/compat.py, the one place a pair of features is refused.",
        "",
        "| Feature | Short | Turned on by |",
        "|---|---|---|",
        *(f"| {name} | {short} | {how} |" for name, short, how in FEATURES),
        "",
        f"| | {' | '.join(shorts)} |",
        f"|---|{'---|' * len(shorts)}",
        *(
            f"| {r} | {' | '.join(cell(a, b) for b in NAMES)} |"
            for a, r in zip(NAMES, rows, strict=True)
        ),
        "",
    ]
    lines += [f"[^{n}]: {text}" for text, n in footnotes.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxserve.config.compat")
    parser.add_argument("--markdown", action="store_true", help="print docs/features.md")
    if parser.parse_args(argv).markdown:
        print(markdown(), end="")
    else:
        for a, b, status, text in TABLE:
            print(f"{a} + {b}: {status}{': ' + text if text else ''}")


if __name__ == "__main__":
    main()
