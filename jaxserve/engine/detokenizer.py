"""Incremental detokenization with stop strings.

Text grows through `tokenizers`' DecodeStream, which returns nothing until a multi-byte
character is complete, so no U+FFFD is ever emitted. Stop strings are searched in the text
that could contain a new match; until a request finishes, the last (longest stop - 1)
characters are held back from what `get_next_output_text` returns, since they may turn out to
be the start of a stop string that the next tokens complete.

With skip_special_tokens and spaces_between_special_tokens both false, an added token that
follows another is its bare content, with no space before it (vLLM's fast detokenizer).
"""

from __future__ import annotations

import functools

from tokenizers.decoders import DecodeStream

from jaxserve.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        # {token id: content} of the added tokens, when spaces between them are suppressed
        self._added = None
        if not (params.skip_special_tokens or params.spaces_between_special_tokens):
            self._added = _added_tokens(tokenizer) or None
        self._last_added = False
        self._context: list[int] = []  # the last tokens that produced text
        self._pending: list[int] = []  # tokens since, held back (an incomplete character)
        # Prime the stream with the prompt's tail so the first output token is decoded in
        # context (a leading space is not lost); its text is not part of the output.
        for token_id in prompt_token_ids[-4:]:
            self._step(token_id)
        self.stop = params.stop or []
        self.include_stop = params.include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.output_text = ""
        self._sent = 0  # characters returned by get_next_output_text so far
        self.num_consumed = 0  # tokens the last update() read (all, or up to a stop string)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now matches (text then truncated,
        and `num_consumed` says how many of new_token_ids were read up to the match)."""
        for i, token_id in enumerate(new_token_ids):
            old_len = len(self.output_text)
            text = self._step(token_id)
            if self._added is not None:
                added = self._added.get(token_id)
                if added is not None and self._last_added:
                    text = added
                self._last_added = added is not None
            self.output_text += text
            stop = self._find_stop(old_len)
            if stop is not None:
                self.num_consumed = i + 1
                return stop
        self.num_consumed = len(new_token_ids)
        return None

    def _step(self, token_id: int) -> str:
        try:
            text = self.stream.step(self.backend, token_id)
        except Exception as e:  # tokenizers raises a bare Exception
            if "Invalid prefix" not in str(e):
                raise
            text = self._recover(token_id)
        if text is None:
            self._pending.append(token_id)
            return ""
        self._context, self._pending = [*self._pending, token_id][-4:], []
        return text

    def _recover(self, token_id: int) -> str:
        """Bytes that are not valid UTF-8 (a sampled model may emit any byte-fallback token)
        can change how earlier held-back bytes decode, which DecodeStream cannot handle:
        decode the held-back tokens and this one against the last decoded ones in one go,
        then restart the stream in that context."""
        decode = functools.partial(
            self.backend.decode, skip_special_tokens=self.skip_special_tokens
        )
        base = decode(self._context)
        full = decode([*self._context, *self._pending, token_id])
        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        self.stream.step(self.backend, token_id)  # context for the next token
        return full[len(base) :] if full.startswith(base) else full

    def _find_stop(self, old_len: int) -> str | None:
        for s in self.stop:
            # A match must end in the new text: start no earlier than old_len - len(s) + 1.
            idx = self.output_text.find(s, max(0, old_len - len(s) + 1))
            if idx != -1:
                end = idx + len(s) if self.include_stop else idx
                self.output_text = self.output_text[:end]
                return s
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The full text, or (delta) what is new since the last call; holds back a possible
        stop-string prefix until the request finishes."""
        end = (
            len(self.output_text)
            if finished or not self.stop
            else max(self._sent, len(self.output_text) - self.hold_back)
        )
        text = self.output_text[self._sent : end] if delta else self.output_text[:end]
        self._sent = end
        return text


def _added_tokens(tokenizer) -> dict[int, str]:
    """{token id: content} of the tokenizer's added tokens (cached on the tokenizer)."""
    added = getattr(tokenizer, "_jaxserve_added_tokens", None)
    if added is None:
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        tokenizer._jaxserve_added_tokens = added
    return added
