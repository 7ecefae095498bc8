"""EAGLE-1 drafting on a tiny random Llama target with a tiny random EAGLE head in EAGLE's HF
layout: every draft the engine proposes equals what a plain PyTorch EAGLE (HF's Llama layer,
recomputed from scratch over the request's tokens) drafts there, through chunked prefill,
batched decode and accepted / rejected drafts; greedy output equals decoding without
speculation; config errors are named."""

import json

import numpy as np
import pytest
import torch

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.helpers import TINY, hf_model, make_tiny_hf
from tests.spec_decode.test_spec_decode import AcceptCounter, core, token_ids

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


@pytest.fixture(scope="module")
def target_and_head(tmp_path_factory):
    """A 16-token vocabulary, so random drafts are accepted often enough to test both
    outcomes."""
    root = tmp_path_factory.mktemp("eagle")
    target = make_tiny_hf("llama", root / "target", vocab_size=16)
    return target, make_tiny_eagle(root / "head", vocab_size=16)


ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, dtype="float32",
              enable_prefix_caching=False, max_logprobs=5)  # fmt: skip


def test_drafts_equal_pytorch_eagle_and_greedy_output_is_exact(target_and_head, monkeypatch):
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    target, head = target_and_head
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 16, n).tolist() for n in (5, 23, 40)]  # 23, 40: chunked
    prompts = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = token_ids(LLM(str(target), **ENGINE).generate(prompts, params, use_tqdm=False))

    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": K}
    llm = LLM(str(target), **ENGINE, speculative_config=spec)
    runner = core(llm).runner
    proposed = []  # (the request's tokens, its drafts), as the engine saw them
    propose_rows = runner.drafter.propose_rows

    def recording(ib, rows, *args):
        drafts = propose_rows(ib, rows, *args)
        for row, d in zip(rows, drafts, strict=True):
            proposed.append((ib.token_ids[row, : ib.num_tokens[row]].tolist(), d))
        return drafts

    runner.drafter.propose_rows = recording
    runner.draft_backoff.should_draft = lambda req_id: True  # draft at every chance
    counter = AcceptCounter(llm)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert 0 < counter.accepted < counter.drafted, vars(counter)  # both outcomes
    core(llm).scheduler.kv_cache_manager.check_no_leaks()

    reference = TorchEagle(head, hf_model(str(target)))
    assert len(proposed) > 30
    for tokens, drafts in proposed:
        assert drafts == reference.drafts(tokens, K), tokens


def test_eagle_config_errors_are_named(target_and_head, tmp_path):
    target, head = target_and_head
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    gemma = make_tiny_hf("gemma2", tmp_path / "gemma2", head_dim=16, vocab_size=16)
    with pytest.raises(ValueError, match="eagle needs a Llama-family target"):
        EngineArgs(model=str(gemma), speculative_config=spec).create_engine_config()
    wide = make_tiny_eagle(tmp_path / "wide", hidden_size=128, vocab_size=16)
    spec["model"] = str(wide)
    with pytest.raises(ValueError, match="hidden_size 128 is not the target's 64"):
        EngineArgs(model=str(target), speculative_config=spec).create_engine_config()
