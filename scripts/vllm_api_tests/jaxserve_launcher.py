"""vLLM's own OpenAI-API tests against `jaxserve serve`: a pytest plugin, plus `prepare` and
`report` commands for run.sh.

As a plugin (`python -m pytest -p jaxserve_launcher ...`, run from a copy of vLLM's source root
so that `tests` is vLLM's test package, with this folder on PYTHONPATH and vllm installed) it
replaces `tests.utils.RemoteOpenAIServer` by `JaxserveServer`, which starts
`jaxserve serve ARGS --served-model-name MODEL` with the test's flags unchanged (only the model,
the one thing that selects weights, is dropped: jaxserve serves its bundled SmolLM2-135M-Instruct
under the test's model name), so a flag jaxserve lacks fails the test's server fixture. In the
test process every hub model name resolves to a HF directory of the bundled model (its config
and tokenizer, made by `prepare`), every LoRA repository the tests download to a rank-8 adapter
of the bundled model with lora_B = 0 (so adapter and base answer alike), and tests whose fixtures
start no server (they run vLLM's own classes in-process: nothing of jaxserve's is exercised) are
skipped as vLLM-internal. Environment: JAXSERVE_BIN (the jaxserve command), JAXSERVE_API_TEST_DIR
(the folder `prepare` filled; server logs go to its logs/).

`python jaxserve_launcher.py prepare DIR` (with jaxserve's interpreter) writes DIR/model (config +
tokenizer of the bundled model) and DIR/lora (the adapter). `python jaxserve_launcher.py report
JUNIT_DIR OUT_DIR` reads the per-file junit XML files and writes OUT_DIR/summary.md and
summary.json: counts per file and every failure with its first message line and, where
CAUSES below knows the test, its class and cause.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# The LoRA repositories the chosen test files download, served by the bundled model's adapter.
LORA_REPOS = {"typeof/zephyr-7b-beta-lora", "charent/self_cognition_Alice"}

# Tests that need what the bundled model cannot be: skipped with the reason (node id substring).
SKIPS = {
    "-multimodal]": "needs a vision-language model (SmolVLM-256M): the bundled model is text-only",
    "test_translategemma_image_": "needs a vision-language model and an image from the network",
}

# Known failures: node id -> (class, one-line cause). Classes: "model" (depends on the model:
# another vocabulary, BOS, chat template, CPU speed), "vllm" (tests vLLM internals or vLLM-only
# behaviour), "jaxserve" (an incompatibility of jaxserve's). Filled after reading each failure;
# a failure not listed here is reported as "unclassified".
CAUSES: dict[str, tuple[str, str]] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of `flag` in args, given as `flag VALUE` or `flag=VALUE`; None when absent."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _without(args: list[str], flags: set[str]) -> list[str]:
    """args less each of `flags` with its value (`--flag X` or `--flag=X`)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif arg.split("=", 1)[0] not in flags:
            out.append(arg)
    return out


class JaxserveServer:
    """`jaxserve serve` in place of vLLM's RemoteOpenAIServer: the same constructor and the
    attributes and methods vLLM's tests use (host, port, uds, url_root, url_for, get_client,
    get_async_client, get_client_anthropic, get_async_client_anthropic, show_hidden_metrics,
    proc); ready once GET /health answers 200, stopped with SIGTERM to its process group."""

    DUMMY_API_KEY = "token-abc123"
    _count = 0

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict | None = None,
                 seed: int | None = 0, auto_port: bool = True,
                 max_wait_seconds: float | None = None,
                 override_hf_configs: dict | None = None) -> None:  # fmt: skip
        args = list(vllm_serve_args)
        if auto_port and "--uds" not in args:
            args += ["--port", str(_free_port())]
        if seed is not None:
            args += ["--seed", str(seed)]
        if override_hf_configs is not None:
            args += ["--hf-overrides", json.dumps(override_hf_configs)]
        self.uds = _flag_value(args, "--uds")
        self.host = None if self.uds else (_flag_value(args, "--host") or "127.0.0.1")
        self.port = None if self.uds else int(_flag_value(args, "--port") or 8000)
        self.show_hidden_metrics = (
            _flag_value(args, "--show-hidden-metrics-for-version") is not None
        )
        # --model selects weights; JAXSERVE_API_TEST_DROP_FLAGS names flags a run leaves out
        # (run.sh: why --dtype)
        dropped = set(os.environ.get("JAXSERVE_API_TEST_DROP_FLAGS", "").split())
        args = _without(args, {"--model", *dropped})
        if _flag_value(args, "--served-model-name") is None and "--served-model-name" not in args:
            args += ["--served-model-name", model]
        command = [*shlex.split(os.environ.get("JAXSERVE_BIN", "jaxserve")), "serve", *args]
        env = {**os.environ, **(env_dict or {})}  # JAXSERVE_MINIMAL_COMPILE: run.sh's
        for name in ("PYTHONPATH", "VIRTUAL_ENV"):  # the test process's, not jaxserve's
            env.pop(name, None)
        logs = Path(os.environ.get("JAXSERVE_API_TEST_DIR", "/tmp")) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        JaxserveServer._count += 1
        test = os.environ.get("PYTEST_CURRENT_TEST", "server").split("::")[0]
        self.log_path = logs / f"{Path(test).stem}-{JaxserveServer._count}.log"
        self._log = self.log_path.open("w")
        self._log.write("$ " + shlex.join(command) + "\n")
        self._log.flush()
        print(f"[jaxserve launcher] {shlex.join(command)} (log: {self.log_path})")
        self.proc = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        try:
            self._wait(max_wait_seconds or 480)
        except Exception:
            self._shutdown()
            raise

    def _tail(self, lines: int = 25) -> str:
        self._log.flush()
        return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])

    def _wait(self, timeout: float) -> None:
        import httpx

        transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
        deadline = time.monotonic() + timeout
        with httpx.Client(transport=transport, timeout=2) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"jaxserve exited during start-up (rc {self.proc.returncode}):\n"
                        + self._tail()
                    )
                try:
                    if client.get(self.url_for("health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"jaxserve did not start in {timeout} s:\n{self._tail()}")
                time.sleep(0.5)

    def _shutdown(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._shutdown()

    @property
    def url_root(self) -> str:
        return (
            f"http://{self.uds.split('/')[-1]}" if self.uds else f"http://{self.host}:{self.port}"
        )

    def url_for(self, *parts: str) -> str:
        return f"{self.url_root}/" + "/".join(p.strip("/") for p in parts if p)

    def _openai(self, cls, kwargs):
        return cls(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                   **{"timeout": 600, **kwargs})  # fmt: skip

    def get_client(self, **kwargs):
        import openai

        return self._openai(openai.OpenAI, kwargs)

    def get_async_client(self, **kwargs):
        import openai

        return self._openai(openai.AsyncOpenAI, kwargs)

    def get_client_anthropic(self, **kwargs):
        import anthropic

        return anthropic.Anthropic(base_url=self.url_for(), api_key=self.DUMMY_API_KEY,
                                   max_retries=0, **{"timeout": 600, **kwargs})  # fmt: skip

    def get_async_client_anthropic(self, **kwargs):
        import anthropic

        return anthropic.AsyncAnthropic(base_url=self.url_for(), api_key=self.DUMMY_API_KEY,
                                        max_retries=0, **{"timeout": 600, **kwargs})  # fmt: skip


# --- the test process: names resolve to the bundled model ------------------------------------


def _prepared() -> Path:
    return Path(os.environ.get("JAXSERVE_API_TEST_DIR", "/tmp/vllm_api_tests"))


def _local(name):
    """A hub model name as the bundled model's HF directory; paths stay as they are."""
    if name is None or (isinstance(name, (str, os.PathLike)) and os.path.exists(name)):
        return name
    return str(_prepared() / "model")


def _patch_names() -> None:
    import transformers
    import vllm.config.model
    import vllm.model_executor.model_loader.weight_utils as weight_utils
    import vllm.tokenizers
    import vllm.transformers_utils.repo_utils as repo_utils

    get_tokenizer = vllm.tokenizers.get_tokenizer

    def local_tokenizer(tokenizer_name, *args, **kwargs):
        return get_tokenizer(_local(tokenizer_name), *args, **kwargs)

    vllm.tokenizers.get_tokenizer = local_tokenizer
    redirect = vllm.config.model.maybe_model_redirect
    vllm.config.model.maybe_model_redirect = lambda model: redirect(_local(model))
    for cls in (transformers.AutoTokenizer, transformers.AutoConfig):
        original = cls.from_pretrained

        def from_pretrained(_cls, name, *args, _original=original, **kwargs):
            return _original(_local(name), *args, **kwargs)

        cls.from_pretrained = classmethod(from_pretrained)
    weight_utils.download_weights_from_hf = lambda name, *a, **k: _local(name)

    class Hub:
        def snapshot_download(self, repo_id: str, **kwargs) -> str:
            if repo_id in LORA_REPOS:
                return str(_prepared() / "lora")
            raise RuntimeError(f"hub download of {repo_id!r}: no network here (not mapped)")

    repo_utils.hf_api = lambda *a, **k: Hub()


def _starts_server(item) -> bool:
    """Whether the test or a fixture it uses names RemoteOpenAIServer (so it talks to a
    server); the others run vLLM's classes in-process."""
    import inspect

    def names_server(func) -> bool:
        try:
            return "RemoteOpenAIServer" in inspect.getsource(func)
        except (OSError, TypeError):
            return False

    if names_server(getattr(item, "function", None)):
        return True
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info else ():
        if any(names_server(d.func) for d in defs):
            return True
    return False


def pytest_load_initial_conftests(early_config, parser, args) -> None:
    """Before any conftest.py loads: a package's conftest.py (responses/) imports
    RemoteOpenAIServer by name."""
    import tests.utils

    tests.utils.RemoteOpenAIServer = JaxserveServer
    _patch_names()


def pytest_collection_modifyitems(config, items) -> None:
    import pytest

    for item in items:
        reason = next((why for key, why in SKIPS.items() if key in item.nodeid), None)
        if reason is None and not _starts_server(item):
            reason = "vLLM-internal: starts no server (runs vLLM's own classes in-process)"
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


# --- prepare and report ------------------------------------------------------------------------


def prepare(out: Path) -> None:
    """The bundled model as a HF directory (config + tokenizer, no weights) and a LoRA adapter
    for it with lora_B = 0; run with jaxserve's interpreter."""
    import numpy as np
    from safetensors.numpy import save_file

    from jaxserve.transformers_utils.config import gguf_hf_config
    from jaxserve.transformers_utils.model_path import default_model_path
    from jaxserve.transformers_utils.tokenizer import read_tokenizer

    config = gguf_hf_config(default_model_path())
    (out / "model").mkdir(parents=True, exist_ok=True)
    config.to_transformers().save_pretrained(out / "model")
    read_tokenizer(None).save_pretrained(out / "model")
    (out / "lora").mkdir(parents=True, exist_ok=True)
    rank, rng, tensors = 8, np.random.default_rng(0), {}
    kv_out = config.num_key_value_heads * config.head_dim
    for layer in range(config.num_hidden_layers):
        for proj, width in (("q_proj", config.num_attention_heads * config.head_dim),
                            ("v_proj", kv_out)):  # fmt: skip
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = (
                rng.standard_normal((rank, config.hidden_size)).astype(np.float32) * 0.01
            )
            tensors[f"{key}.lora_B.weight"] = np.zeros((width, rank), np.float32)
    save_file(tensors, str(out / "lora" / "adapter_model.safetensors"))
    (out / "lora" / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16,
        "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
    }))  # fmt: skip


def _first_line(text: str) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def report(junit_dir: Path, out: Path) -> None:
    import xml.etree.ElementTree as ET

    rows, failures = [], []
    for path in sorted(junit_dir.glob("*.xml")):
        counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
        for case in ET.parse(path).getroot().iter("testcase"):
            node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if case.find("skipped") is not None and bad is None:
                counts["skipped"] += 1
            elif bad is not None:
                counts["failed" if bad.tag == "failure" else "error"] += 1
                message = bad.get("message") or _first_line(bad.text)
                kind, cause = CAUSES.get(node.split("/")[-1], ("unclassified", ""))
                failures.append({"test": node, "kind": bad.tag, "message": _first_line(message),
                                 "class": kind, "cause": cause})  # fmt: skip
            else:
                counts["passed"] += 1
        rows.append({"file": path.stem.replace("__", "/") + ".py", **counts})
    total = {k: sum(r[k] for r in rows) for k in ("passed", "failed", "skipped", "error")}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(
        {"files": rows, "total": total, "failures": failures}, indent=1))  # fmt: skip
    lines = ["| file | passed | failed | errors | skipped |", "|---|---|---|---|---|"]
    lines += [f"| {r['file']} | {r['passed']} | {r['failed']} | {r['error']} | {r['skipped']} |"
              for r in rows]  # fmt: skip
    lines += [f"| **total** | {total['passed']} | {total['failed']} | {total['error']} | "
              f"{total['skipped']} |", "", "## Failures and errors", ""]  # fmt: skip
    for f in failures:
        lines.append(f"- `{f['test']}` ({f['kind']}, {f['class']}): {f['cause'] or f['message']}")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[: len(rows) + 3]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["prepare"]:
        prepare(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["report"]:
        report(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(__doc__)
