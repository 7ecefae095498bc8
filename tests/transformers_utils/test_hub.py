"""Hub ids (ORG/NAME) as vLLM takes them, served from a Hugging Face hub cache on disk in the
layout huggingface_hub writes (blobs, snapshots/<commit>/ links, refs/<revision>), confirmed by
its own scan_cache_dir: revisions, --tokenizer ids, --download-dir, and HF_HUB_OFFLINE=1 with
a clear error naming the id and the cache when the model is not there. Nothing is downloaded:
the suite has no hub to reach."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from huggingface_hub import scan_cache_dir

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.transformers_utils.model_path import default_model_path, resolve_model_path
from jaxserve.transformers_utils.tokenizer import read_tokenizer
from tests.entrypoints.openai.test_api_server import Server
from tests.helpers import make_tiny_hf, make_tiny_tokenizer

REPO = "tiny-org/tiny-llama"
SIZES = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "128"]


def populate_hub_cache(cache: Path, repo_id: str, files: Path, revision: str = "main") -> Path:
    """Put `files` (a directory) in `cache` as huggingface_hub does for `repo_id` at
    `revision`: each file a blob named by its sha256, linked from snapshots/<commit>/, and
    refs/<revision> holding the commit. Returns the snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for src in sorted(p for p in files.rglob("*") if p.is_file()):
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / src.relative_to(files)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict:
    """A hub cache with REPO at main (a tiny Llama, byte tokenizer, a generation_config.json
    asking temperature 0.6 and at most 5 new tokens) and at tag v1 (64 layers' worth of
    nothing: another config), plus a tokenizer-only repo."""
    root = tmp_path_factory.mktemp("hub")
    model = root / "model"
    vocab = make_tiny_tokenizer(model)
    make_tiny_hf("llama", model, vocab_size=vocab)
    generation = json.loads((model / "generation_config.json").read_text())
    generation.update(temperature=0.6, top_p=0.9, max_new_tokens=5, do_sample=True)
    (model / "generation_config.json").write_text(json.dumps(generation))
    cache = root / "cache"
    main = populate_hub_cache(cache, REPO, model)
    v1 = model.parent / "v1"
    v1.mkdir()
    config = json.loads((model / "config.json").read_text())
    (v1 / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    tagged = populate_hub_cache(cache, REPO, v1, revision="v1")
    tokenizer_files = root / "tokenizer"  # a tokenizer-only repo: no config.json
    tokenizer_files.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tokenizer_files / name).write_bytes((model / name).read_bytes())
    tokenizer = populate_hub_cache(cache, "tiny-org/tokenizer", tokenizer_files, revision="v1")
    return {"cache": cache, "main": main, "v1": tagged, "tokenizer": tokenizer}


@pytest.fixture
def offline(hub, monkeypatch):
    """huggingface_hub offline, on `hub`'s cache: its settings as it read them from
    HF_HUB_OFFLINE / HF_HUB_CACHE at import (the servers below get the variables)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub["cache"]))
    return hub


def test_the_cache_is_huggingface_hubs_own_layout(hub):
    repos = {r.repo_id: r for r in scan_cache_dir(hub["cache"]).repos}
    assert set(repos) == {REPO, "tiny-org/tokenizer"}
    refs = {ref for revision in repos[REPO].revisions for ref in revision.refs}
    assert refs == {"main", "v1"}
    files = {f.file_name for r in repos[REPO].revisions for f in r.files}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files


def test_ids_resolve_to_their_snapshot_at_the_revision_asked(offline):
    assert resolve_model_path(REPO) == offline["main"]
    assert resolve_model_path(REPO, revision="v1") == offline["v1"]
    assert resolve_model_path(REPO, revision=offline["v1"].name) == offline["v1"]  # a commit
    args = EngineArgs(model=REPO, tokenizer="tiny-org/tokenizer", tokenizer_revision="v1")
    assert args.model_path() == offline["main"]
    assert args.tokenizer_source() == str(offline["tokenizer"])
    assert len(read_tokenizer(args.tokenizer_source())) == len(read_tokenizer(offline["main"]))
    local = EngineArgs(model=REPO, tokenizer=str(offline["tokenizer"]))  # a directory as is
    assert local.tokenizer_source() == str(offline["tokenizer"])
    bundled = EngineArgs(model=REPO, tokenizer="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert bundled.tokenizer_source() == str(default_model_path())  # no hub needed
    config = EngineArgs(model=REPO, revision="v1", load_format="dummy").create_engine_config()
    assert config.model_path == str(offline["v1"]) and config.model.num_layers == 2


def test_a_missing_id_names_the_id_the_revision_and_the_cache(offline, tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("tiny-org/missing")
    message = str(e.value)
    assert "'tiny-org/missing'" in message and str(offline["cache"]) in message
    assert "HF_HUB_OFFLINE" in message
    with pytest.raises(FileNotFoundError, match="revision v2"):
        resolve_model_path(REPO, revision="v2")
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):  # --download-dir's cache
        EngineArgs(model=REPO, download_dir=str(tmp_path)).model_path()
    assert EngineArgs(model=REPO, download_dir=str(offline["cache"])).model_path().exists()


def test_paths_and_presets_are_not_taken_for_ids(offline, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist$"):
        resolve_model_path(str(tmp_path / "org" / "name"))
    with pytest.raises(FileNotFoundError, match="a preset: use load_format='dummy'"):
        resolve_model_path("llama-3-8b")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        resolve_model_path(offline["main"] / "config.json")


def test_serve_an_id_offline_with_its_generation_config(offline):
    """`HF_HUB_OFFLINE=1 jaxserve serve ORG/NAME`: served under the id, the snapshot's
    generation_config.json's defaults logged and its max_new_tokens capping the output."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(offline["cache"])}
    server = Server(REPO, env=env, defaults=SIZES)
    try:
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [REPO]
        body = {"model": REPO, "prompt": "hello", "max_tokens": 20, "ignore_eos": True}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 5
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        assert "{'temperature': 0.6, 'top_p': 0.9, 'max_tokens': 5}" in server.tail(200)
    finally:
        server.stop()


def test_serving_a_missing_id_offline_fails_at_once_naming_it(offline):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(offline["cache"])}
    run = subprocess.run(
        [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "tiny-org/missing"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert "'tiny-org/missing'" in run.stderr and str(offline["cache"]) in run.stderr
