"""The development routes (JAXSERVE_SERVER_DEV_MODE=1) of a real server, its engine core in
its own process: pause / resume in vLLM's three modes, sleep / wake_up, vLLM's weight
transfer (shared memory, a shared directory) checked against HF on the new weights, and
collective_rpc (only its listed runner methods: the engine survives the others). The server
runs with an API key, as the development routes require."""

from __future__ import annotations

import concurrent.futures
import json
import time
from multiprocessing import shared_memory

import httpx
import numpy as np
import pytest
import torch

from tests.entrypoints.openai.test_api_server import KEY, TINY_ENV, Server, auth
from tests.helpers import hf_model

PROMPT = [1, 5, 9, 42, 7, 300, 12]


@pytest.fixture(scope="module")
def server(tiny_model):
    s = Server(*tiny_model, "--enable-sleep-mode", "--api-key", KEY,
               env={**TINY_ENV, "JAXSERVE_SERVER_DEV_MODE": "1"})  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def new_weights(tiny_model, tmp_path_factory) -> tuple[dict[str, np.ndarray], object]:
    """The tiny model's HF weights moved (a trainer's next step), saved under a directory."""
    model = hf_model(tiny_model[0])
    torch.manual_seed(3)
    moved = type(model)(model.config)
    with torch.no_grad():
        for p, q in zip(model.parameters(), moved.parameters(), strict=True):
            q.copy_(p + 0.05 * torch.randn_like(p))
    root = tmp_path_factory.mktemp("transfer")
    moved.save_pretrained(root / "step_1")
    return {k: v.numpy() for k, v in moved.state_dict().items()}, moved, root


def _complete(server, max_tokens: int = 8, **extra) -> dict:
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _post(server, path: str, body: dict | None = None, **params) -> httpx.Response:
    """A POST declared JSON, with a body or without (the server refuses any other)."""
    headers = {**auth(), "content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", json=body, params=params, headers=headers, timeout=60)


def _get(server, path: str) -> httpx.Response:
    return httpx.get(f"{server.url}{path}", headers=auth(), timeout=60)


def _hf_text(model, tokenizer, max_tokens: int = 8) -> str:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(PROMPT) :], skip_special_tokens=True)


def _stream_tokens(server, max_tokens: int, seen: list) -> dict:
    """A streamed completion; each chunk's arrival time into `seen`; the last choice."""
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    last, text = None, ""
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=auth(),
                      timeout=60) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                seen.append(time.monotonic())
                text += choice["text"]
                last = choice
    return {**last, "text": text}


def test_pause_modes_and_resume(server):
    want = _complete(server, 30)["text"]
    pool = concurrent.futures.ThreadPoolExecutor(4)
    # abort (the default): what runs ends now, with finish_reason "abort"
    seen: list = []
    running = pool.submit(_stream_tokens, server, 400, seen)
    while len(seen) < 3:
        time.sleep(0.01)
    assert _post(server, "/pause").json() == {"status": "paused"}
    assert running.result(timeout=30)["finish_reason"] == "abort"
    assert _get(server, "/is_paused").json() == {"is_paused": True}
    ready = httpx.get(f"{server.url}/ready")  # a paused server takes no traffic
    assert ready.status_code == 503 and ready.json()["paused"] is True
    waiting = pool.submit(_complete, server)  # new requests wait while paused
    time.sleep(0.4)
    assert not waiting.done()
    assert _post(server, "/resume").json() == {"status": "resumed"}
    assert waiting.result(timeout=30)["finish_reason"] == "length"
    assert httpx.get(f"{server.url}/ready").status_code == 200
    # wait: the pause returns once what runs has finished, untouched
    seen = []
    running = pool.submit(_stream_tokens, server, 30, seen)
    while len(seen) < 3:
        time.sleep(0.01)
    assert _post(server, "/pause", mode="wait").status_code == 200
    assert running.done() and running.result()["text"] == want
    _post(server, "/resume")
    # keep: what runs stops in place and continues on resume, with the same tokens
    seen = []
    running = pool.submit(_stream_tokens, server, 30, seen)
    while len(seen) < 3:
        time.sleep(0.01)
    assert _post(server, "/pause", mode="keep").status_code == 200
    time.sleep(0.2)
    stalled = len(seen)
    time.sleep(0.4)
    assert len(seen) == stalled and not running.done()
    _post(server, "/resume")
    done = running.result(timeout=30)
    assert done["finish_reason"] == "length" and done["text"] == want
    assert _post(server, "/pause", mode="nope").status_code == 400


def test_sleep_and_wake_up(server):
    want = _complete(server)["text"]
    assert _post(server, "/sleep", level=1).status_code == 200
    assert _get(server, "/is_sleeping").json() == {"is_sleeping": True}
    assert _post(server, "/wake_up").status_code == 200
    assert _get(server, "/is_sleeping").json() == {"is_sleeping": False}
    assert _complete(server)["text"] == want
    assert _post(server, "/sleep", level=3).status_code == 400


@pytest.mark.parametrize("backend", ["shm", "dir"])
def test_weight_transfer_gives_the_new_weights_output(server, tiny_model, new_weights, backend):
    from jaxserve.transformers_utils.tokenizer import read_tokenizer

    state, moved, root = new_weights
    tokenizer = read_tokenizer(tiny_model[2])
    before = _complete(server)["text"]
    if backend == "shm":
        names = list(state)
        size = sum(state[n].nbytes for n in names)
        shm = shared_memory.SharedMemory(create=True, size=size)
        offset = 0
        for n in names:
            view = np.ndarray(state[n].shape, state[n].dtype, shm.buf, offset)
            view[...] = state[n]
            offset += state[n].nbytes
            del view
        init = {"backend": "shm"}
        update = {"shm_name": shm.name, "names": names,
                  "dtype_names": [str(state[n].dtype) for n in names],
                  "shapes": [list(state[n].shape) for n in names]}  # fmt: skip
    else:
        init, update = {"backend": "dir", "path": str(root)}, {"path": "step_1"}
    try:
        assert _post(server, "/init_weight_transfer_engine", {"init_info": init}).status_code == 200
        assert _post(server, "/start_weight_update", {"is_checkpoint_format": True}).is_success
        r = _post(server, "/update_weights", {"update_info": update})
        assert r.status_code == 200, r.text
        r = _post(server, "/finish_weight_update")
        assert r.status_code == 200 and r.json()["copied"] > 0, r.text
    finally:
        if backend == "shm":
            shm.close()
            shm.unlink()
    after = _complete(server)["text"]
    assert after == _hf_text(moved, tokenizer) and after != before
    # back to the served model's own weights (the other tests' reference)
    assert _post(server, "/init_weight_transfer_engine",
                 {"init_info": {"backend": "dir", "path": tiny_model[0]}}).is_success  # fmt: skip
    _post(server, "/start_weight_update")
    assert _post(server, "/update_weights", {"update_info": {"path": "."}}).is_success
    assert _post(server, "/finish_weight_update").is_success
    assert _complete(server)["text"] == before


def test_bad_transfers_are_400s_naming_the_value(server):
    r = _post(server, "/init_weight_transfer_engine", {"init_info": {"backend": "nccl"}})
    assert r.status_code == 400 and "nccl" in r.text
    assert _post(server, "/update_weights", {}).status_code == 400
    _post(server, "/init_weight_transfer_engine", {"init_info": {"backend": "shm"}})
    _post(server, "/start_weight_update")
    r = _post(
        server,
        "/update_weights",
        {"update_info": {"shm_name": "nope", "names": [], "dtype_names": [], "shapes": []}},
    )
    assert r.status_code == 400 and "nope" in r.text
    r = _post(server, "/finish_weight_update")
    assert r.status_code == 400 and "no weights" in r.text
    assert _complete(server)["finish_reason"] == "length"  # the engine serves on


def test_collective_rpc_and_world_size(server):
    r = _post(server, "/collective_rpc", {"method": "max_step_tokens"})
    assert r.status_code == 200 and isinstance(r.json()["results"][0], int)
    r = _post(server, "/collective_rpc", {"method": "_private"})
    assert r.status_code == 400 and "_private" in r.text
    # what would reallocate the KV cache: refused, and the engine serves on
    r = _post(server, "/collective_rpc", {"method": "initialize_kv_cache", "args": [1]})
    assert r.status_code == 400 and "'initialize_kv_cache' is not a runner method" in r.text
    r = _post(server, "/collective_rpc", {"method": "max_step_tokens", "timeout": -1})
    assert r.status_code == 400 and "'timeout'" in r.json()["error"]
    assert _complete(server)["finish_reason"] == "length"
    assert _get(server, "/get_world_size").json() == {"world_size": 1}
