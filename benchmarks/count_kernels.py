"""The kernels one decoder layer of the forward launches on a CUDA GPU, from the optimized HLO
(jaxserve/benchmarks/kernel_count.py): the forward of --model cut to --layers and --layers + 1
decoder layers (dummy weights, loaded on this host), compiled for the local GPU or, with none,
for an H100 with no device (deviceless: jax >= 0.11 with its CUDA plugin, JAX_PLATFORMS=cpu),
and the difference counted by class: gemm, pallas (attention), elementwise (the fusions
between them), control.

    python benchmarks/count_kernels.py --tokens 256 --output-json kernels.json
    JAX_PLATFORMS=cpu python benchmarks/count_kernels.py --tokens 256    # deviceless H100

Prints `# per layer gemm G, pallas P, elementwise E, control C (WHERE; HOW)`
and, with --list, the (L+1)-layer forward's kernels in order.
"""

from __future__ import annotations

import argparse
import json

from jaxserve.benchmarks.kernel_count import count_per_layer
from jaxserve.entrypoints.cli_args import add_engine_args, engine_args_from


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-3-8b", help="a preset or HF config")
    parser.add_argument("--layers", type=int, default=3, help="L (against L + 1; at least 3)")
    parser.add_argument("--tokens", type=int, default=256, help="the forward's token bucket")
    parser.add_argument(
        "--general", action="store_true", help="the general forward (default: decode-only)"
    )
    parser.add_argument("--list", action="store_true", help="print every kernel")
    parser.add_argument(
        "--cpu-ok", action="store_true", help="with no CUDA target, count XLA:CPU's (dry runs)"
    )
    parser.add_argument("--dump-hlo", default=None, help="write the optimized HLO here")
    parser.add_argument("--output-json", default=None)
    add_engine_args(parser)
    parser.set_defaults(
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=512,
        attention_backend="pallas",
    )
    args = parser.parse_args(argv)
    engine_args = engine_args_from(args)
    engine_args.max_num_seqs = max(engine_args.max_num_seqs or 0, args.tokens)
    result = count_per_layer(
        engine_args, args.layers, args.tokens, not args.general, args.cpu_ok, args.dump_hlo
    )
    if args.list:
        for cls, name in result.kernels:
            print(f"  {cls:12s} {name}")
    print(f"# per layer {result.line()}")
    out = dict(
        per_layer=result.per_layer, total=result.total, layers=args.layers, where=result.how,
        tokens=args.tokens, decode_only=not args.general, model=args.model,
    )  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
