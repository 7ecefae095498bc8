"""The compiled serving steps read every weight and the KV cache where they lie: in the optimised
HLO of each forward and sampling executable (CPU), no weight parameter and no KV cache buffer
is copied or transposed, and no weight is sliced (a slice or gather of the embedding table is
the token lookup, and one of the KV cache is attention reading its blocks)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.models.loader import load_model
from jaxserve.worker.model_runner import ModelRunner
from tests.helpers import make_tiny_hf

COPIES = ("copy", "transpose")
SLICES = ("slice", "dynamic-slice")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*?)\)(.*)$")


def parse_hlo(text: str) -> tuple[dict, str]:
    """{computation: {instruction: (opcode, operands, attributes, shape)}}, entry name."""
    computations, current, entry = {}, None, None
    for line in text.splitlines():
        if m := _COMPUTATION.match(line):
            current = m.group(2)
            computations[current] = {}
            entry = current if m.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current and (m := _INSTRUCTION.match(line)):
            name, shape, op, args, attrs = m.groups()
            operands = args if op == "parameter" else re.findall(r"%([\w.\-]+)", args)
            computations[current][name] = (op, operands, attrs, shape)
    return computations, entry


def copies_of(text: str, watched, slice_ok=lambda name: False) -> list[str]:
    """Copy / transpose / slice instructions whose operand is (a view of) an entry parameter
    whose argument name (op_name: "params[3]", "kv_caches[0]", "head") `watched` accepts
    (slices of those `slice_ok` accepts excepted), followed through fusions, tuples and while
    loops."""
    computations, entry = parse_hlo(text)
    found: list[str] = []

    def walk(comp: str, tainted: dict) -> None:
        # tainted: instruction -> True (an array derived from a watched parameter, "slice_ok"
        # for one that may be sliced) or the set of tainted element indices of a tuple.
        for name, (op, operands, attrs, shape) in computations[comp].items():
            if op == "parameter":
                arg = re.search(r'op_name="([^"]+)"', attrs)
                if comp == entry and arg and watched(arg.group(1)):
                    tainted[name] = "slice_ok" if slice_ok(arg.group(1)) else True
                continue
            hit = [o for o in operands if tainted.get(o) in (True, "slice_ok")]
            strict = [o for o in hit if tainted[o] is True]
            if (op in COPIES and hit) or (op in SLICES and strict):
                found.append(f"{comp}: {op} {name} {shape} of {hit}")
            elif op in ("bitcast", "reshape") and hit:
                tainted[name] = tainted[hit[0]]
            elif op == "tuple":
                elements = {i: tainted[o] for i, o in enumerate(operands) if o in hit}
                tainted[name] = elements or tainted.get(name, {})
            elif op == "get-tuple-element":
                i = int(re.search(r"index=(\d+)", attrs).group(1))
                element = (tainted.get(operands[0]) or {}).get(i)
                if element is not None:
                    tainted[name] = element
            elif op == "fusion" and hit:
                callee = re.search(r"calls=%([\w.\-]+)", attrs).group(1)
                params = {
                    int(o): n for n, (p_op, o, *_) in computations[callee].items()
                    if p_op == "parameter"
                }  # fmt: skip
                walk(callee, {params[i]: tainted[o] for i, o in enumerate(operands) if o in hit})
            elif op == "while" and tainted.get(operands[0]):
                body = re.search(r"body=%([\w.\-]+)", attrs).group(1)
                param = next(n for n, v in computations[body].items() if v[0] == "parameter")
                walk(body, {param: dict(tainted[operands[0]])})

    walk(entry, {})
    return found


def test_the_detector_finds_the_copies_lax_scan_makes():
    """Stacked [L, D, D] weights under lax.scan: XLA:CPU slices each layer's weight out."""

    def forward(w, x):
        return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0]

    w, x = jnp.ones((4, 64, 64)), jnp.ones((1, 64))
    weights = lambda name: name.startswith("w")  # noqa: E731
    assert copies_of(jax.jit(forward).lower(w, x).compile().as_text(), weights)
    unrolled = jax.jit(lambda ws, x: [x := jnp.tanh(x @ wl) for wl in ws][-1])
    assert not copies_of(unrolled.lower(list(w), x).compile().as_text(), weights)


@pytest.fixture(scope="module", params=["tied", "untied"])
def runner(request, tmp_path_factory):
    model_dir = make_tiny_hf(
        "llama", tmp_path_factory.mktemp("hf"), tie_word_embeddings=request.param == "tied"
    )
    args = EngineArgs(str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=4,
                      max_num_batched_tokens=16, num_gpu_blocks_override=64)  # fmt: skip
    config = args.create_engine_config()
    with pytest.MonkeyPatch.context() as mp:
        # tied: every step shape's HLO is read; untied, the coarse buckets' (envs.py)
        mp.setenv("JAXSERVE_MINIMAL_COMPILE", "0" if request.param == "tied" else "1")
        runner = ModelRunner(load_model(model_dir, dtype="float32"), config)
    runner.initialize_kv_cache(64)
    runner.compile_all()
    return runner


def test_forward_reads_weights_and_kv_cache_in_place(runner):
    table = runner.model.embed_tokens.embedding[...]
    lookup = f"params[{next(i for i, p in enumerate(runner.params) if p is table)}]"
    forwards = {key: c for key, c in runner.executables.items() if key[0] == "forward"}
    assert sorted(forwards) == [("forward", t, False) for t in runner.buckets.tokens]
    for key, compiled in forwards.items():
        found = copies_of(
            compiled.as_text(), lambda name: name.startswith(("params[", "kv_caches[")),
            lambda name: name == lookup or name.startswith("kv_caches["),
        )  # fmt: skip
        assert found == [], key


def test_sampling_reads_the_lm_head_in_place(runner):
    for key, compiled in runner.executables.items():
        if key[0] == "sample":
            assert copies_of(compiled.as_text(), lambda name: name == "head") == [], key
