"""`jaxserve run-batch` (vLLM's `vllm run-batch`) on a 100-line OpenAI Batch API file: chat and
completion lines mixed with bad ones, one output line per input line in order, custom_ids
kept, each bad line's error in its own line, and greedy answers equal to `LLM.generate` /
`LLM.chat` of the same engine flags."""

from __future__ import annotations

import json

import pytest

from jaxserve.entrypoints.cli import main
from jaxserve.entrypoints.llm import LLM
from jaxserve.sampling_params import SamplingParams
from jaxserve.transformers_utils.model_path import default_model_path
from tests.helpers import make_tiny_hf

ENGINE_FLAGS = ["--max-model-len", "256", "--max-num-seqs", "16",
                "--max-num-batched-tokens", "256"]  # fmt: skip
GREEDY = {"max_tokens": 8, "temperature": 0.0}


def _line(i: int) -> dict:
    """Line i of the batch: a completion (even i) or a chat completion (odd i)."""
    if i % 2 == 0:
        url, body = "/v1/completions", {"prompt": f"Count to {i}:", **GREEDY}
    else:
        url, body = "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Say {i}."}], **GREEDY}  # fmt: skip
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


# Bad lines, by index: the text written there and (status, what its error message says).
BAD = {
    3: ("{not json", 400, "invalid batch request line"),
    5: (json.dumps({"custom_id": "req-5", "method": "POST", "url": "/v1/nope", "body": {}}),
        400, "URL /v1/nope was used. Supported endpoints: /v1/chat/completions"),
    7: (json.dumps({"custom_id": "req-7", "method": "POST", "url": "/v1/embeddings",
                    "body": {"input": "hi"}}),
        400, "does not support the Embeddings API"),  # a generating model
    9: (json.dumps({"custom_id": "req-9", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": "hi"}}),
        400, "Expected `array`, got `str` - at `$.messages`"),
    11: (json.dumps({**_line(10), "custom_id": "req-11", "body": {"prompt": "x", "stream": True}}),
         400, "must not be sent in stream mode"),
    13: (json.dumps({**_line(12), "custom_id": "req-13",
                     "body": {"prompt": "word " * 300, "max_tokens": 4}}),
         400, "maximum context length"),
    15: (json.dumps({**_line(14), "custom_id": "req-15", "method": "GET"}),
         405, "GET is not allowed on /v1/completions"),
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> list[str]:
    """A 2-layer random model with the default model's vocabulary and tokenizer."""
    model = make_tiny_hf("llama", tmp_path_factory.mktemp("tiny"), vocab_size=49152,
                         num_hidden_layers=2, max_position_embeddings=2048)  # fmt: skip
    return ["--model", str(model), "--tokenizer", str(default_model_path())]


def test_run_batch_100_lines(tiny_model, tmp_path, monkeypatch):
    lines = [json.dumps(_line(i)) for i in range(100)]
    for i, (text, _, _) in BAD.items():
        lines[i] = text
    lines[98] = json.dumps({**_line(0), "custom_id": "req-98"})  # line 0 again, later
    src, dst = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")

    assert main(["run-batch", "-i", str(src), "-o", str(dst), *tiny_model, *ENGINE_FLAGS]) == 0

    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(out) == 100
    assert [o["custom_id"] for o in out] == [
        None if i == 3 else f"req-{i}" for i in range(100)
    ]  # in order; a line that is not JSON has none
    assert len({o["id"] for o in out}) == 100 and all(o["id"].startswith("batch_req_") for o in out)
    for i, o in enumerate(out):
        if i in BAD:
            _, status, message = BAD[i]
            assert o["response"]["status_code"] == status and o["response"]["body"] is None, o
            assert (
                o["error"]["error"]["code"] == status and message in o["error"]["error"]["message"]
            )
            continue
        assert o["error"] is None and o["response"]["status_code"] == 200, o
        body = o["response"]["body"]
        assert body["object"] == ("text_completion" if i % 2 == 0 else "chat.completion")
        assert body["usage"]["completion_tokens"] == 8

    def text(i: int) -> str:
        choice = out[i]["response"]["body"]["choices"][0]
        return choice["text"] if i % 2 == 0 else choice["message"]["content"]

    assert text(98) == text(0)
    # The same greedy requests through the offline engine, with the same flags
    monkeypatch.setenv("JAXSERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(tiny_model[1], tokenizer=tiny_model[3], max_model_len=256, max_num_seqs=16,
              max_num_batched_tokens=256)  # fmt: skip
    try:
        params = SamplingParams(**GREEDY)
        [generated] = llm.generate(_line(0)["body"]["prompt"], params, use_tqdm=False)
        [chatted] = llm.chat(_line(1)["body"]["messages"], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert (generated.outputs[0].text, chatted.outputs[0].text) == (text(0), text(1))


def test_run_batch_refuses_a_url_before_loading(tmp_path):
    with pytest.raises(SystemExit, match="only a local path"):
        main(["run-batch", "-i", "https://example.com/b.jsonl", "-o", str(tmp_path / "o")])
