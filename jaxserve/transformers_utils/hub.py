"""Model ids from the Hugging Face hub (`ORG/NAME`), as vLLM takes them: huggingface_hub's own
cache layout and rules, so a model downloaded by `hf download`, vLLM or transformers is found
where they put it.

- The hub cache (huggingface_hub's: $HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub;
  `download_dir` / vLLM's `--download-dir` instead) is read first: a snapshot already there
  is used as it is.
- Online, only what loading reads is downloaded (`ALLOW_PATTERNS`): configs, tokenizer files,
  chat templates and safetensors shards; never `*.bin` / `*.pth` copies or `original/`.
- `HF_HUB_OFFLINE=1` (as huggingface_hub reads it, at its import): the cache only, and a
  missing model is an error naming the id, the revision and the cache directory. `HF_TOKEN`
  (read by huggingface_hub) opens gated repos.
"""

from __future__ import annotations

import functools
from pathlib import Path

# What loading a model reads: config.json, generation_config.json, the safetensors index and
# shards, tokenizer.json / tokenizer_config.json / special_tokens_map.json, chat_template.jinja,
# a SentencePiece tokenizer.model, BPE merges / vocab files, sentence-transformers' modules.json
# and pooling configs (1_Pooling/config.json).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken"]
IGNORE_PATTERNS = ["original/*", "*.pth", "*.bin", "*.pt"]


def looks_like_repo_id(name: str) -> bool:
    """`ORG/NAME` (or `NAME`) as the hub spells repo ids, not a filesystem path."""
    if not name or name.startswith((".", "/", "~")) or name.endswith(".gguf") or "\\" in name:
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def snapshot(
    repo_id: str, revision: str | None = None, download_dir: str | Path | None = None
) -> Path:
    """The local directory of `repo_id` at `revision` (a branch, tag or commit; default main),
    from the cache or downloaded into it. Raises FileNotFoundError naming the id, the revision
    and the cache directory when the model cannot be had."""
    from huggingface_hub import constants

    cache = str(Path(download_dir).expanduser()) if download_dir else constants.HF_HUB_CACHE
    return _snapshot(repo_id, revision, cache, constants.HF_HUB_OFFLINE)


@functools.lru_cache(maxsize=64)
def _snapshot(repo_id: str, revision: str | None, cache: str, is_offline: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"model {repo_id!r} (revision {revision or 'main'})"
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
            local_files_only=is_offline,
        )
    except GatedRepoError:
        raise FileNotFoundError(
            f"{what} is gated: accept its terms on huggingface.co and set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{what}: the hub has no such revision") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{what} is neither a local path nor a hub repository (a private one needs HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if is_offline else "the hub could not be reached"
        raise FileNotFoundError(
            f"{what} is not in the hub cache {cache} and {why}: download it first "
            f"(`hf download {repo_id}`), point --download-dir at a cache that has it, or "
            "pass a local path"
        ) from None
    except HfHubHTTPError as e:
        raise FileNotFoundError(f"{what}: the hub answered {e}") from None
    return Path(path)


def display_name(path: Path) -> str:
    """A model path as users named it: ORG/NAME for a hub cache snapshot, else its name."""
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return path.name
