"""Reasoning parsers on recorded-style outputs: non-streaming splits, streaming in every chunking
(tags split across deltas) adding up to the same split, and the token-id checks."""

from __future__ import annotations

import re

import pytest

from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest
from jaxserve.reasoning import ReasoningParser, ReasoningParserManager
from jaxserve.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from jaxserve.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

OFF = {"chat_template_kwargs": {"enable_thinking": False}}

# (parser name, constructor kwargs, model output, reasoning, content)
CASES = [
    # DeepSeek-R1: <think> is in the prompt, the output starts with the reasoning.
    (
        "deepseek_r1",
        {},
        "Let me think... 2 + 2: add two and two, that is 4.\n</think>The answer is 4.",
        "Let me think... 2 + 2: add two and two, that is 4.\n",
        "The answer is 4.",
    ),
    # R1-0528 repeats <think>.
    (
        "deepseek_r1",
        {},
        "<think>\nOkay, the user asks for 2 + 2.\n</think>\n\nThe answer is **4**.",
        "\nOkay, the user asks for 2 + 2.\n",
        "\n\nThe answer is **4**.",
    ),
    ("deepseek_r1", {}, "\n<think>a < b</think>so b > a", "a < b", "so b > a"),
    ("deepseek_r1", {}, "<think></think>hi", None, "hi"),
    ("deepseek_r1", {}, "Okay, so I need to compute", "Okay, so I need to compute", None),
    ("deepseek_r1", {}, "Hmm, let me check</thi", "Hmm, let me check</thi", None),
    ("deepseek_r1", {}, "<thin", "<thin", None),
    ("deepseek_r1", {}, "Done.</think>", "Done.", None),
    ("deepseek_r1", {}, "", None, None),
    # Qwen3 (<= 2507 template): the model opens <think> itself.
    (
        "qwen3",
        {},
        "<think>\nThe user asks for the capital of France. It is Paris.\n</think>\n\nParis",
        "\nThe user asks for the capital of France. It is Paris.\n",
        "\n\nParis",
    ),
    # Qwen3.5 / thinking models: <think> is in the prompt.
    (
        "qwen3",
        {},
        "Capital of France: Paris.\n</think>\n\nParis",
        "Capital of France: Paris.\n",
        "\n\nParis",
    ),
    ("qwen3", {}, "<think></think>hi", None, "hi"),
    ("qwen3", {}, "<think>\nLet me recall the", "\nLet me recall the", None),
    ("qwen3", {}, "Paris is the capital.", "Paris is the capital.", None),  # truncated thought
    # enable_thinking=False: the prompt closes an empty think block; all of it is content.
    ("qwen3", OFF, "Paris is the capital of France.", None, "Paris is the capital of France."),
    ("qwen3", OFF, "If a < b then </th is just text", None, "If a < b then </th is just text"),
    ("qwen3", OFF, "<think>\nhmm\n</think>\n\nParis", "\nhmm\n", "\n\nParis"),
]
TAGS = ("<think>", "</think>")


def make(name: str, kwargs: dict, tokenizer=None) -> ReasoningParser:
    return ReasoningParserManager.get_reasoning_parser(name)(tokenizer, **kwargs)


def chunkings(text: str):
    """Ways to cut text into deltas: 1, 3 and 7 characters, whole, and cuts inside every tag."""
    for n in (1, 3, 7):
        yield [text[i : i + n] for i in range(0, len(text), n)]
    yield [text]
    for tag in TAGS:
        for m in re.finditer(re.escape(tag), text):
            for k in range(1, len(tag)):
                cut = m.start() + k
                yield [text[:cut], text[cut:]]
                yield [text[: m.start()], tag[:k], tag[k:], text[m.end() :]]


def stream(parser: ReasoningParser, chunks: list[str], ids: list[list[int]] | None = None):
    """Feed the deltas; (reasoning, content, the flushed tail's delta)."""
    reasoning, content, prev, prev_ids = "", "", "", []
    for i, piece in enumerate(chunks):
        delta_ids = ids[i] if ids else []
        cur, cur_ids = prev + piece, prev_ids + delta_ids
        d = parser.extract_reasoning_streaming(prev, cur, piece, prev_ids, cur_ids, delta_ids)
        if d is not None:
            assert d.reasoning or d.content, "a delta with nothing in it"
            reasoning += d.reasoning or ""
            content += d.content or ""
        prev, prev_ids = cur, cur_ids
    tail = parser.flush_streaming(prev)
    if tail is not None:
        reasoning += tail.reasoning or ""
        content += tail.content or ""
    return reasoning, content, tail


@pytest.mark.parametrize("name,kwargs,output,reasoning,content", CASES)
def test_non_streaming(name, kwargs, output, reasoning, content):
    assert make(name, kwargs).extract_reasoning(output, None) == (reasoning, content)


@pytest.mark.parametrize("name,kwargs,output,reasoning,content", CASES)
def test_streaming_matches_non_streaming(name, kwargs, output, reasoning, content):
    for chunks in chunkings(output):
        got_r, got_c, tail = stream(make(name, kwargs), chunks)
        assert (got_r, got_c) == (reasoning or "", content or ""), chunks
        # Only a truncated tag prefix is ever held back to the end of the stream.
        truncated_tag = any(output.endswith(t[:k]) for t in TAGS for k in range(1, len(t)))
        assert tail is None or truncated_tag, chunks


@pytest.mark.parametrize("name,kwargs,output,reasoning,content", CASES)
def test_no_tag_leaks(name, kwargs, output, reasoning, content):
    for part in (reasoning or "", content or ""):
        assert "<think>" not in part and "</think>" not in part


def test_delta_straddling_end_tag_carries_both():
    p = DeepSeekR1ReasoningParser(None)
    assert p.extract_reasoning_streaming("", "ab", "ab", [], [], []).reasoning == "ab"
    d = p.extract_reasoning_streaming("ab", "abc</think>d", "c</think>d", [], [], [])
    assert (d.reasoning, d.content) == ("c", "d")
    d = p.extract_reasoning_streaming("abc</think>d", "abc</think>def", "ef", [], [], [])
    assert (d.reasoning, d.content) == (None, "ef")


def test_possible_tag_is_held_until_decided():
    p = DeepSeekR1ReasoningParser(None)
    assert p.extract_reasoning_streaming("", "x</th", "x</th", [], [], []).reasoning == "x"
    assert p.extract_reasoning_streaming("x</th", "x</thi", "i", [], [], []) is None
    d = p.extract_reasoning_streaming("x</thi", "x</thin", "n", [], [], [])
    assert d is None
    d = p.extract_reasoning_streaming("x</thin", "x</thinking", "king", [], [], [])
    assert (d.reasoning, d.content) == ("</thinking", None)  # not the tag after all
    # The start: "<" may open <think>, "<b" may not.
    q = DeepSeekR1ReasoningParser(None)
    assert q.extract_reasoning_streaming("", "<", "<", [], [], []) is None
    assert q.extract_reasoning_streaming("<", "<b", "b", [], [], []).reasoning == "<b"


def test_parser_reused_and_rebuilt_strings():
    """The memo is keyed on the text: a second stream, or equal but new strings, still work."""
    p = DeepSeekR1ReasoningParser(None)
    for _ in range(2):
        assert stream(p, ["r</th", "ink>c"])[:2] == ("r", "c")
    p = DeepSeekR1ReasoningParser(None)
    p.extract_reasoning_streaming("", "ab</", "ab</", [], [], [])
    d = p.extract_reasoning_streaming("".join(["ab", "</"]), "ab</think>", "think>", [], [], [])
    assert d is None


def test_qwen3_thinking_switch_from_request():
    p = Qwen3ReasoningParser(None)
    off = ChatCompletionRequest(messages=[], chat_template_kwargs={"enable_thinking": False})
    assert p.extract_reasoning("Paris", off) == (None, "Paris")
    assert p.extract_reasoning("Paris", ChatCompletionRequest(messages=[])) == ("Paris", None)
    assert stream(Qwen3ReasoningParser(None, **OFF), list("Paris"))[:2] == ("", "Paris")


class FakeTokenizer:
    """A character tokenizer; with_tags adds <think> and </think> as single tokens."""

    def __init__(self, with_tags: bool) -> None:
        self.vocab = {chr(i): i for i in range(32, 127)} | {"\n": 10}
        if with_tags:
            self.vocab |= {"<think>": 1000, "</think>": 1001}
        self.inv = {i: t for t, i in self.vocab.items()}
        self.vocab_calls = 0

    def get_vocab(self) -> dict[str, int]:
        self.vocab_calls += 1
        return dict(self.vocab)

    def encode(self, text: str) -> list[int]:
        pieces = re.split("(</?think>)", text) if "<think>" in self.vocab else [text]
        ids = []
        for piece in pieces:
            ids += [self.vocab[piece]] if piece in self.vocab else [self.vocab[c] for c in piece]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.inv[i] for i in ids)


def test_tag_ids_from_vocab_cached_per_tokenizer():
    tok = FakeTokenizer(with_tags=True)
    p = DeepSeekR1ReasoningParser(tok)
    assert (p.start_token_id, p.end_token_id) == (1000, 1001)
    Qwen3ReasoningParser(tok)
    assert tok.vocab_calls == 1
    plain = DeepSeekR1ReasoningParser(FakeTokenizer(with_tags=False))
    assert (plain.start_token_id, plain.end_token_id) == (None, None)


@pytest.mark.parametrize("name,kwargs,output,reasoning,content", CASES)
def test_streaming_token_by_token_with_ids(name, kwargs, output, reasoning, content):
    tok = FakeTokenizer(with_tags=True)
    ids = tok.encode(output)
    chunks = [tok.decode([i]) for i in ids]
    got_r, got_c, _ = stream(make(name, kwargs, tok), chunks, [[i] for i in ids])
    assert (got_r, got_c) == (reasoning or "", content or "")


@pytest.mark.parametrize("with_tags", [True, False])
def test_is_reasoning_end_and_content_ids(with_tags):
    """By tag ids when the vocab has them, else by decoding the ids: the same answers."""
    tok = FakeTokenizer(with_tags)
    p = DeepSeekR1ReasoningParser(tok)
    enc = tok.encode
    assert not p.is_reasoning_end(enc("Let me think"))
    assert not p.is_reasoning_end(enc("<think>Let me think</th"))
    assert p.is_reasoning_end(enc("<think>Let me think</think>"))
    assert p.is_reasoning_end(enc("Let me think</think>The answer"))
    assert not p.is_reasoning_end(enc("old</think>answer<think>new"))  # last tag wins
    assert p.extract_content_ids(enc("Let me think")) == []
    assert p.extract_content_ids(enc("Let me think</think>")) == []
    assert p.extract_content_ids(enc("<think>Hm</think>The answer")) == enc("The answer")
    q = Qwen3ReasoningParser(tok, **OFF)
    assert q.is_reasoning_end(enc("Paris")) and q.extract_content_ids(enc("Paris")) == enc("Paris")
    assert not q.is_reasoning_end(enc("<think>hm"))
    assert q.extract_content_ids(enc("<think>hm")) == []


def test_without_tokenizer():
    p = DeepSeekR1ReasoningParser(None)
    assert (p.start_token_id, p.end_token_id) == (None, None)
    assert not p.is_reasoning_end([1, 2, 3])
    assert Qwen3ReasoningParser(None, **OFF).is_reasoning_end([1, 2, 3])
    assert p.is_reasoning_end_text("abc</think>x")
    assert not p.is_reasoning_end_text("abc</thi")
    assert not p.is_reasoning_end_text("a</think>b<think>c")
    assert not Qwen3ReasoningParser(None).is_reasoning_end_text("Paris")
    assert Qwen3ReasoningParser(None, **OFF).is_reasoning_end_text("Paris")


def test_manager(monkeypatch):
    assert {"deepseek_r1", "qwen3"} <= set(ReasoningParserManager.list_names())
    assert ReasoningParserManager.get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match=r"'nope'.*deepseek_r1.*qwen3"):
        ReasoningParserManager.get_reasoning_parser("nope")
    monkeypatch.setattr(
        ReasoningParserManager, "reasoning_parsers", dict(ReasoningParserManager.reasoning_parsers)
    )

    @ReasoningParserManager.register_module(["a", "b"])
    class Mine(ReasoningParser):
        pass

    assert ReasoningParserManager.get_reasoning_parser("b") is Mine
    assert {"a", "b"} <= set(ReasoningParserManager.list_names())
