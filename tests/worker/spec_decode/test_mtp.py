"""MTP drafting (speculative method `mtp`) on tiny random DeepSeek-V3 / GLM-4.5 checkpoints that
ship a multi-token-prediction layer (`model.layers.{L}.*`): the head's forward equals
transformers' MtpModel's, the engine's drafts are MtpModel's, greedy output with MTP drafts
equals decoding without them, drafts are accepted where the MTP layer predicts the target's
next token, and targets without MTP layers are refused by name."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from jaxserve.config import SpeculativeConfig
from jaxserve.config.speculative import mtp_architecture
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.models.llama import lm_logits
from jaxserve.models.loader import load_model
from jaxserve.transformers_utils.config import read_model_config
from tests.helpers import TINY, hf_model, make_tiny_hf
from tests.models.test_deepseek_v32 import FAMILY_SHAPES as DSA_SHAPES
from tests.models.test_moe import FAMILIES
from tests.worker.spec_decode.test_spec_decode import (
    AcceptCounter,
    core,
    record_drafts,
    token_ids,
)


def make_tiny_mtp(family: str, out_dir, num_layers: int, copy_layer0: bool = False, **shape):
    """make_tiny_hf's model of `family` with num_layers decoder layers and one MTP layer after
    them (the checkpoint of a model with one more layer, its last renamed to the MTP block,
    plus enorm, hnorm, eh_proj and shared_head). copy_layer0: an MTP layer that predicts the
    target's next token (its block layer 0's, eh_proj [I | 0], enorm ones, shared_head.norm
    the final norm; embeddings of rms 1, so enorm keeps them) -> (dir, MTP extras)."""
    shape = {**TINY, **FAMILIES.get(family, {}), **shape}
    path = make_tiny_hf(family, out_dir, **{**shape, "num_hidden_layers": num_layers + 1})
    weights = load_file(str(path / "model.safetensors"))
    d = shape["hidden_size"]
    gen = torch.Generator().manual_seed(2)
    prefix = f"model.layers.{num_layers}."
    extras = {
        "enorm.weight": torch.rand(d, generator=gen) + 0.5,
        "hnorm.weight": torch.rand(d, generator=gen) + 0.5,
        "eh_proj.weight": torch.randn(d, 2 * d, generator=gen) * 0.08,
        "shared_head.norm.weight": torch.rand(d, generator=gen) + 0.5,
    }
    if copy_layer0:
        emb = weights["model.embed_tokens.weight"]
        weights["model.embed_tokens.weight"] = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
        for name in [n for n in weights if n.startswith(prefix)]:
            weights[name] = weights[name.replace(prefix, "model.layers.0.")].clone()
        extras["enorm.weight"] = torch.ones(d)
        small = torch.randn(d, d, generator=gen) * 0.05  # the feature counts, a little
        extras["eh_proj.weight"] = torch.cat([torch.eye(d), small], dim=1)
        extras["shared_head.norm.weight"] = weights["model.norm.weight"].clone()
    for name in [n for n in weights if n.endswith("indexer.weights_proj.weight")]:
        weights[name] = weights[name].abs()  # no index-score ties (test_deepseek_v32.py)
    weights.update({prefix + k: v for k, v in extras.items()})
    weights[prefix + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    config.setdefault("num_nextn_predict_layers", 1)  # (V3.2's config class drops the field)
    for key in [k for k in config if k.endswith(("layer_types", "indexer_types"))]:  # per layer
        config[key] = config[key][:num_layers]
    (path / "config.json").write_text(json.dumps(config))
    return path, extras


def hf_mtp(path, extras, num_layers: int):
    """transformers' MtpModel over the target, its layer's weights loaded by hand (its keys
    are fixed to index 0; the block is the checkpoint's layer L)."""
    import transformers
    from transformers.modeling_layers import MtpModel

    target = hf_model(str(path))
    full = transformers.AutoModelForCausalLM.from_pretrained(
        path, num_hidden_layers=num_layers + 1, dtype=torch.float32
    )
    mtp = MtpModel(target, 1).float().eval()
    layer = mtp.layers[0]
    layer.mtp_block.load_state_dict(full.model.layers[num_layers].state_dict())
    with torch.no_grad():
        for name in ("enorm", "hnorm", "eh_proj"):
            getattr(layer, name).weight.copy_(extras[f"{name}.weight"])
        layer.post_norm.weight.copy_(extras["shared_head.norm.weight"])
    return target, mtp


@torch.no_grad()
def reference_drafts(target, mtp, tokens: list[int], k: int) -> list[int]:
    """Greedy MTP drafts after `tokens`, from scratch: entry p is [embed(x_{p+1}) ; the
    target's final hidden state at p] (positions 0..), each later draft's feature the layer's
    output before shared_head.norm (vLLM's, jaxserve's feedback)."""
    layer = mtp.layers[0]
    layer.use_post_norm = False  # forward_layer then returns the block's output
    ids = torch.tensor([tokens])
    feats = target(ids, output_hidden_states=True).hidden_states[-1][0, :-1]
    embeds, out = target.model.embed_tokens(ids[0, 1:]), []
    for _ in range(k):
        n = embeds.shape[0]
        x = mtp.forward_layer(
            0, feats[None], torch.arange(n)[None], None, inputs_embeds=embeds[None]
        )
        d = int(torch.argmax(mtp._project_to_logits(layer.post_norm(x[0, -1]))))
        out.append(d)
        embeds = torch.cat([embeds, target.model.embed_tokens(torch.tensor([d]))])
        feats = torch.cat([feats, x[0, -1:]])
    layer.use_post_norm = True
    return out


def run_head(loaded, target, embeds, hidden, chunks):
    """The jaxserve head over one sequence fed in `chunks` (token counts) through a paged
    cache of 4-token blocks, blocks 1-8 (block 0 is the null block padding writes land in, as
    the engine's block pool keeps it) -> (normed output [n, D], logits [n, V])."""
    c, n = loaded.config, embeds.shape[0]
    kv = tuple(jnp.zeros((9, 4, loaded.model.num_cache_kv_heads, dim)) for dim in c.cache_dims)
    graphdef, state = nnx.split(loaded.model)

    @jax.jit
    def forward(state, embeds, h, positions, kv, md):
        out, _, kv = nnx.merge(graphdef, state)(embeds, h, positions, kv, md)
        return out, kv

    outs, start = [], 0
    for (
        size
    ) in chunks:  # each padded to n rows (one compile), the padding written to the null block
        pos = np.minimum(np.arange(start, start + n, dtype=np.int32), n - 1)
        slots = np.where(np.arange(n) < size, pos + 4, -1).astype(np.int32)
        md = AttentionMetadata(
            slots,
            np.arange(1, 9, dtype=np.int32)[None],
            np.array([start + size]),
            np.array([0, size], np.int32),
            np.array([1], np.int32),
        )
        out, kv = forward(state, embeds[pos], hidden[pos], pos, kv, md)
        outs.append(np.asarray(out)[:size])
        start += size
    out = np.concatenate(outs)
    assert out.shape[0] == n
    head = target.model.logits_head
    return out, np.asarray(lm_logits(jnp.asarray(out), head, tied=c.tie_word_embeddings))


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp_head_equals_transformers(tmp_path, family):
    """Over a 12-token sequence, all at once (DeepSeek: MLA's expanded form) and in chunks of
    5, 4 and 3 (its absorbed form over the cache): the head's normed output and logits are
    MtpModel's (transformers) within 1e-4, in float32."""
    path, extras = make_tiny_mtp(family, tmp_path / family, num_layers=2)
    target, mtp = hf_mtp(path, extras, 2)
    tokens = torch.tensor([[5, 17, 3, 99, 42, 7, 7, 130, 8, 64, 250, 1, 9]])
    with torch.no_grad():
        hidden = target(tokens, output_hidden_states=True).hidden_states[-1]  # final, normed
        positions = torch.arange(12)[None]
        want = mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=tokens[:, 1:])
        want_logits = mtp._project_to_logits(want)[0].numpy()
    ours = load_model(path, dtype="float32", load_tokenizer=False)
    head = load_model(
        path, dtype="float32", load_tokenizer=False, architecture=mtp_architecture(ours.config)
    )
    embeds = ours.model.embed_tokens.embedding[...][tokens[0, 1:].numpy()]
    feature = jnp.asarray(hidden[0, :-1].numpy())
    for chunks in ([12], [5, 4, 3]):
        out, logits = run_head(head, ours, embeds, feature, chunks)
        np.testing.assert_allclose(out, want[0].numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_mtp_head_equals_transformers_layer(tmp_path, family):
    """DeepSeek-V3.2's and GLM-5's MTP layer (a sparse-attention block with a full indexer,
    past its index_topk of 8 here; GLM-5's target with a shared indexer layer): transformers'
    MtpModel takes neither config, so the reference is transformers' own decoder layer of the
    family with the block's weights, fed eh_proj([enorm(embed) ; hnorm(h)]) and normed by
    shared_head.norm; the head's output and logits equal it within 1e-4, whole and chunked."""
    import transformers

    shape = DSA_SHAPES[family]
    if family == "glm_moe_dsa":  # the target's layers full, shared; the MTP block's full
        shape = {**shape, "indexer_types": ["full", "shared", "full"]}
    path, extras = make_tiny_mtp(family, tmp_path / family, num_layers=2, **shape)
    target = hf_model(str(path))
    config = target.config
    per_layer = {"mlp_layer_types": [*config.mlp_layer_types, "sparse"]}
    if family == "glm_moe_dsa":
        per_layer["indexer_types"] = [*config.indexer_types, "full"]
    full = transformers.AutoModelForCausalLM.from_pretrained(
        path, num_hidden_layers=3, dtype=torch.float32, **per_layer
    )
    one = dict(num_hidden_layers=1, first_k_dense_replace=0, mlp_layer_types=["sparse"])
    if family == "glm_moe_dsa":
        one["indexer_types"] = ["full"]
    one_config = transformers.AutoConfig.from_pretrained(path, **one)
    block = transformers.AutoModelForCausalLM.from_config(one_config).float().eval()
    block.model.layers[0].load_state_dict(full.model.layers[2].state_dict())
    tokens = torch.tensor([[5, 17, 3, 99, 42, 7, 7, 130, 8, 64, 250, 1, 9]])

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * w

    with torch.no_grad():
        block.model.norm.weight.copy_(extras["shared_head.norm.weight"])
        hidden = target(tokens, output_hidden_states=True).hidden_states[-1][0, :-1]
        embeds = target.model.embed_tokens(tokens[0, 1:])
        x = torch.cat(
            [rms(embeds, extras["enorm.weight"]), rms(hidden, extras["hnorm.weight"])], -1
        )
        x = x @ extras["eh_proj.weight"].T
        want = block.model(inputs_embeds=x[None], position_ids=torch.arange(12)[None])
        want = want.last_hidden_state[0]
        want_logits = (want @ target.lm_head.weight.T).numpy()
    ours = load_model(path, dtype="float32", load_tokenizer=False)
    head = load_model(
        path, dtype="float32", load_tokenizer=False, architecture=mtp_architecture(ours.config)
    )
    ours_embeds = ours.model.embed_tokens.embedding[...][tokens[0, 1:].numpy()]
    for chunks in ([12], [5, 4, 3]):
        out, logits = run_head(head, ours, ours_embeds, jnp.asarray(hidden.numpy()), chunks)
        np.testing.assert_allclose(out, want.numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=0)


ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96, dtype="float32",
              enable_prefix_caching=False)  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2])
def test_mtp_greedy_output_is_exact_and_drafts_are_accepted(tmp_path, monkeypatch, tp):
    """A 1-layer DeepSeek-V3 whose MTP layer nearly repeats it (make_tiny_mtp's copy_layer0):
    with k = 2 MTP drafts, greedy output equals decoding without speculation (HF's; prompts
    chunked and not), a fair share of drafts is accepted (a draft paired with the wrong
    position would be right about 1 time in 256), and every draft the engine proposed is the
    one transformers' MtpModel, recomputed from scratch, drafts there."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    shape = dict(first_k_dense_replace=0)  # layer 0 is MoE, as the MTP block
    path, extras = make_tiny_mtp("deepseek_v3", tmp_path / "ds", 1, copy_layer0=True, **shape)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 256, n).tolist()} for n in (5, 23)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = []  # decoding without speculation: HF's greedy generate (the engine's, tested apart)
    for p in prompts:
        with torch.no_grad():
            ids = torch.tensor([p["prompt_token_ids"]])
            out = hf_model(str(path)).generate(ids, max_new_tokens=20, do_sample=False)
        want.append(out[0, ids.shape[1] :].tolist())
    spec = {"method": "mtp", "num_speculative_tokens": 2}  # the draft is the target's own layer
    llm = LLM(str(path), **ENGINE, speculative_config=spec, tensor_parallel_size=tp)
    runner = core(llm).runner
    proposed = record_drafts(runner)
    counter = AcceptCounter(llm)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
    # both outcomes; chance would accept about 1 draft in 256
    assert counter.drafted / 4 < counter.accepted < counter.drafted, vars(counter)
    metrics = counter.metrics()  # the acceptance as /metrics reports it
    assert metrics["spec_decode_num_draft_tokens"] == counter.drafted
    assert metrics["spec_decode_num_accepted_tokens"] == counter.accepted
    core(llm).scheduler.kv_cache_manager.check_no_leaks()
    target, mtp = hf_mtp(path, extras, 1)
    assert len(proposed) > 10
    for tokens, drafts in proposed:
        assert drafts == reference_drafts(target, mtp, tokens, 2), tokens


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_mtp_greedy_output_is_exact(tmp_path, monkeypatch, family):
    """DeepSeek-V3.2 and GLM-5 drafting with their MTP layer past index_topk (prompts of 23
    tokens, top 8): greedy output equals transformers' generate without speculation; V3.2's
    drafts are accepted (its MTP layer nearly repeats the target's one layer; GLM-5's target
    has two, the second a shared indexer layer)."""
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    shape = {**DSA_SHAPES[family], "first_k_dense_replace": 0}
    layers = 1 if family == "deepseek_v32" else 2
    if family == "glm_moe_dsa":
        shape["indexer_types"] = ["full", "shared", "full"]
    path, _ = make_tiny_mtp(family, tmp_path / family, layers, copy_layer0=True, **shape)
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(0, 256, n).tolist()} for n in (6, 23)]
    want = []
    for p in prompts:
        with torch.no_grad():
            ids = torch.tensor([p["prompt_token_ids"]])
            out = hf_model(str(path)).generate(ids, max_new_tokens=16, do_sample=False)
        want.append(out[0, ids.shape[1] :].tolist())
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(str(path), **ENGINE, speculative_config=spec)
    counter = AcceptCounter(llm)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert counter.drafted > 0 and counter.accepted < counter.drafted, vars(counter)
    assert counter.accepted > 0 or family != "deepseek_v32", vars(counter)
    core(llm).scheduler.kv_cache_manager.check_no_leaks()


def test_mtp_config_and_targets_without_mtp_layers(tmp_path):
    spec = SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 3})
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("mtp", None, 3)
    with pytest.raises(ValueError, match="prompt_lookup_min/max are for method ngram"):
        SpeculativeConfig(method="mtp", num_speculative_tokens=1, prompt_lookup_min=2)
    llama_dir = make_tiny_hf("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="LlamaForCausalLM is not one"):
        mtp_architecture(read_model_config(llama_dir, "float32", None))
    mtp = {"method": "mtp", "num_speculative_tokens": 2}  # refused as the engine starts
    with pytest.raises(ValueError, match="LlamaForCausalLM is not one"):
        EngineArgs(str(llama_dir), speculative_config=mtp).create_engine_config()
    path = make_tiny_hf(
        "deepseek_v3", tmp_path / "ds", num_nextn_predict_layers=0, **FAMILIES["deepseek_v3"]
    )
    no_mtp = read_model_config(path, "float32", None)
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM has no multi-token-prediction"):
        mtp_architecture(no_mtp)
