"""How a pooling runner (embeddings, classifiers) reduces a prompt's hidden states
(`--pooler-config`), and what a classifier (HF `*ForSequenceClassification`) is."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxserve.config.json_flag import json_object

POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLING_TASKS = ("embed", "embedding", "classify", "score")  # vLLM's names: runner="pooling"
CLASSIFIER_SUFFIX = "ForSequenceClassification"


def is_classifier(architecture: str) -> bool:
    """A sequence classifier (models/seq_cls.py): a score head over the pooled vector."""
    return architecture.endswith(CLASSIFIER_SUFFIX)


def num_labels(hf_config: object) -> int:
    """A classifier's outputs: the length of HF's `id2label` (`num_labels` is derived from it)."""
    id2label = getattr(hf_config, "id2label", None) or {}
    return len(id2label) or int(getattr(hf_config, "num_labels", None) or 2)


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How a pooling runner (`runner="pooling"`) turns a prompt's final hidden states into one
    vector: the last token's (LAST, vLLM's default for decoder models), their mean (MEAN) or
    the first token's (CLS), L2-normalised unless `normalize` is off (per request:
    PoolingParams.normalize)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type {self.pooling_type!r} is not one of {', '.join(POOLING_TYPES)}"
            )


def pooler_config_from(
    runner_arg: str,
    task: str | None,
    pooler_config: dict | str | None,
    path: Path,
    architecture: str,
) -> PoolerConfig | None:
    """The PoolerConfig of a pooling runner, None for a generating one (a classifier's
    runner is pooling unless it asks for generation: vLLM's "auto"); runner_arg, task and
    pooler_config are EngineArgs'."""
    tasks = {None: None, "generate": "generate", **dict.fromkeys(POOLING_TASKS, "pooling")}
    if runner_arg not in ("auto", "generate", "pooling"):
        raise ValueError(f"runner {runner_arg!r} is not one of auto, generate, pooling")
    if task not in tasks:
        raise ValueError(f"task {task!r} is not one of {', '.join(t for t in tasks if t)}")
    runner = tasks[task] or runner_arg
    if is_classifier(architecture):  # a classifier only pools
        if runner == "generate":
            raise ValueError(f"{architecture} is a classifier: it needs runner='pooling'")
        runner = "pooling"
    if runner != "pooling":
        if pooler_config is not None:
            raise ValueError("pooler_config needs runner='pooling'")
        return None
    defaults = sentence_transformers_pooling(path)
    config = {k.lower(): v for k, v in json_object(pooler_config, "pooler_config").items()}
    unknown = sorted(set(config) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"pooler_config: unknown fields {unknown}")
    return PoolerConfig(
        pooling_type=str(config.get("pooling_type", defaults.pooling_type)).upper(),
        normalize=bool(config.get("normalize", defaults.normalize)),
    )


def sentence_transformers_pooling(path: Path) -> PoolerConfig:
    """A sentence-transformers model dir's pooling (`modules.json` and its Pooling module's
    config: mean / last-token / CLS, and whether a Normalize module follows); LAST,
    normalised when the dir has none."""
    modules_file = path / "modules.json" if path.is_dir() else None
    if modules_file is None or not modules_file.exists():
        return PoolerConfig()
    modules = json.loads(modules_file.read_text())
    pooling_type, normalize = "LAST", False
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            pooling = json.loads((path / module.get("path", "") / "config.json").read_text())
            if pooling.get("pooling_mode_mean_tokens"):
                pooling_type = "MEAN"
            elif pooling.get("pooling_mode_cls_token"):
                pooling_type = "CLS"
    return PoolerConfig(pooling_type, normalize)
