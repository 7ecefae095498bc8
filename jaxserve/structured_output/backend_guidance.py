"""The llguidance backend: a request's constraint -> an llguidance grammar -> a matcher.

llguidance (no torch, unlike xgrammar) compiles JSON schemas, regexes, Lark and GBNF grammars
lazily, so a matcher is ready in about a millisecond and a step's mask over a 49k vocabulary
costs one to two milliseconds. `grammar_spec` is the one translation from vLLM's
`structured_outputs` kinds to llguidance's grammar text; the frontend validates with it
(`validate_structured_outputs`, a 400 before queueing) and the engine core compiles with it.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import numpy as np

from jaxserve.sampling_params import StructuredOutputsParams

# JSON whitespace between tokens unless the request says otherwise: flexible (any of the four
# JSON whitespace characters) but at most 24 in a row. Unbounded whitespace lets a sampled
# model wander into newlines until max_tokens cuts the JSON short (seen at temperature 1.0
# with SmolLM2-135M); 24 still fits pretty-printed JSON nested ten levels deep.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"


def grammar_spec(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for a constraint. ValueError when the constraint is not
    well-formed (a schema that is not JSON, an unreadable grammar)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema: Any = params.json if kind == "json" else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"Invalid JSON grammar specification: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
        if not params.disable_any_whitespace:
            options["whitespace_pattern"] = params.whitespace_pattern or JSON_WHITESPACE
        if params.disable_additional_properties and isinstance(schema, dict):
            schema = _no_additional_properties(schema)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise ValueError(f"Invalid JSON grammar specification: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", params.choice)
    if kind == "grammar":
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF/EBNF
    return _structural_tag_grammar(params.structural_tag)


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """ValueError that says what is wrong with a constraint (without a tokenizer: what
    llguidance checks of the grammar itself)."""
    spec = grammar_spec(params)
    try:
        error = llguidance.LLMatcher.validate_grammar(spec)
    except Exception as e:  # llguidance raises only on misuse; still a bad request here
        error = f"{type(e).__name__}: {e}"
    if error:
        raise ValueError(f"Invalid {params.kind} specification for structured outputs: {error}")


def _structural_tag_grammar(text: str) -> str:
    """vLLM's structural_tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}:
    free text where each trigger starts a tagged segment whose body follows the schema."""
    try:
        tag = json.loads(text)
        structures, triggers = tag["structures"], tag["triggers"]
        tags = []
        for s in structures:
            trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
            if trigger is None:
                raise ValueError(f"no trigger starts the structure's begin {s['begin']!r}")
            tags.append(
                llguidance.StructTag(
                    trigger=trigger, begin=s["begin"], grammar=s.get("schema", {}), end=s["end"]
                )
            )
        return llguidance.StructTag.to_grammar(tags)
    except (json.JSONDecodeError, KeyError, TypeError, AssertionError, ValueError) as e:
        raise ValueError(f"Invalid structural_tag specification: {e!r}") from None


def _no_additional_properties(schema: Any) -> Any:
    """The schema with additionalProperties false on every object that does not say."""
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items() if k != "properties"}
    properties = schema.get("properties")
    if isinstance(properties, dict):  # a map of names to schemas
        out["properties"] = {k: _no_additional_properties(v) for k, v in properties.items()}
        out.setdefault("additionalProperties", False)
    return out


class GuidanceBackend:
    """Compiles constraints against the model's tokenizer (built once, ~0.5 s)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        import llguidance.hf

        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor()

    def compile_grammar(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_spec(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"cannot compile the {params.kind} constraint: {matcher.get_error()}")
        return GuidanceGrammar(matcher)

    def fill_bitmask(
        self, grammars: list[tuple[GuidanceGrammar, int, list[int]]], bitmask: np.ndarray
    ) -> None:
        """Write each grammar's allowed-token mask into its row of bitmask: i32[S, ceil(V/32)]
        (bit t % 32 of word t // 32 set = token t allowed), in parallel threads. With draft
        tokens, row + j + 1 gets the mask after the first j + 1 drafts, up to the first draft
        the grammar refuses (later rows are left as they are); the grammar is left as it was."""
        import llguidance.numpy

        if any(drafts for _, _, drafts in grammars):
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(
                self.executor, [(g.matcher, row, drafts) for g, row, drafts in grammars], bitmask
            )
        else:
            llguidance.numpy.fill_next_token_bitmask_par(
                self.executor, [(g.matcher, row) for g, row, _ in grammars], bitmask
            )


class GuidanceGrammar:
    """One request's grammar state: it advances with every token the request keeps."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """False when a token breaks the grammar (the request is then left unconstrained by a
        matcher in its error state, which allows nothing more: the caller stops it)."""
        return self.matcher.consume_tokens(token_ids)

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of token_ids, in order, the grammar would accept now (nothing consumed)."""
        return self.matcher.validate_tokens(token_ids)

    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing after it (only EOS)."""
        return self.matcher.is_stopped()
