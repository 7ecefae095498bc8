"""A GGUF file's tokenizer, built from its metadata with the `tokenizers` library alone.

transformers reads a GGUF tokenizer through `transformers.integrations.gguf`, which imports
torch; a serve-only install has no torch. The file carries everything needed under llama.cpp's
keys (`tokenizer.ggml.*`): the vocabulary, token types, merges or scores, special token ids and
the chat template. This module turns them into the same `tokenizers.Tokenizer` transformers
would build (same ids for any text, same decoding) and wraps it in a transformers fast
tokenizer, so the rest of the frontend (chat templates, decode) sees the usual API.

Two vocabulary types, as llama.cpp names them (`tokenizer.ggml.model`):
  gpt2   byte-level BPE (SmolLM2, Llama 3): tokens spelled in the GPT-2 byte alphabet, merges
         stored in the file, the split regex chosen by `tokenizer.ggml.pre`;
  llama  SentencePiece BPE (Llama 2, Mistral): "▁" for spaces, byte-fallback tokens <0xNN>,
         merges derived from the token scores when the file has none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from jaxserve.transformers_utils.gguf_file import gguf_reader

# llama.cpp's token types (gguf.TokenType).
_CONTROL, _USER_DEFINED = 3, 4

# Split regexes of the byte-level vocabularies whose pre-tokenizer is not GPT-2's, by
# `tokenizer.ggml.pre`. Llama 3's (tiktoken's cl100k pattern):
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}


def read_gguf_tokenizer(path: str | Path) -> Any:
    """The tokenizer of the GGUF file at `path`, as a transformers `PreTrainedTokenizerFast`.

    Raises ValueError when the file has no tokenizer or one of an unsupported type.
    """
    reader = gguf_reader(path)

    def field(key: str, default: Any = None) -> Any:
        f = reader.get_field(f"tokenizer.{key}")
        return default if f is None else f.contents()

    kind = field("ggml.model")
    tokens = field("ggml.tokens")
    if kind is None or tokens is None:
        raise ValueError(f"{path} has no tokenizer (tokenizer.ggml.model / tokens)")
    token_types = field("ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(tokens, field("ggml.merges") or [], field("ggml.pre"))
        add_bos_default = False
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(tokens, field("ggml.merges"), field("ggml.scores"))
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary by default
    else:
        raise ValueError(
            f"{path}: tokenizer type {kind!r} is not supported (supported: gpt2, llama)"
        )
    _add_special_tokens(tokenizer, kind, tokens, token_types)

    def token(key: str) -> str | None:
        token_id = field(f"ggml.{key}")
        return tokens[token_id] if token_id is not None else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(field("ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(field("ggml.add_eos_token", False)) and eos is not None
    tokenizer.post_processor = _template(
        tokenizer, bos if add_bos else None, eos if add_eos else None
    )

    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=field("chat_template"),
        clean_up_tokenization_spaces=False,
        name_or_path=str(path),
    )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: each byte as a printable character (printable bytes stand for
    themselves, the rest are shifted past 255 in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping, shift = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:  # tokens outside the alphabet are respelled byte by byte
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode())

    vocab = {spelled(t): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=False, dropout=None))
    split = _SPLITS.get(pre or "")
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(
    tokens: list[str], merges: list[str] | None, scores: list[float] | None
) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = _merges_from_scores(vocab, scores or [0.0] * len(tokens))
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two
    tokens is a merge, ranked by the merged token's score (highest first), then by the two
    halves' lengths (the order transformers derives them in)."""
    candidates = []
    for token, token_id in vocab.items():
        splits = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        splits.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        candidates += [(left, right, scores[token_id]) for left, right in splits]
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _add_special_tokens(
    tokenizer: Tokenizer, kind: str, tokens: list[str], token_types: list[int]
) -> None:
    """Control tokens (<|im_end|>, <s>) match whole as special tokens; user-defined ones
    (<think>) as plain added tokens. A byte-level vocabulary's real tokens are all spelled in
    the byte alphabet: a control token outside it is a llama.cpp mislabel and is left out."""
    alphabet = set(bytes_to_unicode().values()) if kind == "gpt2" else None
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind_ in zip(tokens, token_types, strict=True)
        if kind_ == _CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    tokenizer.add_special_tokens(control)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind_ in zip(tokens, token_types, strict=True)
        if kind_ == _USER_DEFINED
    ]
    tokenizer.add_tokens(user)


def _template(tokenizer: Tokenizer, bos: str | None, eos: str | None) -> processors.PostProcessor:
    """`bos $A eos` with whichever of the two the file asks to add."""
    ends = [(t, tokenizer.token_to_id(t)) for t in (bos, eos) if t is not None]
    single = " ".join([*([bos] if bos else []), "$A:0", *([eos] if eos else [])])
    pair = " ".join([single, *([bos] if bos else []), "$B:1", *([eos] if eos else [])])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=ends)
