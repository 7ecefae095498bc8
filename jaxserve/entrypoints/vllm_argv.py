"""vLLM's command-line spellings as jaxserve's parser takes them (`normalize_argv`, cli.py):
`--max_model_len` for `--max-model-len`, `--structured-outputs-config.backend guidance` for a
JSON config's key, `-O3` for `--optimization-level 3`, `--config FILE.yaml` for the flags in
a file."""

from __future__ import annotations

import json
import re
from typing import Any

_DASHED = re.compile(r"^--[^=.]+")


def normalize_argv(argv: list[str]) -> list[str]:
    """vLLM's spellings as jaxserve's parser takes them: underscores in a flag's name as
    dashes, `--cfg.key[.sub] VALUE` (or `=VALUE`) merged into one `--cfg JSON`, `-O3` /
    `-O 3` as `--optimization-level 3`, and `--config FILE` (YAML) as the flags it holds,
    before those given on the line."""
    argv = _expand_config(argv)
    out: list[str] = []
    dotted: dict[str, dict] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg.startswith("--"):
            arg = _DASHED.sub(lambda m: m.group(0).replace("_", "-"), arg)
            name = arg.split("=", 1)[0]
            if "." in name:  # --structured-outputs-config.backend guidance
                if "=" in arg:
                    value = arg.split("=", 1)[1]
                elif i < len(argv):
                    value, i = argv[i], i + 1
                else:
                    raise ValueError(f"{name} needs a value")
                key, *path = name.split(".")
                _set_path(dotted.setdefault(key, {}), path, json_or_str(value))
                continue
        elif re.fullmatch(r"-O=?\w+", arg):
            out += ["--optimization-level", arg[2:].lstrip("=")]
            continue
        out.append(arg)
    for key, value in dotted.items():
        out += [key, json.dumps(value)]
    return out


def _set_path(target: dict, path: list[str], value: Any) -> None:
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value


def json_or_str(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def _expand_config(argv: list[str]) -> list[str]:
    """`--config FILE`: the YAML mapping's keys as flags (`max_model_len: 2048` ->
    `--max-model-len 2048`, `true` -> the bare flag, a list -> its values), placed right after
    the subcommand and its model, so that flags on the line override the file's."""
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    rest: list[str] = []
    path = None
    i = 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
        elif argv[i].startswith("--config="):
            path, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: expected a YAML mapping of flags, got {config!r}")
    flags: list[str] = []
    for key, value in config.items():
        name = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(name)
        elif value is False:
            flags.append("--no-" + name[2:])
        elif isinstance(value, list):
            flags += [name, *map(str, value)]
        elif isinstance(value, dict):
            flags += [name, json.dumps(value)]
        else:
            flags += [name, str(value)]
    head = 2 if len(rest) > 1 and not rest[1].startswith("-") else 1  # serve [MODEL]
    return rest[:head] + flags + rest[head:]
