"""Reasoning parsers: split a completion into reasoning (`<think>...</think>`) and content.

vLLM's interface (`extract_reasoning`, `extract_reasoning_streaming`, `is_reasoning_end`,
`extract_content_ids`) and registry (`ReasoningParserManager`). Text is the source of truth: a
tokenizer whose vocab has `<think>` / `</think>` as single tokens only makes the id-based checks
exact and cheap; without one (None, or a vocab that lacks the tags) they work on decoded text.

Streaming never emits part of a tag: a tail of text that may still become a tag (`</th`) is held
back until the next delta decides it, and `flush_streaming` releases what is still held at the
end of a stream (a truncated `</th` is then reasoning, as in `extract_reasoning`). Make one
parser per request, as vLLM does; deltas must satisfy previous_text + delta_text == current_text.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from jaxserve.chat_messages import DeltaMessage

_LEADING_SPACE = re.compile(r"\s*")
_TAG_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> tag ids


class _Bounds(NamedTuple):
    """Where reasoning and content lie in a text: text[rs:re] and text[cs:ce]."""

    rs: int
    re: int
    cs: int
    ce: int
    ended: bool  # the reasoning is over (or there is none): the rest is content


def _held_suffix(text: str, start: int, tag: str) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """Base parser for `<think>...</think>` reasoning; subclasses set when reasoning is implied.

    Non-streaming: an optional leading `<think>` (after optional whitespace) is stripped; the text
    up to the first `</think>` is reasoning and the rest is content, kept as-is. Empty parts are
    None. Without `</think>`: see `_implicit_reasoning`. A subclass may end the reasoning at
    other tags too (`extra_end_tokens`, dropped like `</think>`; `content_start_tokens`, kept as
    the content's start) and turn thinking off (`_no_reasoning`: all of the text is content).
    """

    start_token = "<think>"
    end_token = "</think>"
    # Other texts that end the reasoning: dropped as end_token is, or kept as the content's start
    extra_end_tokens: tuple[str, ...] = ()
    content_start_tokens: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any = None, *args: Any, **kwargs: Any) -> None:
        self.model_tokenizer = tokenizer
        self.chat_template_kwargs: dict[str, Any] = dict(kwargs.get("chat_template_kwargs") or {})
        self._end_tags = (self.end_token, *self.extra_end_tokens, *self.content_start_tokens)
        self._end_len = max(len(t) for t in self._end_tags)
        self.start_token_id, self.end_token_id, self._end_ids, self._content_ids = self._tag_ids(
            tokenizer
        )
        self._memo: tuple[str, _Bounds] | None = None  # the last streamed text and its bounds

    def _tag_ids(self, tokenizer: Any) -> tuple[int | None, int | None, frozenset, frozenset]:
        """The ids of the start and end tags, of every tag that ends the reasoning and of
        those kept in the content (the ones the vocab has)."""
        if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
            return None, None, frozenset(), frozenset()
        key = (self.start_token, self._end_tags, self.content_start_tokens)
        try:
            cached = _TAG_IDS.setdefault(tokenizer, {})
        except TypeError:  # not weak-referenceable: no cache
            cached = {}
        if key not in cached:
            vocab = tokenizer.get_vocab()
            cached[key] = (
                vocab.get(self.start_token),
                vocab.get(self.end_token),
                frozenset(vocab[t] for t in self._end_tags if t in vocab),
                frozenset(vocab[t] for t in self.content_start_tokens if t in vocab),
            )
        return cached[key]

    def adjust_request(self, request: Any) -> Any:
        """Change a chat request before generation (e.g. keep special tokens); default: as is."""
        return request

    def _implicit_reasoning(self, request: Any = None) -> bool:
        """Whether text not opened by `<think>` is reasoning (True: the prompt opened it)."""
        return True

    def _no_reasoning(self) -> bool:
        """Whether thinking is off: all of the text is content, tags and all."""
        return False

    def _find_end(self, text: str, start: int) -> tuple[int, int] | None:
        """(where the reasoning ends, where the content starts) at the first tag that ends
        it in text[start:]; None if there is none."""
        end = text.find(self.end_token, start)
        found = (end, end + len(self.end_token)) if end >= 0 else None
        for tags, keep in ((self.extra_end_tokens, False), (self.content_start_tokens, True)):
            for tag in tags:
                at = text.find(tag, start, found[0] + len(tag) - 1 if found else len(text))
                if at >= 0:
                    found = (at, at if keep else at + len(tag))
        return found

    def _end_hold(self, text: str, start: int) -> int:
        """The length of text's tail (from start) that may still become an end tag."""
        return max(_held_suffix(text, start, tag) for tag in self._end_tags)

    def _bounds(
        self, text: str, final: bool, search_from: int = 0, implicit: bool | None = None
    ) -> _Bounds:
        """Split text; unless final, hold back what may still become a tag."""
        if self._no_reasoning():
            return _Bounds(0, 0, 0, len(text), True)
        lead = _LEADING_SPACE.match(text).end()
        if text.startswith(self.start_token, lead):
            body = lead + len(self.start_token)
        elif not final and self.start_token.startswith(text[lead : lead + len(self.start_token)]):
            return _Bounds(0, 0, 0, 0, False)  # may still become a leading <think>
        elif self._implicit_reasoning() if implicit is None else implicit:
            body = 0
        else:
            return _Bounds(0, 0, 0, len(text), True)  # no reasoning at all
        found = self._find_end(text, max(body, search_from))
        if found is not None:
            return _Bounds(body, found[0], found[1], len(text), True)
        stop = len(text) if final else len(text) - self._end_hold(text, body)
        return _Bounds(body, stop, stop, stop, False)

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole completion; an empty part is None."""
        b = self._bounds(model_output, final=True, implicit=self._implicit_reasoning(request))
        return model_output[b.rs : b.re] or None, model_output[b.cs : b.ce] or None

    def _streamed_bounds(self, text: str) -> _Bounds:
        if self._memo is not None and self._memo[0] == text:
            return self._memo[1]
        return self._bounds(text, final=False)

    @staticmethod
    def _delta(text: str, sent: _Bounds, now: _Bounds) -> DeltaMessage | None:
        """What `now` has beyond `sent` (both bounds of prefixes of text, sent ⊆ now)."""
        reasoning = text[now.rs + sent.re - sent.rs : now.re]
        content = text[now.cs + sent.ce - sent.cs : now.ce]
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning=reasoning or None, content=content or None)

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        """The delta to send for delta_text (reasoning, content or both); None: nothing yet."""
        sent = self._streamed_bounds(previous_text)
        # No end tag can start before these (text only grows), so the search stays O(delta).
        search_from = sent.re if sent.ended else max(0, len(previous_text) - self._end_len)
        now = self._bounds(current_text, final=False, search_from=search_from)
        self._memo = (current_text, now)
        return self._delta(current_text, sent, now)

    def flush_streaming(self, text: str) -> DeltaMessage | None:
        """At the end of a stream (text: all of it), what was held back as a possible tag."""
        return self._delta(text, self._streamed_bounds(text), self._bounds(text, final=True))

    def is_reasoning_end_text(self, text: str) -> bool:
        """Whether the reasoning is over in text; the last tag wins, as in is_reasoning_end."""
        if self._no_reasoning():
            return True
        end = max(text.rfind(tag) for tag in self._end_tags)
        start = text.rfind(self.start_token)
        if end >= 0 or start >= 0:
            return end > start
        return not self._implicit_reasoning()

    def _decoder(self) -> Callable[[Sequence[int]], str] | None:
        decode = getattr(self.model_tokenizer, "decode", None)
        if decode is None:
            return None
        return lambda ids: decode(list(ids), skip_special_tokens=False)

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the reasoning is over, given the generated ids so far (or prompt + them).

        Scans back for the last tag id; without a `</think>` id, decodes the ids (O(n) each
        call) and defers to is_reasoning_end_text; with no tokenizer, True only when no reasoning
        is implied (qwen3 with enable_thinking False).
        """
        if self._no_reasoning():
            return True
        if self.end_token_id is None:
            decode = self._decoder()
            if decode is None:
                return not self._implicit_reasoning()
            return self.is_reasoning_end_text(decode(token_ids))
        for tid in reversed(token_ids):
            if tid in self._end_ids:
                return True
            if tid == self.start_token_id:
                return False
        return not self._implicit_reasoning()

    def _ended(self, text: str) -> bool:
        """Whether the reasoning in a whole text is over (extract_content_ids' test)."""
        return self._bounds(text, final=True).ended

    def extract_content_ids(self, token_ids: Sequence[int]) -> list[int]:
        """The ids after the first `</think>` (all of them when there is no reasoning); [] if the
        reasoning has not ended. Without a `</think>` id: the ids after the one whose decoding
        completes the tag (found by bisection; a token straddling the tag is left out)."""
        ids = list(token_ids)
        if self._no_reasoning():
            return ids
        if self.end_token_id is not None:
            if len(self._end_ids) > 1:  # the first of several tags
                at = next((i for i, t in enumerate(ids) if t in self._end_ids), None)
                if at is not None:
                    return ids[at if ids[at] in self._content_ids else at + 1 :]
            elif self.end_token_id in ids:
                return ids[ids.index(self.end_token_id) + 1 :]
            has_start = self.start_token_id is not None and self.start_token_id in ids
            return ids if not has_start and not self._implicit_reasoning() else []
        decode = self._decoder()
        if decode is None or not self._ended(decode(ids)):
            return []
        lo, hi = 0, len(ids)  # the shortest prefix whose text has ended reasoning
        while lo < hi:
            mid = (lo + hi) // 2
            if self._ended(decode(ids[:mid])):
                hi = mid
            else:
                lo = mid + 1
        return ids[lo:]


class ReasoningParserManager:
    """Registry of reasoning parsers by name (`--reasoning-parser NAME`)."""

    reasoning_parsers: dict[str, type[ReasoningParser]] = {}

    @classmethod
    def register_module(
        cls, name: str | list[str] | None = None
    ) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
        """Class decorator registering a parser under name(s) (default: the class name)."""

        def register(parser: type[ReasoningParser]) -> type[ReasoningParser]:
            names = [name] if isinstance(name, str) else (name or [parser.__name__])
            for n in names:
                cls.reasoning_parsers[n] = parser
            return parser

        return register

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        """The parser class registered as name; ValueError naming the known ones otherwise."""
        if name not in cls.reasoning_parsers:
            known = ", ".join(cls.list_names()) or "none"
            raise ValueError(f"unknown reasoning parser {name!r}; known: {known}")
        return cls.reasoning_parsers[name]

    @classmethod
    def list_names(cls) -> list[str]:
        """The registered names, sorted."""
        return sorted(cls.reasoning_parsers)
