"""EAGLE-1 and EAGLE-3 drafting on a tiny random Llama target with tiny random heads in EAGLE's
HF layouts: every draft the engine proposes equals what a plain PyTorch EAGLE (recomputed from
scratch over the request's tokens) drafts there, through chunked prefill, batched decode and
accepted / rejected drafts; greedy output equals decoding without speculation; config errors
are named."""

import json

import numpy as np
import pytest
import torch

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.helpers import TINY, hf_model, make_tiny_hf
from tests.models.test_moe import FAMILIES
from tests.worker.spec_decode.test_spec_decode import (
    AcceptCounter,
    core,
    record_drafts,
    token_ids,
)

K = 3


def make_tiny_eagle(out_dir, **overrides):
    """An EAGLE-1 head for make_tiny_hf's llama: one decoder layer without its input norm,
    fc [D, 2D], and an embed_tokens that jaxserve ignores (it shares the target's)."""
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 1, **overrides})
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(1)
    layer = transformers.LlamaForCausalLM(config).model.layers[0]
    d = config.hidden_size
    tensors = {"fc.weight": torch.randn(d, 2 * d) * 0.08,
               "embed_tokens.weight": torch.randn(config.vocab_size, d)}  # fmt: skip
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "input_layernorm.weight":
                continue
            tensors[f"layers.0.{name}"] = (
                torch.empty_like(p).uniform_(0.5, 1.5) if "norm" in name
                else torch.randn_like(p) * 0.08
            )  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config.to_dict()))
    return out_dir


class TorchEagle:
    """EAGLE-1 greedy drafting in PyTorch, from scratch over the whole sequence each time:
    entry p is [embed(x_{p+1}); the target's final hidden state at p] through fc and the
    layer (positions 0..), logits = the target's LM head on its output (no final norm)."""

    def __init__(self, eagle_dir, target):
        import transformers
        from safetensors.torch import load_file

        config = transformers.LlamaConfig.from_pretrained(eagle_dir)
        weights = load_file(str(eagle_dir / "model.safetensors"))
        self.target = target
        self.model = transformers.LlamaModel(config).float().eval()
        state = {k.removeprefix("layers.0."): v for k, v in weights.items() if "layers.0" in k}
        missing, unexpected = self.model.layers[0].load_state_dict(state, strict=False)
        assert missing == ["input_layernorm.weight"] and not unexpected, (missing, unexpected)
        self.model.layers[0].input_layernorm = torch.nn.Identity()
        self.model.norm = torch.nn.Identity()
        self.fc = weights["fc.weight"]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        ids = torch.tensor([tokens])
        features = self.target.model(input_ids=ids).last_hidden_state[0]  # [n, D]
        embed = self.target.model.embed_tokens
        embeds, feats, out = embed(ids[0, 1:]), features[:-1], []
        for _ in range(k):
            x = torch.cat([embeds, feats], -1) @ self.fc.T
            h = self.model(inputs_embeds=x[None]).last_hidden_state[0, -1]
            d = int(torch.argmax(self.target.lm_head(h)))
            out.append(d)
            embeds = torch.cat([embeds, embed(torch.tensor([d]))])
            feats = torch.cat([feats, h[None]])
        return out


AUX = [0, 1, 2]  # the 3-layer target's layers whose inputs make EAGLE-3's feature
DRAFT_IDS = [0, 1, 2, 3, 5, 6, 8, 9, 11, 13, 14, 15]  # its draft vocabulary, in target ids


def make_tiny_eagle3(out_dir):
    """An EAGLE-3 head in its HF layout (midlayer.*, fc [D, 3D], norm, lm_head over a 12-token
    draft vocabulary, d2t), its layer's qkv reading 2D."""
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 1, "vocab_size": 16})
    config.architectures = ["LlamaForCausalLMEagle3"]
    config.draft_vocab_size = len(DRAFT_IDS)
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": AUX}
    torch.manual_seed(2)
    d, hd = config.hidden_size, config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes = {
        "fc.weight": (d, 3 * d), "norm.weight": (d,), "lm_head.weight": (len(DRAFT_IDS), d),
        "midlayer.input_layernorm.weight": (d,), "midlayer.hidden_norm.weight": (d,),
        "midlayer.post_attention_layernorm.weight": (d,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * d),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * d),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * d),
        "midlayer.self_attn.o_proj.weight": (d, q),
        "midlayer.mlp.gate_proj.weight": (config.intermediate_size, d),
        "midlayer.mlp.up_proj.weight": (config.intermediate_size, d),
        "midlayer.mlp.down_proj.weight": (d, config.intermediate_size),
    }  # fmt: skip
    tensors = {
        name: torch.empty(shape).uniform_(0.5, 1.5) if "norm" in name
        else torch.randn(shape) * 0.08
        for name, shape in shapes.items()
    }  # fmt: skip
    tensors["fc.weight"] *= 8  # the feature dominates the output: drafts follow the tokens
    tensors["d2t"] = torch.tensor(DRAFT_IDS) - torch.arange(len(DRAFT_IDS))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config.to_dict()))
    return out_dir


class TorchEagle3:
    """EAGLE-3 greedy drafting in PyTorch, from scratch: entry p is the layer over
    [norm(embed(x_{p+1})) ; hidden_norm(h_p)] with residual h_p, h_p = fc(the inputs of the
    target's AUX layers at p), or the head's own pre-norm output at a draft position; the draft
    is the argmax of its head over the draft vocabulary, plus d2t."""

    def __init__(self, head_dir, target):
        import transformers
        from safetensors.torch import load_file

        self.config = transformers.LlamaConfig.from_pretrained(head_dir)
        self.w = load_file(str(head_dir / "model.safetensors"))
        self.target = target
        self.rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(self.config)

    def norm(self, x, name):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return x * self.w[name]

    def layer(self, embeds, h):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        w, c = self.w, self.config
        n, heads, kv_heads = h.shape[0], c.num_attention_heads, c.num_key_value_heads
        hd = c.hidden_size // heads
        x = torch.cat([self.norm(embeds, "midlayer.input_layernorm.weight"),
                       self.norm(h, "midlayer.hidden_norm.weight")], -1)  # fmt: skip
        q, k, v = (
            (x @ w[f"midlayer.self_attn.{p}_proj.weight"].T).view(n, -1, hd).transpose(0, 1)
            for p in "qkv"
        )
        cos, sin = self.rotary(x[None], torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v[None]))
        scores = (q @ k.transpose(-1, -2)) / hd**0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=bool).triu(1), float("-inf"))
        attn = (scores.softmax(-1) @ v)[0].transpose(0, 1).reshape(n, -1)
        y = h + attn @ w["midlayer.self_attn.o_proj.weight"].T
        z = self.norm(y, "midlayer.post_attention_layernorm.weight")
        gate, up = (z @ w[f"midlayer.mlp.{p}_proj.weight"].T for p in ("gate", "up"))
        return y + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        ids = torch.tensor([tokens])
        states = self.target.model(input_ids=ids, output_hidden_states=True).hidden_states
        features = torch.cat([states[i][0] for i in AUX], -1)  # the inputs of those layers
        embed = self.target.model.embed_tokens
        embeds, h, out = embed(ids[0, 1:]), features[:-1] @ self.w["fc.weight"].T, []
        for _ in range(k):
            y = self.layer(embeds, h)[-1]
            best = int(torch.argmax(self.norm(y, "norm.weight") @ self.w["lm_head.weight"].T))
            d = best + int(self.w["d2t"][best])
            out.append(d)
            embeds = torch.cat([embeds, embed(torch.tensor([d]))])
            h = torch.cat([h, y[None]])
        return out


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory):
    return make_tiny_eagle3(tmp_path_factory.mktemp("eagle3"))


@pytest.fixture(scope="module")
def target_and_head(tmp_path_factory):
    """A 16-token vocabulary, so random drafts are accepted often enough to test both
    outcomes."""
    root = tmp_path_factory.mktemp("eagle")
    target = make_tiny_hf("llama", root / "target", vocab_size=16)
    return target, make_tiny_eagle(root / "head", vocab_size=16)


ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, dtype="float32",
              enable_prefix_caching=False, max_logprobs=5)  # fmt: skip


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_equal_pytorch_eagle_and_greedy_output_is_exact(
    target_and_head, eagle3_head, monkeypatch, method
):
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    target, head = target_and_head
    head = eagle3_head if method == "eagle3" else head
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 16, n).tolist() for n in (5, 23, 40)]  # 23, 40: chunked
    prompts = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = token_ids(LLM(str(target), **ENGINE).generate(prompts, params, use_tqdm=False))

    spec = {"method": method, "model": str(head), "num_speculative_tokens": K}
    llm = LLM(str(target), **ENGINE, speculative_config=spec)
    runner = core(llm).runner
    proposed = record_drafts(runner)
    counter = AcceptCounter(llm)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert 0 < counter.accepted < counter.drafted, vars(counter)  # both outcomes
    core(llm).scheduler.kv_cache_manager.check_no_leaks()

    reference = (TorchEagle3 if method == "eagle3" else TorchEagle)(head, hf_model(str(target)))
    assert len(proposed) > 30
    for tokens, drafts in proposed:
        assert drafts == reference.drafts(tokens, K), tokens


@pytest.mark.parametrize(("family", "tp"), [("qwen3_moe", 1), ("qwen3_moe", 2), ("gpt_oss", 1)])
def test_eagle3_on_moe_targets_drafts_as_pytorch_and_keeps_greedy(
    eagle3_head, tmp_path, monkeypatch, family, tp
):
    """EAGLE-3 over mixture-of-experts targets (their aux hidden states: the Llama forward's):
    greedy output equal to decoding without speculation, each draft PyTorch's, the drafts
    counted in the metrics."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    target = make_tiny_hf(family, tmp_path / family, vocab_size=16, **FAMILIES[family])
    prompts = [{"prompt_token_ids": np.random.default_rng(1).integers(0, 16, 21).tolist()}]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = token_ids(LLM(str(target), **ENGINE).generate(prompts, params, use_tqdm=False))
    spec = {"method": "eagle3", "model": str(eagle3_head), "num_speculative_tokens": K}
    llm = LLM(str(target), **ENGINE, speculative_config=spec, tensor_parallel_size=tp)
    runner = core(llm).runner
    proposed = record_drafts(runner)
    counter = AcceptCounter(llm)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
    metrics = counter.metrics()  # drafts and acceptance as /metrics reports them
    assert metrics["spec_decode_num_draft_tokens"] == counter.drafted > 0
    assert metrics["spec_decode_num_accepted_tokens"] == counter.accepted
    reference = TorchEagle3(eagle3_head, hf_model(str(target)))
    assert len(proposed) > 3
    for tokens, drafts in proposed:
        assert drafts == reference.drafts(tokens, K), tokens


def test_eagle_config_errors_are_named(target_and_head, tmp_path):
    target, head = target_and_head
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    gemma = make_tiny_hf("gemma2", tmp_path / "gemma2", head_dim=16, vocab_size=16)
    with pytest.raises(ValueError, match="eagle needs a target EAGLE heads draft for"):
        EngineArgs(model=str(gemma), speculative_config=spec).create_engine_config()
    wide = make_tiny_eagle(tmp_path / "wide", hidden_size=128, vocab_size=16)
    spec["model"] = str(wide)
    with pytest.raises(ValueError, match="hidden_size 128 is not the target's 64"):
        EngineArgs(model=str(target), speculative_config=spec).create_engine_config()
