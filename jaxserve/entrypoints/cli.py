"""The `jaxserve` command line."""

from __future__ import annotations

import argparse
import logging

from jaxserve import __version__


def _convert(args: argparse.Namespace) -> int:
    from jaxserve.models.loader import convert

    dst = convert(args.src, args.dst, dtype=args.dtype)
    print(f"wrote jaxserve checkpoint to {dst}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"jaxserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    conv = sub.add_parser(
        "convert",
        help="convert a HF directory or GGUF file into a jaxserve (orbax) checkpoint",
    )
    conv.add_argument("src", help="HF model directory or .gguf file ('default': bundled model)")
    conv.add_argument("dst", help="output directory (must not hold a checkpoint already)")
    conv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    conv.set_defaults(func=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
    args = build_parser().parse_args(argv)
    if getattr(args, "src", None) == "default":
        args.src = None
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
