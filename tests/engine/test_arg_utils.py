"""EngineArgs -> EngineConfig: defaults, and a ValueError naming each bad argument."""

import pickle

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.arg_utils import CPU_MAX_NUM_BATCHED_TOKENS, CPU_MAX_NUM_SEQS, EngineArgs
from jaxserve.entrypoints.llm import LLM
from pallas_kernels.paged_attention.cpu import cpu_kernel_unavailable_message
from tests.helpers import make_tiny_hf, runner_of


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_hf("llama", tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("given", [-1, 10**6])
def test_max_logprobs_of_no_cap_or_past_the_vocabulary_is_the_vocabulary(model_dir, given):
    """vLLM starts with either (its -1: no cap); the step's top-K is over the vocabulary."""
    config = EngineArgs(model=model_dir, max_logprobs=given).create_engine_config()
    assert config.max_logprobs == config.model.vocab_size
    with pytest.raises(ValueError, match="max_logprobs must be non-negative, got -2"):
        EngineArgs(model=model_dir, max_logprobs=-2).create_engine_config()


def test_defaults_are_vllms_with_cpu_limits(model_dir):
    config = EngineArgs(model=model_dir).create_engine_config()
    assert isinstance(config, EngineConfig)
    assert config.cache.block_size == 16 and config.cache.enable_prefix_caching
    assert config.cache.gpu_memory_utilization == 0.9 and config.max_logprobs == 20
    assert config.scheduler.max_model_len == config.model.max_model_len
    assert config.scheduler.max_num_seqs == CPU_MAX_NUM_SEQS
    assert config.scheduler.max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS
    assert config.scheduler.async_scheduling is False  # on CPU the host is the device
    on = EngineArgs(model=model_dir, async_scheduling=True).create_engine_config()
    assert on.scheduler.async_scheduling
    assert config.parallel.tensor_parallel_size == 1 and config.seed == 0
    assert config.kv_transfer_allowed_hosts == ("127.0.0.1", "::1", "localhost")
    hosts = EngineArgs(model=model_dir, kv_transfer_allowed_hosts=["10.0.0.5", "prefill-0"])
    assert hosts.create_engine_config().kv_transfer_allowed_hosts == ("10.0.0.5", "prefill-0")
    assert pickle.loads(pickle.dumps(config)).scheduler == config.scheduler  # for spawn
    with pytest.raises(AttributeError):
        config.seed = 3  # frozen


def test_default_model_by_name_or_none():
    by_name = EngineArgs(model="HuggingFaceTB/SmolLM2-135M-Instruct").create_engine_config()
    assert by_name.model_path == EngineArgs().create_engine_config().model_path
    assert by_name.model_path.endswith(".gguf") and by_name.model.num_layers == 30


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"max_model_len": 10**6}, "max_model_len=1000000 exceeds the model's"),
        ({"max_model_len": 0}, "max_model_len must be at least 1, got 0"),
        ({"max_num_seqs": 0}, "max_num_seqs must be at least 1, got 0"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens must be at least 1, got -1"),
        ({"block_size": 12}, "block_size must be a power of two, got 12"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be positive, got 0"),
        ({"num_gpu_blocks_override": 1}, "num_gpu_blocks_override must be at least 2, got 1"),
        ({"tensor_parallel_size": 64}, "tensor_parallel_size=64 needs 64 devices here; there"),
        (
            {"tensor_parallel_size": 32, "pipeline_parallel_size": 2},
            "tensor_parallel_size=32 x pipeline_parallel_size=2 needs 64 devices here",
        ),
        ({"data_parallel_size": 0}, "data_parallel_size must be at least 1, got 0"),
        ({"nnodes": 2, "node_rank": 2}, "node_rank=2 is not a rank of nnodes=2"),
        ({"nnodes": 2, "data_parallel_size": 2}, "data parallelism over several hosts is not"),
        ({"nnodes": 2, "tensor_parallel_size": 2}, "nnodes=2 but 1 processes joined the JAX"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy must be 'fcfs' or 'priority'"),
        ({"max_logprobs": -3}, "max_logprobs must be non-negative, got -3"),
        ({"dtype": "int8"}, "dtype 'int8' is not one of auto"),
        ({"load_format": "pt"}, "load_format 'pt' is not one of auto, dummy"),
        ({"kv_transfer_allowed_hosts": "10.0.0.5"}, "kv_transfer_allowed_hosts must be a list"),
        ({"hf_overrides": "{layers: 1}"}, "hf_overrides '{layers: 1}' is not JSON"),
        ({"hf_overrides": "[1]"}, r"hf_overrides must be a JSON object, got \[1\]"),
    ],
)
def test_bad_arguments_name_the_field(model_dir, args, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=model_dir, **args).create_engine_config()


def test_hf_overrides_reach_the_engine_core(model_dir, monkeypatch):
    """vLLM's --hf-overrides: config fields set over the checkpoint's, in the frontend's
    config and in the engine core's model (here one of the three layers, read from the
    checkpoint); the GGUF default model's config takes them too."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    config = EngineArgs(model=model_dir, hf_overrides='{"num_hidden_layers": 1}')
    assert config.create_engine_config().model.num_layers == 1
    llm = LLM(model_dir, hf_overrides={"num_hidden_layers": 1}, max_model_len=64)
    assert len(runner_of(llm).model.layers) == 1
    assert llm.generate([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)[0].outputs[0].token_ids
    gguf = EngineArgs(hf_overrides={"num_hidden_layers": 2}).create_engine_config()
    assert gguf.model.num_layers == 2


def test_bad_model_paths_and_unknown_arguments(tmp_path, model_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        EngineArgs(model=str(tmp_path / "nope")).create_engine_config()
    with pytest.raises(TypeError, match="unknown engine arguments: max_num_seq"):
        LLM(model_dir, max_num_seq=4)


def test_attention_backend_default_and_checks(model_dir):
    config = EngineArgs(model=model_dir).create_engine_config()
    # on CPU the C++ decode kernel where it builds (else the reference); "pallas" on GPU
    expected = "reference" if cpu_kernel_unavailable_message() else "cpu"
    assert config.attention_backend == expected
    config = EngineArgs(model=model_dir, attention_backend="reference")
    assert config.create_engine_config().attention_backend == "reference"
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        EngineArgs(model=model_dir, attention_backend="flash").create_engine_config()
    # tp above the KV heads: each device holds a copy of the KV head its query heads use
    config = EngineArgs(model=model_dir, attention_backend="pallas", tensor_parallel_size=4)
    assert config.create_engine_config().attention_backend == "pallas"
