"""The model runner with attention_backend='pallas' (the kernel, interpreted on CPU) or 'cpu'
(the C++ decode kernel) inside the real compiled step gives the jnp reference's tokens, with
and without tensor parallelism (tp 4 > 2 KV heads: each device holds a copy of the KV head its
query heads use). With pallas, decode-only steps run their own forward, which holds the decode
kernel alone; the others run it for their single-token sequences and the mixed kernel
for the rest."""

import jax
import pytest
from flax import nnx

from jaxserve.entrypoints.llm import LLM
from jaxserve.layers.attention import Attention
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.executables import ExecutableRegistry, num_compilations
from pallas_kernels.paged_attention.cpu import cpu_kernel_unavailable_message
from tests.helpers import drain_engine, engine_with_registry, make_tiny_hf, runner_of
from tests.require import require_or_skip

# head_dim 16 (the kernel's smallest dot), GQA group 4.
SHAPE = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2)
# 16-token steps: prompts are prefilled in chunks that start mid-sequence.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
              num_gpu_blocks_override=48, dtype="float32")  # fmt: skip
PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 250 + 1 for j in range(5 + 9 * i)]}
           for i in range(4)]  # fmt: skip
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def in_process(monkeypatch_module):
    monkeypatch_module.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_hf("llama", tmp_path_factory.mktemp("tiny"), **SHAPE))


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model_dir, attention_backend="reference", **ENGINE)
    return llm.generate(PROMPTS * 2, PARAMS, use_tqdm=False)


def _runner(llm):
    return runner_of(llm)


# 1: the kernel called directly; 4: per device under shard_map, the 2 KV heads replicated, one
# per device (tp 2, whole KV heads per device under the same shard_map, adds no path).
class UsedExecutables(ExecutableRegistry):
    """A registry that records the name of every executable serving looks up."""

    def __init__(self):
        super().__init__()
        self.used: set[tuple] = set()

    def __getitem__(self, name: tuple):
        self.used.add(name)
        return super().__getitem__(name)


@pytest.mark.parametrize("tp", [1, 4])
def test_pallas_backend_gives_the_reference_tokens(model_dir, reference, tp):
    if len(jax.devices()) < tp:
        pytest.skip(f"tensor_parallel_size={tp} needs {tp} devices")
    registry = UsedExecutables()
    engine = engine_with_registry(
        model_dir, registry, attention_backend="pallas", tensor_parallel_size=tp, **ENGINE
    )
    runner = engine.engine_core.engine_core.runner
    modules = [m for _, m in nnx.iter_graph(runner.model)]
    assert {m.backend for m in modules if isinstance(m, Attention)} == {"pallas"}
    # The coarse token buckets (the suite's JAXSERVE_MINIMAL_COMPILE): 4 (max_num_seqs', decode
    # only or mixed) and 16; every other bucket is the same program at another size.
    forwards = {key[1:]: c for key, c in registry.items() if key[0] == "forward"}
    assert sorted(forwards) == [(4, False), (4, True), (16, False)]
    for (t, decode_only), c in forwards.items():
        text = c.as_text()
        assert "ragged_paged_attention_decode" in text, t  # single-token sequences
        assert ("ragged_paged_attention_mixed" in text) != decode_only, t
    compiled = num_compilations()
    for i, prompt in enumerate(PROMPTS * 2):  # 2nd round: prefix-cache hits
        engine.add_request(str(i), prompt, PARAMS)
    finished = drain_engine(engine)
    got = [finished[str(i)] for i in range(len(PROMPTS) * 2)]
    assert {key[2] for key in registry.used if key[0] == "forward"} == {True, False}
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference]
    for g, w in zip(got, reference, strict=True):
        assert g.outputs[0].cumulative_logprob == pytest.approx(
            w.outputs[0].cumulative_logprob, abs=1e-3
        )
    assert num_compilations() == compiled


@pytest.mark.parametrize("tp", [1, 4])
def test_cpu_backend_gives_the_reference_tokens(model_dir, reference, tp):
    """The C++ kernel in every forward (per device under shard_map at tp 4), the reference's
    tokens and logprobs, and no compilation while serving."""
    if len(jax.devices()) < tp:
        pytest.skip(f"tensor_parallel_size={tp} needs {tp} devices")
    require_or_skip(cpu_kernel_unavailable_message())
    llm = LLM(model_dir, attention_backend="cpu", tensor_parallel_size=tp, **ENGINE)
    runner = _runner(llm)
    modules = [m for _, m in nnx.iter_graph(runner.model)]
    assert {m.backend for m in modules if isinstance(m, Attention)} == {"cpu"}
    forwards = [c for key, c in runner.executables.items() if key[0] == "forward"]
    assert forwards and all("jaxserve_paged_attention_decode" in c.as_text() for c in forwards)
    compiled = num_compilations()
    got = llm.generate(PROMPTS * 2, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference]
    for g, w in zip(got, reference, strict=True):
        assert g.outputs[0].cumulative_logprob == pytest.approx(
            w.outputs[0].cumulative_logprob, abs=1e-3
        )
    assert num_compilations() == compiled


# DeepSeek-V3's MLA scaled down to what the kernel tiles (a 32-wide latent, a 16-wide rotary
# key), its experts as test_moe's.
DEEPSEEK = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1)  # fmt: skip


def test_pallas_mla_gives_the_reference_tokens(tmp_path_factory):
    """DeepSeek's latent attention through the Pallas kernels (absorbed form, the latent as
    the values) at tp 2: each device's 2 query heads over its copy of the latent, the
    reference's tokens and logprobs, prefix-cache hits included."""
    if len(jax.devices()) < 2:
        pytest.skip("tensor_parallel_size=2 needs 2 devices")
    path = str(make_tiny_hf("deepseek_v3", tmp_path_factory.mktemp("mla"), **DEEPSEEK))
    prompts, params = PROMPTS[:3] * 2, SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
    want = LLM(path, attention_backend="reference", **ENGINE).generate(prompts, params)
    llm = LLM(path, attention_backend="pallas", tensor_parallel_size=2, **ENGINE)
    forwards = [c for key, c in _runner(llm).executables.items() if key[0] == "forward"]
    assert forwards and all("ragged_paged_attention_decode" in c.as_text() for c in forwards)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].cumulative_logprob == pytest.approx(
            w.outputs[0].cumulative_logprob, abs=1e-3
        )
