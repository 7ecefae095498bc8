"""Tiny random-weight HF models and a minimal paged-KV driver for model tests.

`PagedSequences` plays the part of the (later) scheduler + input batch: it hands each sequence
blocks from a shuffled free list, builds the flat batch and its AttentionMetadata padded to
power-of-two buckets, and returns the logits of every token it ran.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding

from jaxserve.distributed.sharding import kv_cache_sharding
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.models.step_inputs import text_inputs
from jaxserve.worker.kv_cache import KVCacheSpec


@contextlib.contextmanager
def engines_in_process():
    """LLM engines in the test's process (tests look inside them), one model load per path
    for all of them (worker/build.py's load_model cached)."""
    import jaxserve.worker.build as core_module

    original = core_module.load_model
    core_module.load_model = functools.cache(original)
    mp = pytest.MonkeyPatch()
    mp.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    try:
        yield
    finally:
        mp.undo()
        core_module.load_model = original


TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def core_of(llm):
    """The EngineCore of an LLM whose core runs in this process (engines_in_process)."""
    return llm.llm_engine.engine_core.engine_core


def runner_of(llm):
    """The model runner of an LLM whose core runs in this process."""
    return core_of(llm).runner


def byte_level_tokenizer(special_tokens: list[str], eos_token: str):
    """A byte-level tokenizer (every byte its own token, no merges) with `special_tokens` as
    special tokens: a family's markers streamed token by token as its model writes them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxserve.transformers_utils.gguf_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=eos_token, additional_special_tokens=special_tokens
    )


def make_tiny_hf(family: str, out_dir: Path, **overrides) -> Path:
    """Save a random-weight HF model of `family` (llama | mistral | qwen2 | qwen3 | phi3 |
    gemma2 | gemma3 | gemma4 | mixtral | qwen3_moe | glm4_moe | deepseek_v3 | deepseek_v2 |
    gpt_oss | llama4 | qwen3_next | qwen3_5 | qwen3_5_moe | minimax_m2 | deepseek_v32 |
    glm_moe_dsa) to out_dir, fp32."""
    import transformers

    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
             "phi3": "Phi3", "gemma2": "Gemma2", "gemma3": "Gemma3", "gemma4": "Gemma4",
             "mixtral": "Mixtral",
             "qwen3_moe": "Qwen3Moe", "glm4_moe": "Glm4Moe",
             "deepseek_v3": "DeepseekV3", "gpt_oss": "GptOss", "llama4": "Llama4",
             "deepseek_v2": "DeepseekV2", "qwen3_next": "Qwen3Next", "qwen3_5": "Qwen3_5",
             "qwen3_5_moe": "Qwen3_5Moe", "minimax_m2": "MiniMaxM2",
             "deepseek_v32": "DeepseekV32", "glm_moe_dsa": "GlmMoeDsa"}  # fmt: skip
    cls_name = names[family]
    text_only = ("gemma3", "gemma4", "llama4", "qwen3_5", "qwen3_5_moe")  # the text model's config
    config_cls = f"{cls_name}TextConfig" if family in text_only else f"{cls_name}Config"
    config = getattr(transformers, config_cls)(**{**TINY, **overrides})
    config.architectures = [f"{cls_name}ForCausalLM"]
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls_name}ForCausalLM")(config).float()
    with torch.no_grad():  # HF inits biases to 0 and norms to 1: randomise so both are tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():  # noaux_tc routers' score correction bias
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.2, 0.2)
            if name.endswith("layer_scalar"):  # Gemma 4's
                b.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    return out_dir


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer(out_dir: Path) -> int:
    """Save a byte-level tokenizer (one token per byte, no merges; <|endoftext|> as EOS,
    <|im_start|> / <|im_end|> and a ChatML chat template) to out_dir, e.g. a make_tiny_hf
    directory: a tokenizer that costs nothing to read. Returns its size (the model's vocab)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxserve.transformers_utils.gguf_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", chat_template=CHATML,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )  # fmt: skip
    fast.save_pretrained(out_dir)
    return len(fast)


_GGUF_NAMES = {  # HF name (layer suffix) -> llama.cpp GGUF name
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_llama_gguf(path: Path, hf, qtypes: dict | None = None, tokenizer: dict | None = None):
    """Write HF llama model `hf` as a GGUF file the way llama.cpp's converter does (q/k rows
    permuted for interleaved rotary), each tensor quantised as qtypes[GGUF name suffix] says
    (default F32). `hf` gets the rounded weights, so it stays the reference. tokenizer: extra
    `tokenizer.*` metadata, key (without the prefix) -> value, e.g. {"ggml.model": "llama"}."""
    import gguf
    from gguf.quants import dequantize, quantize

    cfg = hf.config
    q = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    for key, value in (tokenizer or {}).items():
        writer.add_key_value(f"tokenizer.{key}", *_gguf_value(value))
    state = hf.state_dict()
    for name, tensor in state.items():
        layer, suffix = "", name
        if name.startswith("model.layers."):
            layer, suffix = name.removeprefix("model.layers.").split(".", 1)
        gname = _GGUF_NAMES[suffix]
        qtype = (qtypes or {}).get(gname, q.F32)
        w = tensor.numpy()
        rounded = dequantize(quantize(w, qtype), qtype).reshape(w.shape)  # what HF will see
        tensor.copy_(torch.from_numpy(rounded))
        if gname == "attn_q.weight":
            w = _llama_cpp_permute(w, cfg.num_attention_heads)
        elif gname == "attn_k.weight":
            w = _llama_cpp_permute(w, cfg.num_key_value_heads)
        raw = None if qtype in (q.F32, q.F16) else qtype
        name = f"blk.{layer}.{gname}" if layer else gname
        writer.add_tensor(name, quantize(w, qtype), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf.load_state_dict(state)


def _gguf_value(value):
    import gguf

    t = gguf.GGUFValueType
    if isinstance(value, list):
        return value, t.ARRAY, t.get_type(value[0])
    return value, t.get_type(value)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to attn_q / attn_k rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def assert_generate_matches_hf(llm, model_dir, prompts: list[list[int]], max_tokens: int = 32):
    """Greedy decode `prompts` through `llm` (logprobs on): the tokens equal HF `generate`'s
    over max_tokens steps (up to HF's EOS, which the engine ignores) and every chosen token's
    logprob is within 1e-2 of HF's. Returns the engine's outputs."""
    from jaxserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref = hf_model(str(model_dir))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            gen = ref.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                               do_sample=False, output_logits=True,
                               return_dict_in_generate=True)  # fmt: skip
        want = gen.sequences[0, len(prompt) :].tolist()
        got = out.outputs[0]
        assert len(want) >= 5 and got.token_ids[: len(want)] == want, (prompt, got.token_ids)
        steps = zip(gen.logits, want, strict=True)
        hf_lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in steps]
        ours = [lp[t].logprob for lp, t in zip(got.logprobs, want, strict=False)]
        np.testing.assert_allclose(ours, hf_lp, atol=1e-2)
    return outs


@functools.cache
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.cache
def hf_default_model():
    """HF transformers' own load of the bundled GGUF (its dequantisation), fp32: the reference.
    The weights it dequantised are kept as safetensors (the same bits) under
    ~/.cache/jaxserve/test-references, keyed by the GGUF file and the transformers version:
    the GGUF load takes ~19 s of CPU in each test process that needs it, the copy 0.1 s."""
    import copy
    import fcntl
    import os
    import shutil
    import tempfile

    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from jaxserve.transformers_utils.model_path import default_model_path

    path = default_model_path()
    stat = path.stat()
    key = f"{path.name}-{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers.__version__}"
    kept = Path(os.path.expanduser("~/.cache/jaxserve/test-references")) / key
    kept.parent.mkdir(parents=True, exist_ok=True)
    # One process dequantises; another that needs it meanwhile waits (idle) and reads the copy.
    with open(kept.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (kept / "model.safetensors").exists():
            return AutoModelForCausalLM.from_pretrained(kept, dtype=torch.float32).eval()
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
        config = copy.deepcopy(model.config)
        del config.quantization_config  # a plain fp32 checkpoint now
        weights = {k: v.contiguous() for k, v in model.state_dict().items()}
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight")
        tmp = Path(tempfile.mkdtemp(dir=kept.parent))
        config.save_pretrained(tmp)
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        try:
            os.replace(tmp, kept)
        except OSError:  # kept by a process that held no lock (an older helper)
            shutil.rmtree(tmp, ignore_errors=True)
    return model


def hf_logits(model, token_ids: list[int]) -> np.ndarray:
    """[len, V] float32 logits of HF `model` over one whole sequence."""
    with torch.no_grad():
        out = model(torch.tensor([token_ids]))
    return out.logits[0].float().numpy()


def _bucket(n: int, minimum: int = 8) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


class PagedSequences:
    """Runs steps of (sequence -> new tokens) through a jaxserve model over a paged KV cache."""

    def __init__(self, loaded, *, num_blocks=64, block_size=4, max_blocks=32, seed=0,
                 kv_dtype=None):  # fmt: skip
        self.model, self.config, self.block_size = loaded.model, loaded.config, block_size
        self.max_blocks = max_blocks
        rng = np.random.default_rng(seed)
        self.free = [int(b) for b in rng.permutation(np.arange(1, num_blocks))]  # 0: null block
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        cfg = self.config
        heads = loaded.model.num_cache_kv_heads
        rows = (len(cfg.kv_layers) * num_blocks, block_size, heads)
        sharding = kv_cache_sharding(loaded.mesh)
        kv_dtype = kv_dtype or cfg.dtype
        self.kv = tuple(jax.device_put(jnp.zeros((*rows, dim), kv_dtype), sharding)
                        for dim in cfg.cache_dims)  # fmt: skip
        # a hybrid model's per-sequence states: sequence i in row i
        spec = KVCacheSpec(cfg, loaded.mesh, block_size, kv_dtype, heads, num_state_rows=8)
        self.kv += jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec.state_shapes())
        self._forward = _make_forward(self.model, NamedSharding(loaded.mesh, jax.P()))

    def step(self, chunks: dict[int, list[int]]) -> dict[int, np.ndarray]:
        """Feed each sequence its next tokens in one flat batch; returns logits [n, V] each."""
        ids, pos, slots, qsl, kv_lens, tables, rows = [], [], [], [0], [], [], []
        for seq, toks in chunks.items():
            table = self.tables.setdefault(seq, [])
            start = self.lens.get(seq, 0)
            for p in range(start, start + len(toks)):
                if p // self.block_size >= len(table):
                    table.append(self.free.pop())
                ids.append(toks[p - start])
                pos.append(p)
                rows.append(seq)
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            self.lens[seq] = start + len(toks)
            qsl.append(len(ids))
            kv_lens.append(self.lens[seq])
            tables.append(table + [0] * (self.max_blocks - len(table)))
        t, s = _bucket(len(ids)), _bucket(len(chunks), 4)
        pad_t, pad_s = t - len(ids), s - len(chunks)
        md = AttentionMetadata(
            slot_mapping=np.array(slots + [-1] * pad_t, np.int32),
            block_tables=np.array(tables + [[0] * self.max_blocks] * pad_s, np.int32),
            kv_lens=np.array(kv_lens + [0] * pad_s, np.int32),
            query_start_loc=np.array(qsl + [len(ids)] * pad_s, np.int32),
            num_seqs=np.array([len(chunks)], np.int32),
        )
        logits, self.kv = self._forward(
            np.array(ids + [0] * pad_t, np.int32), np.array(pos + [0] * pad_t, np.int32),
            self.kv, md, np.array(rows + [0] * pad_t, np.int32),
        )  # fmt: skip
        logits = np.asarray(logits)
        return {seq: logits[qsl[i] : qsl[i + 1]] for i, seq in enumerate(chunks)}


def _make_forward(model, replicated):
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(3,))
    def forward(state, input_ids, positions, kv, md, token_rows):
        m = nnx.merge(graphdef, state)
        hidden, kv = m(text_inputs(input_ids, positions, md, token_rows), kv)
        logits = jax.lax.with_sharding_constraint(m.compute_logits(hidden), replicated)
        return logits, kv  # logits of every row (tests only; the runner picks last tokens)

    return functools.partial(forward, state)


def engine_with_registry(model: str, executables, **engine_args):
    """An LLMEngine with its core in this process, whose runner compiles into and serves from
    `executables` (an ExecutableRegistry: the runner's seam, worker/executables.py)."""
    from jaxserve.engine.arg_utils import EngineArgs
    from jaxserve.engine.core import EngineCore
    from jaxserve.engine.core_client import InprocClient
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.startup import StartupTimeline
    from jaxserve.worker.build import build_runner

    config = EngineArgs(model=str(model), **engine_args).create_engine_config()
    runner = build_runner(config, StartupTimeline(), executables=executables)
    client = InprocClient(config, EngineCore(config, runner=runner))
    return LLMEngine(config, client=client)


def generate_ids(engine, prompts: list[list[int]], params) -> list[list[int]]:
    """Each token-id prompt's output token ids from an LLMEngine, in prompt order."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finished = drain_engine(engine)
    return [finished[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def drain_engine(engine, finished: dict | None = None) -> dict:
    """Step an LLMEngine until it holds no request; returns {request_id: final RequestOutput}
    (added to `finished` when given)."""
    finished = {} if finished is None else finished
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    return finished


def make_tiny_adapter(base_dir: Path, out_dir: Path, *, r: int, seed: int,
                      targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                               "down_proj"), alpha: float = 16.0, rslora: bool = False,
                      std: float = 0.05) -> Path:  # fmt: skip
    """Save a PEFT LoRA adapter of rank r for the HF model at base_dir to out_dir, A and B
    drawn from N(0, std) (B non-zero, so the adapter changes the output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                        lora_dropout=0.0)  # fmt: skip
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    peft_model.save_pretrained(out_dir)
    return out_dir


def peft_model(base_dir: Path, adapter_dir: Path):
    """HF's model at base_dir with PEFT's adapter from adapter_dir applied (fp32, eval)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter_dir).eval()


def assert_offload_round_trip(llm, model_dir, against_hf: bool = True) -> None:
    """An engine with the host offload tier (kv_offloading_size, a 14+-block pool): a 100-token
    prompt with HF's tokens (against_hf; else the engine's own), two 110-token ones that
    evict its blocks from the device, then the first again: its 6 full blocks come back from
    the host (96 cached tokens) and give the same tokens."""
    from jaxserve.sampling_params import SamplingParams

    rng = np.random.default_rng(1)
    long_prompt, *others = (rng.integers(1, 256, n).tolist() for n in (100, 110, 110))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    if against_hf:
        (first,) = assert_generate_matches_hf(llm, model_dir, [long_prompt])
    else:
        (first,) = llm.generate([{"prompt_token_ids": long_prompt}], params, use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in others], params, use_tqdm=False)  # evicts
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    (again,) = llm.generate([{"prompt_token_ids": long_prompt}], params, use_tqdm=False)
    assert again.num_cached_tokens == 96  # every full block but the last prompt token's
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    scheduler = core_of(llm).scheduler
    assert scheduler.connector.totals().loaded_blocks == 6
    scheduler.kv_cache_manager.check_no_leaks()
