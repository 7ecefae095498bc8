"""Classifiers and scoring (runner="pooling"), against transformers on the same random
weights: Qwen3ForSequenceClassification's probabilities (LLM.classify, /classify), a
one-label classifier's cross-encoder scores (LLM.score, /score, /rerank sorted by them), an
embedding model's cosine scores; the activations (problem_type, sentence-transformers'),
the runner a classifier gets, and the 400s of a wrong model or input. The HTTP app runs in
this process over the LLM's own engine core (no server process, no second compile)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.core_client import InprocClient
from jaxserve.entrypoints import score_utils
from jaxserve.entrypoints.llm import LLM
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.sampling_params import SamplingParams
from tests.helpers import TINY, engines_in_process, make_tiny_hf, make_tiny_tokenizer

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, dtype="float32")
TEXTS = ["a cat sat", "the weather today is sunny and warm", "x", "dogs bark at night!!"]
QUERY = "where do cats sleep?"
DOCS = ["cats sleep in boxes", "stocks fell", "a cat naps on the sofa", "rain"]
LABELS = {0: "negative", 1: "positive"}


def make_classifier(out_dir, num_labels: int, **config):
    """A random-weight Qwen3ForSequenceClassification with the byte tokenizer, fp32."""
    import transformers

    vocab = make_tiny_tokenizer(out_dir)
    id2label = LABELS if num_labels == 2 else {0: "LABEL_0"}
    config = transformers.Qwen3Config(**{**TINY, "vocab_size": vocab, "id2label": id2label,
                                         **config})  # fmt: skip
    config.architectures = ["Qwen3ForSequenceClassification"]
    torch.manual_seed(num_labels)
    model = transformers.Qwen3ForSequenceClassification(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():  # the score head wider: probs spread out
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15 if name == "score.weight" else 0.08)
    model.save_pretrained(out_dir)
    return out_dir, model.eval()


@pytest.fixture(scope="module")
def two_labels(tmp_path_factory):
    return make_classifier(tmp_path_factory.mktemp("cls2"), 2)


@pytest.fixture(scope="module")
def one_label(tmp_path_factory):
    return make_classifier(tmp_path_factory.mktemp("cls1"), 1)


@pytest.fixture(scope="module")
def llms(two_labels, one_label):
    with engines_in_process():
        yield {
            "cls2": LLM(str(two_labels[0]), **ENGINE),  # runner "auto": pooling for a classifier
            "cls1": LLM(str(one_label[0]), runner="pooling", **ENGINE),
        }


def hf_logits(model, tokenizer, text: str, pair: str | None = None) -> np.ndarray:
    ids = tokenizer(text=text, text_pair=pair).input_ids
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy().astype(np.float64)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def test_classify_is_hfs_softmax_over_the_last_tokens_score(llms, two_labels):
    llm, (_, hf) = llms["cls2"], two_labels
    tok = llm.get_tokenizer()
    outs = llm.classify(TEXTS, use_tqdm=False)  # 9 and 36 tokens: prefilled in chunks
    for out, text in zip(outs, TEXTS, strict=True):
        want = softmax(hf_logits(hf, tok, text))
        assert out.prompt_token_ids == tok(text).input_ids and out.outputs.num_classes == 2
        np.testing.assert_allclose(out.outputs.probs, want, atol=1e-5)
    ids = list(range(40, 71))
    by_ids = llm.classify({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.probs
    with torch.no_grad():
        np.testing.assert_allclose(by_ids, softmax(hf(torch.tensor([ids])).logits[0].numpy()),
                                   atol=1e-5)  # fmt: skip
    assert len({round(o.outputs.probs[0], 3) for o in outs}) == len(TEXTS)  # they differ
    # vLLM's rules: scoring needs one label; a classifier neither embeds nor generates
    with pytest.raises(ValueError, match=r"num_labels == 1 .* has 2 labels"):
        llm.score("a", "b")
    with pytest.raises(ValueError, match="is a classifier: it serves classify"):
        llm.embed("a")
    with pytest.raises(ValueError, match="use LLM.embed"):
        llm.generate("a", SamplingParams(max_tokens=1))


def test_score_is_hfs_sigmoid_of_the_pairs_logit(llms, one_label):
    llm, (_, hf) = llms["cls1"], one_label
    tok = llm.get_tokenizer()
    want = [sigmoid(hf_logits(hf, tok, QUERY, d)[0]) for d in DOCS]
    many = llm.score(QUERY, DOCS, use_tqdm=False)  # one to many
    np.testing.assert_allclose([o.outputs.score for o in many], want, atol=1e-5)
    assert many[2].prompt_token_ids == tok(text=QUERY, text_pair=DOCS[2]).input_ids
    pairs = llm.score([QUERY, "rain"], ["cats sleep in boxes", "stocks fell"], use_tqdm=False)
    np.testing.assert_allclose(
        [o.outputs.score for o in pairs],
        [want[0], sigmoid(hf_logits(hf, tok, "rain", "stocks fell")[0])], atol=1e-5,
    )  # fmt: skip
    one = llm.classify("a cat sat", use_tqdm=False)[0].outputs.probs  # one label: sigmoid
    np.testing.assert_allclose(one, [sigmoid(hf_logits(hf, tok, "a cat sat")[0])], atol=1e-5)
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(["a", "b"], ["c", "d", "e"])
    with pytest.raises(ValueError, match="text_2 must be a string or a non-empty list"):
        llm.score("a", [])


def test_an_embedding_models_score_is_the_cosine_of_its_embeddings(tmp_path):
    from transformers import AutoModel

    model_dir = make_tiny_hf("qwen3", tmp_path, vocab_size=make_tiny_tokenizer(tmp_path))
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with engines_in_process():
        llm = LLM(str(model_dir), runner="pooling", **ENGINE)
        tok = llm.get_tokenizer()
        outs = llm.score(QUERY, DOCS[:3], use_tqdm=False)
        with pytest.raises(ValueError, match="is not a classifier"):
            llm.classify("a")
        rs = post_all(llm, [
            ("/score", {"text_1": [QUERY, "rain"], "text_2": DOCS[1:3]}),
            ("/rerank", {"query": QUERY, "documents": DOCS[:3]}),  # the query embedded once
            ("/pooling", {"input": [QUERY]}), ("/classify", {"input": "a"}),
        ])  # fmt: skip
        embedding = llm.embed(QUERY, use_tqdm=False)[0].outputs.embedding
    with torch.no_grad():
        last = {t: hf(torch.tensor([tok(t).input_ids])).last_hidden_state[0, -1].numpy()
                for t in [QUERY, "rain", *DOCS[:3]]}  # fmt: skip
    want = [score_utils.cosine(last[QUERY], last[d]) for d in DOCS[:3]]
    np.testing.assert_allclose([o.outputs.score for o in outs], want, atol=1e-5)
    pairs = [want[1], score_utils.cosine(last["rain"], last[DOCS[2]])]
    np.testing.assert_allclose([d["score"] for d in rs[0].json()["data"]], pairs, atol=1e-5)
    results = rs[1].json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(want)[::-1])
    np.testing.assert_allclose([r["relevance_score"] for r in results], sorted(want)[::-1],
                               atol=1e-5)  # fmt: skip
    tokens = len(QUERY) + sum(map(len, DOCS[:3]))  # a byte a token, the query once
    assert rs[1].json()["usage"]["prompt_tokens"] == tokens
    np.testing.assert_allclose(rs[2].json()["data"][0]["data"], embedding, atol=1e-6)
    assert rs[2].json()["data"][0]["object"] == "pooling"
    assert rs[3].status_code == 400 and "is not a classifier" in rs[3].text


def test_activations_follow_problem_type_and_sentence_transformers():
    logits = np.array([0.5, -1.0, 2.0])
    cfg = SimpleNamespace
    np.testing.assert_allclose(score_utils.classify_probs(logits, cfg()), softmax(logits))
    np.testing.assert_allclose(
        score_utils.classify_probs(logits, cfg(problem_type="multi_label_classification")),
        sigmoid(logits),
    )  # fmt: skip
    assert score_utils.classify_probs(logits, cfg(problem_type="regression")) == logits.tolist()
    assert score_utils.label_of([0.1, 0.9], cfg(id2label={"0": "no", "1": "yes"})) == "yes"
    assert score_utils.cross_encoder_score([0.3], cfg()) == pytest.approx(sigmoid(0.3))
    identity = cfg(sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})
    assert score_utils.cross_encoder_score([0.3], identity) == 0.3
    tok = lambda text=None, text_pair=None: SimpleNamespace(  # noqa: E731
        input_ids=[len(text), -1 if text_pair is None else len(text_pair)]
    )
    assert score_utils.cross_encoder_ids(tok, cfg(), "ab", "c") == [2, 1]  # the pair
    assert score_utils.cross_encoder_ids(tok, cfg(use_sep_token=False), "ab", "c") == [3, -1]


def test_a_classifiers_runner_is_pooling(two_labels):
    path = str(two_labels[0])
    for kw in ({}, {"runner": "pooling"}, {"task": "classify"}, {"task": "score"}):
        assert EngineArgs(path, **kw).create_engine_config().pooler.pooling_type == "LAST"
    with pytest.raises(ValueError, match="is a classifier: it needs runner='pooling'"):
        EngineArgs(path, runner="generate").create_engine_config()
    with pytest.raises(ValueError, match="'reward' is not one of generate, embed, embedding, cl"):
        EngineArgs(path, task="reward").create_engine_config()


class CoreInThisProcess(InprocClient):
    """An LLM's engine core under AsyncLLM: stepped on the event loop; the LLM keeps it."""

    client_index, dead = 0, None

    def poll_dead(self):
        return None

    def engine_of(self, request_id: str) -> int:
        return 0

    async def get_output_async(self):
        while not (out := self.engine_core.step()) or not out.outputs:
            await asyncio.sleep(0.001)
        return out

    def shutdown(self) -> None:
        pass


def post_all(llm: LLM, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    """The app over llm's engine core: each (path, body) posted, one after another."""
    engine = AsyncLLM(llm.llm_engine.config, CoreInThisProcess(None, llm.llm_engine.engine_core
                      .engine_core), tokenizer=llm.get_tokenizer())  # fmt: skip
    app = build_app(engine, ["m"], log_stats_interval=None)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.post(path, json=body) for path, body in requests]

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()
        app.state.cpu.shutdown(wait=False)


def test_http_classify_score_rerank_are_the_llms(llms):
    cls2, cls1 = llms["cls2"], llms["cls1"]
    classify, wrong = post_all(cls2, [("/classify", {"model": "m", "input": TEXTS[:2]}),
                                      ("/score", {"text_1": "a", "text_2": "b"})])  # fmt: skip
    body = classify.json()
    assert classify.status_code == 200 and body["object"] == "list", classify.text
    want = [o.outputs.probs for o in cls2.classify(TEXTS[:2], use_tqdm=False)]
    for i, item in enumerate(body["data"]):
        assert item["index"] == i and item["num_classes"] == 2
        np.testing.assert_allclose(item["probs"], want[i], atol=1e-6)
        assert item["label"] == LABELS[int(np.argmax(want[i]))]
    assert body["usage"]["prompt_tokens"] == len(TEXTS[0]) + len(TEXTS[1])  # a byte a token
    assert wrong.status_code == 400 and "num_labels == 1" in wrong.json()["error"]["message"]

    scores = [o.outputs.score for o in cls1.score(QUERY, DOCS, use_tqdm=False)]
    paths = ["/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"]
    bodies = [{"text_1": QUERY, "text_2": DOCS}] * 2 + [{"query": QUERY, "documents": DOCS}] * 2
    bodies.append({"query": QUERY, "documents": DOCS, "top_n": 2})
    rs = post_all(cls1, [*zip(paths, bodies, strict=True), ("/pooling", {"input": "a cat sat"})])
    for r in rs:
        assert r.status_code == 200, r.text
    probs = cls1.classify("a cat sat", use_tqdm=False)[0].outputs.probs  # a classifier's pooling
    np.testing.assert_allclose(rs[5].json()["data"][0]["data"], probs, atol=1e-6)
    for r in rs[:2]:
        assert [d["index"] for d in r.json()["data"]] == [0, 1, 2, 3]
        assert all(d["object"] == "score" for d in r.json()["data"])
        np.testing.assert_allclose([d["score"] for d in r.json()["data"]], scores, atol=1e-6)
    order = list(np.argsort(scores)[::-1])
    for r, n in zip(rs[2:5], (4, 4, 2), strict=True):
        results = r.json()["results"]
        assert [x["index"] for x in results] == order[:n]
        assert [x["document"]["text"] for x in results] == [DOCS[i] for i in order[:n]]
        np.testing.assert_allclose([x["relevance_score"] for x in results],
                                   sorted(scores, reverse=True)[:n], atol=1e-6)  # fmt: skip
    tokens = sum(len(p.prompt_token_ids) for p in cls1.score(QUERY, DOCS, use_tqdm=False))
    assert rs[2].json()["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1 has 2 texts"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2 must be a string or a non-empty"),
        ("/score", {"text_1": "a", "text_2": [1]}, "$.text_2"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n=-1"),
        ("/rerank", {"query": "a", "documents": []}, "documents must be a string or a non-em"),
        ("/rerank", {"query": "a" * 70, "documents": ["b"]}, "64"),
        ("/classify", {"input": []}, "input must not be empty"),
        ("/v1/embeddings", {"input": "a"}, "is a classifier: it serves classify"),
        ("/v1/completions", {"prompt": "a"}, "does not support the Completions API"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_value(llms, path, body, message):
    bad, good = post_all(llms["cls1"], [(path, body), ("/score", {"text_1": "a", "text_2": "b"})])
    assert bad.status_code == 400 and message in bad.json()["error"]["message"], bad.text
    assert good.status_code == 200  # still serving


def test_a_generating_server_refuses_them_naming_the_flag(tmp_path):
    from tests.engine.test_kv_transfer_params import FakeCore, config

    engine = AsyncLLM(config(), FakeCore(), tokenizer=None)
    app = build_app(engine, ["m"], log_stats_interval=None)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.post(p, json=b) for p, b in [
                ("/classify", {"input": "a"}), ("/v1/score", {"text_1": "a", "text_2": "b"}),
                ("/v2/rerank", {"query": "a", "documents": ["b"]}), ("/pooling", {"input": "a"}),
            ]]  # fmt: skip

    try:
        responses = asyncio.run(main())
    finally:
        engine.shutdown()
        app.state.cpu.shutdown(wait=False)
    for r, api in zip(responses, ("Classification", "Score", "Rerank", "Pooling"), strict=True):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == (
            f"The model does not support the {api} API (serve it --runner pooling)"
        )
