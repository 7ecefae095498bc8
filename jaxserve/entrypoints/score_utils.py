"""Classification and scoring, as vLLM has them: what LLM.classify / LLM.score and the
/classify, /score and /rerank routes (openai/serving_score.py) share.

A pooling runner's pooled vector (`RequestOutput.pooled`) is a classifier's logits
(models/seq_cls.py: its score head over the prompt's last token, f32[num_labels]) or an
embedding model's vector. Which task a pooling model serves (`check_task`):

- classify: a classifier only. The probabilities are the logits' activation, vLLM's (after
  transformers' loss for `problem_type`): none for "regression", a sigmoid per label for
  "multi_label_classification" or a single label, else the softmax over the labels.
- score (and rerank): a cross-encoder, a classifier of num_labels == 1 (vLLM's rule: a
  classifier of more labels is refused), scores each (text_1, text_2) pair as ONE prompt: the
  tokenizer's pair (`tokenizer(text=text_1, text_pair=text_2)`: a decoder's tokenizer puts
  nothing between the two, a BERT's its [SEP]), or with `use_sep_token: false` in the config
  (vLLM's LLM-as-reranker) the two texts concatenated; the score is the sigmoid of its logit
  (or the config's sentence-transformers `activation_fn`: Identity keeps the logit). An
  embedding model (a bi-encoder) embeds each text alone and scores the cosine similarity.
- embed: an embedding model only.

Pairs (`pair_up`): one text_1 and one text_2, one text_1 and N text_2 (one-to-many), or N
and N (one-to-one, in order).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.config.pooler import is_classifier, num_labels


def check_task(config: Any, task: str) -> None:
    """ValueError unless the pooling model of `config` (an EngineConfig) serves `task`:
    embed, classify or score."""
    arch = config.model.architecture
    if task == "embed" and is_classifier(arch):
        raise ValueError(
            f"{arch} is a classifier: it serves classify, score and rerank, not embeddings"
        )
    if task == "classify" and not is_classifier(arch):
        raise ValueError(
            f"{arch} is not a classifier (*ForSequenceClassification): it has no labels to "
            "classify into"
        )
    if task == "score" and is_classifier(arch) and num_labels(config.model.hf_config) != 1:
        raise ValueError(
            f"scoring needs a classifier of num_labels == 1 (a cross-encoder); {arch} has "
            f"{num_labels(config.model.hf_config)} labels: use classify"
        )


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def classify_probs(logits: Any, hf_config: Any) -> list[float]:
    """A classifier's logits f32[num_labels] -> its probabilities (vLLM's activation)."""
    x = np.asarray(logits, np.float64).reshape(-1)
    problem = getattr(hf_config, "problem_type", None)
    if problem == "regression":
        return x.tolist()
    if problem == "multi_label_classification" or x.size < 2:
        return _sigmoid(x).tolist()
    e = np.exp(x - x.max())
    return (e / e.sum()).tolist()


def label_of(probs: list[float], hf_config: Any) -> str:
    """The most probable label's name (HF's id2label; its keys are strings once read)."""
    i = int(np.argmax(probs))
    id2label = getattr(hf_config, "id2label", None) or {}
    return str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}")))


def cross_encoder_score(logits: Any, hf_config: Any) -> float:
    """A cross-encoder's one logit -> its score: the sigmoid, unless the config's
    sentence-transformers activation says Identity (the logit) or Tanh."""
    x = float(np.asarray(logits, np.float64).reshape(-1)[0])
    st = getattr(hf_config, "sentence_transformers", None)
    name = (st.get("activation_fn") if isinstance(st, dict) else None) or getattr(
        hf_config, "sbert_ce_default_activation_function", None
    )
    name = str(name or "").rsplit(".", 1)[-1]
    if name == "Identity":
        return x
    if name == "Tanh":
        return float(np.tanh(x))
    return float(_sigmoid(np.float64(x)))


def cosine(a: Any, b: Any) -> float:
    """A bi-encoder's score: the cosine similarity of two pooled vectors."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


def pair_up(
    text_1: Any, text_2: Any, names: tuple[str, str] = ("text_1", "text_2")
) -> tuple[list[str], list[str]]:
    """vLLM's pairs: (firsts, seconds) of one length, a single text_1 repeated for every
    text_2; ValueError for an empty side, a non-string text or N text_1 for M != N text_2."""
    sides = []
    for name, texts in zip(names, (text_1, text_2), strict=True):
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, (list, tuple)) or not texts:
            raise ValueError(f"{name} must be a string or a non-empty list of strings")
        for t in texts:
            if not isinstance(t, str):
                raise ValueError(f"{name} must hold strings, got {type(t).__name__}")
        sides.append(list(texts))
    firsts, seconds = sides
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise ValueError(
            f"{names[0]} has {len(firsts)} texts and {names[1]} {len(seconds)}: give one "
            f"{names[0]} or as many as {names[1]}"
        )
    return firsts, seconds


def cross_encoder_ids(tokenizer: Any, hf_config: Any, first: str, second: str) -> list[int]:
    """A cross-encoder's prompt for one pair (vLLM's `use_sep_token`, default true: the
    tokenizer's pair; false: the two texts as one)."""
    sep = getattr(hf_config, "use_pad_token", None)  # vLLM's older name
    sep = getattr(hf_config, "use_sep_token", True) if sep is None else sep
    if tokenizer is None:
        raise ValueError("scoring text needs the model's tokenizer; this model has none")
    if sep:
        return list(tokenizer(text=first, text_pair=second).input_ids)
    return list(tokenizer(first + second).input_ids)
