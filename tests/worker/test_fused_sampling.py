"""A decode step's forward and sampling as one executable (worker/fused_sampling.py): forced on
CPU (JAXSERVE_FUSED_SAMPLING=1), an engine runs its decode steps through the fused
executables and gives the tokens of the same engine without them, greedy and seeded; steps
the fused samplers do not cover (logprobs, penalties, grammars) run the two executables; and
serving compiles nothing."""

import pytest

from jaxserve.layers.sampler import SamplerVariant
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.worker import fused_sampling
from jaxserve.worker.buckets import BucketTable
from jaxserve.worker.executables import num_compilations
from tests.helpers import drain_engine, engine_with_registry, make_tiny_hf
from tests.worker.test_attention_backend import UsedExecutables

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, dtype="float32")
PROMPTS = [[(5 * i + j) % 200 + 1 for j in range(3 + 4 * i)] for i in range(4)]
REQUESTS = [
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_hf("llama", tmp_path_factory.mktemp("tiny")))


def run(model_dir, monkeypatch, fused: str, requests, structured=None):
    monkeypatch.setenv("JAXSERVE_FUSED_SAMPLING", fused)
    registry = UsedExecutables()
    engine = engine_with_registry(model_dir, registry, **ENGINE)
    compiled = num_compilations()
    for i, (prompt, params) in enumerate(zip(PROMPTS, requests, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finished = drain_engine(engine)
    assert num_compilations() == compiled
    outs = [finished[str(i)].outputs[0] for i in range(len(requests))]
    return outs, registry


def test_decode_steps_run_fused_with_the_same_tokens(model_dir, monkeypatch):
    # alone, the greedy and seeded requests' decode steps run fused
    want, plain = run(model_dir, monkeypatch, "0", REQUESTS[:2] * 2)
    assert not any(n[0] == fused_sampling.NAME for n, _ in plain.items())
    got, registry = run(model_dir, monkeypatch, "1", REQUESTS[:2] * 2)
    used = {n for n in registry.used if n[0] == fused_sampling.NAME}
    assert {n[3] for n in used} == {SamplerVariant(random=True, greedy=True)}, used
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # beside requests that need logprobs and penalties, every step runs unfused
    want, _ = run(model_dir, monkeypatch, "0", REQUESTS)
    got, registry = run(model_dir, monkeypatch, "1", REQUESTS)
    assert not {n for n in registry.used if n[0] == fused_sampling.NAME}
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[2].logprobs == want[2].logprobs


def test_grammar_steps_sample_after_the_bitmask(model_dir, monkeypatch):
    regex = StructuredOutputsParams(regex="(ab|cd)+")
    params = SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=regex)
    want, _ = run(model_dir, monkeypatch, "0", [params] * 4)
    got, registry = run(model_dir, monkeypatch, "1", [params] * 4)
    assert not {n for n in registry.used if n[0] == fused_sampling.NAME}
    assert [o.text for o in got] == [o.text for o in want]


def test_decode_shapes_pair_each_decode_forward_with_its_sample_bucket():
    b = BucketTable.build(max_num_seqs=48, max_num_batched_tokens=256)
    shapes = fused_sampling.decode_shapes(b, b.forward_variants(True))
    assert shapes == {(1, True): 1, (2, True): 2, (4, True): 4, (8, True): 8,
                      (16, True): 16, (32, True): 32, (64, True): 48}  # fmt: skip
    general = fused_sampling.decode_shapes(b, b.forward_variants(False))
    assert general == {(t, False): s for (t, _), s in shapes.items()}


@pytest.mark.parametrize(
    ("setting", "backend", "drafts", "minimal", "want"),
    [("auto", "pallas", False, False, True), ("auto", "cpu", False, False, False),
     ("auto", "pallas", False, True, False), ("1", "cpu", False, True, True),
     ("1", "pallas", True, False, False), ("0", "pallas", False, False, False)],
)  # fmt: skip
def test_when_fused(setting, backend, drafts, minimal, want, monkeypatch):
    monkeypatch.setenv("JAXSERVE_FUSED_SAMPLING", setting)
    got = fused_sampling.enabled(backend, one_stage=True, drafts=drafts, minimal=minimal)
    assert got == want
    assert not fused_sampling.enabled(backend, one_stage=False, drafts=False, minimal=False)
