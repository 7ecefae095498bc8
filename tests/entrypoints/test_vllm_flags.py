"""A vLLM launch line on `jaxserve serve`: every flag of `vllm serve` 0.32.0
(jaxserve/entrypoints/vllm_serve_flags.json, read from vLLM's parser once) is implemented,
accepted with no effect, or refused by name with its reason, never "unrecognized arguments";
vLLM's spellings (underscores, dotted config keys, -O3, --config YAML) and its environment
variables (VLLM_API_KEY first) mean what they mean to vLLM."""

from __future__ import annotations

import json
import pathlib

import pytest

from jaxserve import envs
from jaxserve.entrypoints.cli import build_parser, parse_args
from jaxserve.entrypoints.vllm_flags import AT_DEFAULT, NO_OP, vllm_flags

DOCS = pathlib.Path(__file__).parents[2] / "docs"


def serve_parser():
    return build_parser()._subparsers._group_actions[0].choices["serve"]


def parse(*argv: str, capsys=None):
    """(namespace, None) or (None, the parser's error message)."""
    try:
        return parse_args(["serve", *argv]), None
    except SystemExit:
        return None, capsys.readouterr().err if capsys else "error"


def given(flag: dict) -> list[str]:
    """A value for the flag: vLLM's default where it is plain, else a sample."""
    if flag["kind"] in ("bool", "switch"):
        return []
    default = flag["default"]
    if default is None:
        return ["1"]
    if isinstance(default, list):
        return [str(v) for v in default] or ["[]"] if flag["kind"] == "values" else ["[]"]
    return [default if isinstance(default, str) else json.dumps(default)]


@pytest.mark.parametrize("flag", vllm_flags(), ids=lambda f: f["flags"][0])
def test_every_vllm_flag_is_parsed_or_refused_by_name(flag, capsys):
    for name in flag["flags"]:
        values = [] if name.startswith("--no-") else given(flag)
        args, error = parse(name, *values, capsys=capsys)
        assert error is None or "unrecognized arguments" not in error, error
        if error is not None:  # refused: the flag named, with a reason
            assert name in error or name.lstrip("-") in error, error
        at_default = flag["default"] is not None and flag["kind"] not in ("bool", "switch")
        if at_default and flag["dest"] in AT_DEFAULT:
            assert error is None, f"{name} at vLLM's default {values} refused: {error}"
        if flag["dest"] in NO_OP:
            assert error is None, error
            assert (name, NO_OP[flag["dest"]]) in args.vllm_ignored_flags


def test_the_tables_name_only_vllm_flags_jaxserve_lacks():
    """A stale entry (a flag jaxserve implements now, or vLLM dropped) fails here; a new vLLM
    flag in neither table fails build_parser (a KeyError) once the JSON is regenerated."""
    own = {
        action.dest
        for action in serve_parser()._actions
        if not action.dest.startswith("vllm_") and action.option_strings
    }
    dests = {flag["dest"] for flag in vllm_flags()}
    for table in (NO_OP, AT_DEFAULT):
        assert set(table) <= dests - own, set(table) - (dests - own)
    assert not set(NO_OP) & set(AT_DEFAULT)


def test_a_feature_jaxserve_lacks_is_refused_naming_flag_value_and_reason(capsys):
    _, error = parse("--model-impl", "transformers", capsys=capsys)
    assert "--model-impl transformers: not supported by jaxserve: " in error
    _, error = parse("--enable-eplb", capsys=capsys)
    assert "--enable-eplb: not supported by jaxserve: jaxserve places experts once" in error
    args, _ = parse("--no-enable-eplb", "--tokenizer-mode", "auto", "--cpu-offload-gb", "0")
    assert args is not None and not args.vllm_ignored_flags


def test_a_vllm_launch_line_parses_with_vllm_spellings():
    args, error = parse(
        "--enforce-eager", "--enable-chunked-prefill", "--max_model_len", "2048",
        "--root-path", "/llm", "--structured-outputs-config.backend", "xgrammar", "-O3",
        "--gpu_memory_utilization=0.5", "-asc", "1", "--no-enable-prefix-caching",
        "--hf-overrides.num_hidden_layers", "2", "--api-key", "k1", "k2", "--dtype", "half",
    )  # fmt: skip
    assert error is None
    assert (args.max_model_len, args.root_path, args.gpu_memory_utilization) == (2048, "/llm", 0.5)
    assert args.structured_outputs_config == {"backend": "xgrammar"}
    assert json.loads(args.hf_overrides) == {"num_hidden_layers": 2}
    assert args.api_key == ["k1", "k2"] and args.enable_prefix_caching is False
    assert args.dtype == "float16"
    ignored = [flag for flag, _ in args.vllm_ignored_flags]
    assert ignored == ["--enforce-eager", "--enable-chunked-prefill", "--optimization-level"]


def test_a_config_file_gives_flags_the_command_line_overrides(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("max_model_len: 1024\nenforce_eager: true\nmax-num-seqs: 4\nseed: 3\n")
    args, error = parse("--config", str(config), "--seed", "7")
    assert error is None
    assert (args.max_model_len, args.max_num_seqs, args.seed) == (1024, 4, 7)
    assert args.vllm_ignored_flags[0][0] == "--enforce-eager"


def test_structured_outputs_backends_and_max_logprobs_past_the_vocabulary(capsys):
    for backend in ("auto", "guidance", "xgrammar", "outlines", "lm-format-enforcer"):
        assert parse(f"--structured-outputs-config.backend={backend}")[1] is None
    _, error = parse("--structured-outputs-config", '{"backend": "nope"}', capsys=capsys)
    assert "backend 'nope'" in error
    args, _ = parse("--max-logprobs", "1000000")
    assert args.max_logprobs == 1000000  # the engine: the vocabulary (test_arg_utils.py)


def test_vllm_environment_variables_are_read_when_jaxserve_s_are_unset(monkeypatch):
    for name in ("JAXSERVE_API_KEY", "VLLM_API_KEY", "JAXSERVE_LOG_LEVEL", "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    assert envs.JAXSERVE_API_KEY is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert (envs.JAXSERVE_API_KEY, envs.JAXSERVE_LOG_LEVEL) == ("from-vllm", "DEBUG")
    monkeypatch.setenv("JAXSERVE_API_KEY", "own")
    assert envs.JAXSERVE_API_KEY == "own"


def test_the_docs_list_every_vllm_twin_and_every_no_op_flag():
    variables = (DOCS / "environment_variables.md").read_text()
    for theirs in envs.VLLM_NAMES.values():
        assert f"`{theirs}`" in variables, theirs
    serving = (DOCS / "serving.md").read_text()
    names = {f["dest"]: f["flags"][0] for f in vllm_flags()}
    missing = [names[dest] for dest in list(NO_OP) + list(AT_DEFAULT) if names[dest] not in serving]
    assert not missing, missing
