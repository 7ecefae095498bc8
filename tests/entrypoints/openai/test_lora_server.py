"""LoRA adapters over HTTP: `jaxserve serve --enable-lora --lora-modules` on a tiny model with
two random PEFT adapters (one server for the module, with JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING):
/v1/models lists them, a request naming one runs it, adapters load and unload at run time
with vLLM's answers, /metrics has lora_requests_info. Without an engine: the --lora-modules
flag's forms and errors, the start-up checks, and the load route absent without the env."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from starlette.testclient import TestClient

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.cli import parse_args
from jaxserve.entrypoints.cli_args import engine_args_from
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.server_setup import check_server_args
from jaxserve.entrypoints.openai.serving_models import LoRAModulePath
from tests.engine.test_kv_transfer_params import FakeCore, config
from tests.entrypoints.openai.test_api_server import Server
from tests.helpers import make_tiny_adapter, make_tiny_hf, make_tiny_tokenizer

BASE = "tiny-base"
ADAPTERS = ("alpha", "beta")  # --lora-modules
RUNTIME_ENV = {"JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"}
BAD_TENSOR = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
FLAGS = ["--served-model-name", BASE, "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--max-model-len", "128", "--num-gpu-blocks-override", "64"]  # fmt: skip
# Greedy, a fixed length, the sampled token ids in logprobs.tokens ("token_id:N").
GREEDY = {"prompt": "Hello, adapters", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
          "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    """The tiny base model (byte tokenizer) and its adapters: alpha, beta (--lora-modules),
    gamma (loaded at run time), a copy of gamma whose config says rank 64, and copies of
    gamma with bad weights: a tensor of the wrong shape, one with a NaN, a file that is no
    safetensors file."""
    root = tmp_path_factory.mktemp("lora")
    model = root / "base"
    vocab = make_tiny_tokenizer(model)
    make_tiny_hf("llama", model, vocab_size=vocab)
    out = {"model": model}
    for seed, name in enumerate(("alpha", "beta", "gamma"), start=1):
        out[name] = make_tiny_adapter(model, root / name, r=8, seed=seed)
    out["rank64"] = shutil.copytree(out["gamma"], root / "rank64")
    config_file = out["rank64"] / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "r": 64}))
    for name, change in (("shape", lambda t: t[:, :-1]), ("nan", lambda t: t * np.nan)):
        out[name] = shutil.copytree(out["gamma"], root / name)
        weights = load_file(out[name] / "adapter_model.safetensors")
        weights[BAD_TENSOR] = np.ascontiguousarray(change(weights[BAD_TENSOR]))
        save_file(weights, out[name] / "adapter_model.safetensors")
    out["garbage"] = shutil.copytree(out["gamma"], root / "garbage")
    (out["garbage"] / "adapter_model.safetensors").write_bytes(b"\x07" * 1000)
    return out


@pytest.fixture(scope="module")
def server(paths):
    modules = [
        f"alpha={paths['alpha']}",
        json.dumps({"name": "beta", "path": str(paths["beta"]), "base_model_name": BASE}),
    ]
    s = Server(str(paths["model"]), "--enable-lora", "--max-loras", "2", "--lora-modules",
               *modules, env=RUNTIME_ENV, defaults=FLAGS)  # fmt: skip
    yield s
    s.stop()


def complete(server: Server, model: str, **body) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/completions", json={"model": model, **GREEDY, **body}, timeout=120
    )


def token_ids(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)


# ---------------------------------------------------------------------- one server
def test_models_lists_the_base_model_and_each_adapter_with_its_parent(server, paths):
    cards = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [BASE, *ADAPTERS]
    base, *adapters = cards
    assert base["max_model_len"] == 128 and base["root"] == str(paths["model"])
    for card in adapters:
        assert card["object"] == "model" and card["owned_by"] == "jaxserve"
        assert card["parent"] == BASE and card["root"] == str(paths[card["id"]])
        assert isinstance(card["created"], int)


def test_a_request_naming_an_adapter_runs_it(server):
    base = token_ids(complete(server, BASE))
    alpha = complete(server, "alpha")
    assert alpha.json()["model"] == "alpha"
    assert token_ids(alpha) != base
    assert token_ids(complete(server, "beta")) != token_ids(alpha)
    assert token_ids(complete(server, BASE)) == base  # the base model is untouched
    chat = post(server, "chat/completions", {
        "model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "temperature": 0})  # fmt: skip
    assert chat.status_code == 200 and chat.json()["model"] == "beta"
    choice = complete(server, "alpha", guided_choice=["yes", "no"], logprobs=None)
    assert choice.status_code == 200 and choice.json()["choices"][0]["text"] in ("yes", "no")


def test_an_adapter_is_refused_by_the_embeddings_api_and_unknown_names_are_404(server):
    r = post(server, "embeddings", {"model": "alpha", "input": "hi"})
    assert r.status_code == 400 and "LoRA adapter" in r.json()["error"]["message"]
    assert complete(server, "no-such-adapter").status_code == 404


def test_runtime_load_and_unload(server, paths):
    r = post(server, "load_lora_adapter", {"lora_name": "gamma", "lora_path": str(paths["gamma"])})
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'gamma' added successfully."
    assert r.headers["content-type"].startswith("text/plain")
    ids = [c["id"] for c in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert ids == [BASE, *ADAPTERS, "gamma"]
    gamma = token_ids(complete(server, "gamma"))
    assert gamma != token_ids(complete(server, BASE))
    # loaded at run time = served from the start: alpha's directory under another name
    r = post(server, "load_lora_adapter", {"lora_name": "alpha2", "lora_path": str(paths["alpha"])})
    assert r.status_code == 200 and token_ids(complete(server, "alpha2")) == token_ids(
        complete(server, "alpha")
    )
    assert post(server, "unload_lora_adapter", {"lora_name": "alpha2"}).status_code == 200

    for body, status, says in (
        ({"lora_name": "delta", "lora_path": str(paths["model"] / "nothing")}, 404, "no LoRA"),
        ({"lora_name": "delta", "lora_path": str(paths["rank64"])}, 400, "max_lora_rank 16"),
        ({"lora_name": "gamma", "lora_path": str(paths["beta"])}, 400, "already been loaded"),
        ({"lora_name": BASE, "lora_path": str(paths["beta"])}, 400, "already been loaded"),
    ):
        r = post(server, "load_lora_adapter", body)
        assert r.status_code == status, r.text
        assert says in r.json()["error"]["message"] and r.json()["error"]["code"] == status

    r = post(server, "unload_lora_adapter", {"lora_name": "gamma"})
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'gamma' removed successfully."
    assert complete(server, "gamma").status_code == 404
    assert "gamma" not in [c["id"] for c in httpx.get(f"{server.url}/v1/models").json()["data"]]
    r = post(server, "unload_lora_adapter", {"lora_name": "gamma"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]

    # Loaded again (a new lora_int_id): the same weights, the same tokens.
    r = post(server, "load_lora_adapter", {"lora_name": "gamma", "lora_path": str(paths["gamma"])})
    assert r.status_code == 200
    assert token_ids(complete(server, "gamma")) == gamma


@pytest.mark.parametrize(
    "adapter, says",
    [
        ("shape", f"tensor '{BAD_TENSOR}' has shape (8, 127), expected (8, 128)"),
        ("nan", f"tensor '{BAD_TENSOR}' holds NaN or infinite values"),
        ("garbage", "corrupt safetensors file"),
    ],
)
def test_an_adapter_with_bad_weights_is_refused_at_load_and_never_listed(
    server, paths, adapter, says
):
    r = post(server, "load_lora_adapter", {"lora_name": adapter, "lora_path": str(paths[adapter])})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"LoRA adapter '{adapter}' cannot be loaded" in message and says in message
    assert adapter not in [c["id"] for c in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert complete(server, adapter).status_code == 404
    assert token_ids(complete(server, "alpha"))  # the others still serve


def test_metrics_report_lora_requests_info(server):
    token_ids(complete(server, "alpha"))
    text = httpx.get(f"{server.url}/metrics").text
    samples = re.findall(r"^vllm:lora_requests_info\{([^}]*)\} (\S+)$", text, re.M)
    assert samples, text[-2000:]
    labels = [dict(re.findall(r'(\w+)="([^"]*)"', s)) for s, _ in samples]
    assert all(lab["max_lora"] == "2" for lab in labels)
    assert {"running_lora_adapters", "waiting_lora_adapters"} <= set(labels[0])
    assert any("alpha" in lab["running_lora_adapters"].split(",") for lab in labels)
    assert all(float(value) > 1e9 for _, value in samples)  # a time, as vLLM's


# ---------------------------------------------------------------------- no engine
def test_lora_flags_and_both_forms_of_lora_modules():
    module_b = ' {"name": "b", "path": "/b", "base_model_name": "m"}'
    args = parse_args(["serve", "m", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
                       "--max-cpu-loras", "4", "--lora-dtype", "bfloat16", "--lora-modules",
                       "a=/adapters/a", module_b])  # fmt: skip
    assert args.lora_modules == [LoRAModulePath("a", "/adapters/a"), LoRAModulePath("b", "/b", "m")]
    e = engine_args_from(args)
    lora = (e.enable_lora, e.max_loras, e.max_lora_rank, e.max_cpu_loras, e.lora_dtype)
    assert lora == (True, 3, 32, 4, "bfloat16")
    defaults = engine_args_from(parse_args(["serve", "m"]))
    assert (defaults.enable_lora, defaults.max_loras, defaults.max_lora_rank) == (False, 1, 16)


@pytest.mark.parametrize(
    "value, says",
    [
        ("just-a-name", "name=path"),
        ("=/path", "both a name and a path"),
        ('{"name": "a"}', "missing required field `path`"),
        ('{"name": "a", "path": "/p", "rank": 8}', "unknown field `rank`"),
        ('{"name": "a", "path": ', "name=path"),
    ],
)
def test_a_malformed_lora_module_is_an_error_naming_it(capsys, value, says):
    with pytest.raises(SystemExit):
        parse_args(["serve", "m", "--enable-lora", "--lora-modules", value])
    err = capsys.readouterr().err
    assert "--lora-modules" in err and value in err and says in err


def test_lora_modules_without_enable_lora_is_an_error_naming_both(capsys):
    with pytest.raises(SystemExit):
        parse_args(["serve", "m", "--lora-modules", "a=/p"])
    err = capsys.readouterr().err
    assert "--lora-modules" in err and "--enable-lora" in err


def test_start_up_refuses_a_bad_adapter_before_loading_the_model(tmp_path, monkeypatch):
    adapter = tmp_path / "a"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"r": 32, "target_modules": ["q_proj"]})
    )
    (adapter / "adapter_model.safetensors").write_bytes(b"")

    def check(*flags: str) -> str:
        with pytest.raises(SystemExit) as e:
            check_server_args(parse_args(["serve", "m", "--enable-lora", *flags]))
        return str(e.value)

    assert "greater than max_lora_rank 16" in check("--lora-modules", f"a={adapter}")
    assert "does not exist" in check("--lora-modules", f"a={tmp_path / 'missing'}")
    ok = ["--max-lora-rank", "32", "--lora-modules", f"a={adapter}"]
    assert "given twice" in check(*ok, f"a={adapter}")
    assert "the served model's name" in check(*ok, f"m={adapter}")
    check_server_args(parse_args(["serve", "m", "--enable-lora", *ok]))
    monkeypatch.setenv("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert "--api-server-count" in check("--api-server-count", "2")


@pytest.mark.parametrize("env", [None, "0", "1"])
def test_the_runtime_routes_exist_only_with_the_env(monkeypatch, env):
    if env is None:
        monkeypatch.delenv("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING", env)
    engine = AsyncLLM(config(), FakeCore(), tokenizer=None)  # no --enable-lora
    app = build_app(engine, ["m"], log_stats_interval=None)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"lora_name": "a", "lora_path": "/a"}
            return [await client.post(f"/v1/{op}_lora_adapter", json=body)
                    for op in ("load", "unload")]  # fmt: skip

    try:
        load, unload = asyncio.run(main())
    finally:
        engine.shutdown()
        app.state.cpu.shutdown(wait=False)
    if env != "1":
        assert load.status_code == unload.status_code == 404
        assert "does not exist" in load.json()["error"]["message"]
    else:
        assert load.status_code == 400 and "--enable-lora" in load.json()["error"]["message"]
        assert unload.status_code == 404


class BadAdapterCore(FakeCore):
    """Its engine refuses every adapter, as an engine refuses bad weights."""

    async def call_utility_async(self, method: str, *args):
        assert method == "add_lora"
        raise RuntimeError(f"ValueError: adapter {args[0].lora_path!r}: tensor 'x' holds NaN")


def test_start_up_stops_on_an_adapter_with_bad_weights():
    engine_config = config()
    engine_config.lora = SimpleNamespace(max_lora_rank=16)  # --enable-lora
    engine = AsyncLLM(engine_config, BadAdapterCore())
    app = build_app(engine, ["m"], log_stats_interval=None,
                    lora_modules=[LoRAModulePath("a", "/adapters/a")])  # fmt: skip
    says = "--lora-modules a: .*'/adapters/a': tensor 'x'"
    with pytest.raises(ValueError, match=says), TestClient(app):
        pass
