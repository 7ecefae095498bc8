"""/v1/completions with use_beam_search (vLLM's): n beams per prompt, best first, whole or
streamed (one chunk per choice once the search ends); chat refuses it."""

import pytest

from tests.entrypoints.openai.test_api_server import MODEL


def test_use_beam_search_gives_n_distinct_beams_whole_and_streamed(client):
    kw = dict(model=MODEL, prompt=["The capital of France is", "One, two,"], n=3,
              max_tokens=4, extra_body={"use_beam_search": True, "ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kw)
    assert [c.index for c in whole.choices] == list(range(6))
    for p in range(2):
        texts = [c.text for c in whole.choices[3 * p : 3 * p + 3]]
        assert len(set(texts)) == 3 and all(texts)
    assert all(c.finish_reason == "length" for c in whole.choices)
    assert whole.usage.completion_tokens == 6 * 4
    chunks = list(client.completions.create(**kw, stream=True))
    assert sorted((c.choices[0].index, c.choices[0].text) for c in chunks) == [
        (c.index, c.text) for c in whole.choices
    ]


def test_chat_refuses_use_beam_search(client):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}],
            extra_body={"use_beam_search": True},
        )  # fmt: skip
