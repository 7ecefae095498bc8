"""The tokenizer built from GGUF metadata without torch gives transformers' GGUF tokenizer's ids
(transformers needs torch for it) on a few hundred strings, for the bundled byte-level BPE and a
SentencePiece (llama) vocabulary written here; and serving a GGUF never imports transformers'
GGUF integration."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from tokenizers import SentencePieceBPETokenizer

from jaxserve.transformers_utils.gguf_tokenizer import read_gguf_tokenizer
from jaxserve.transformers_utils.model_path import default_model_path
from jaxserve.transformers_utils.tokenizer import read_tokenizer
from tests.helpers import hf_model, make_tiny_hf, write_llama_gguf

WORDS = [
    "the", "capital", "of", "France", "Paris", "don't", "I'll", "hello", "world", "x=1;",
    "naïve", "café", "Straße", "über", "2026-11-23", "3.14159", "1234567", "#include",
    "<s>", "</s>", "<think>", "def", "return", "...", "!!", "(a, b)", "\\n", "@user",
]  # fmt: skip
CJK = ["你好", "世界", "日本語", "東京", "한국어", "中文分词", "，", "。"]
EMOJI = ["🤖", "👍🏽", "🇫🇷", "👨‍👩‍👧", "✨", "🙂"]
SPACES = [" ", "  ", "\n", "\n\n", "\t", " \n ", "   "]


def sample_texts(seed: int, n: int) -> list[str]:
    """n strings mixing ASCII words, accents, CJK, emoji and odd whitespace (leading and
    trailing included), deterministic in seed."""
    rng = np.random.default_rng(seed)
    pools = [WORDS, WORDS, CJK, EMOJI, SPACES]
    texts = ["", " ", "a", "Hello world", " leading space", "trailing  ", "a\r\nb"]
    while len(texts) < n:
        parts = []
        for _ in range(rng.integers(1, 12)):
            pool = pools[rng.integers(len(pools))]
            parts.append(str(pool[rng.integers(len(pool))]))
            parts.append(" " if rng.random() < 0.7 else "")
        texts.append("".join(parts))
    return texts


def chat_texts(tokenizer, texts: list[str]) -> list[str]:
    out = []
    for i in range(0, len(texts) - 1, 2):
        messages = [
            {"role": "user", "content": texts[i]},
            {"role": "assistant", "content": texts[i + 1]},
        ]
        out.append(tokenizer.apply_chat_template(messages, tokenize=False))
    return out


def assert_same_tokenizer(ours, ref, texts: list[str]) -> None:
    for text in texts:
        ids = ref(text).input_ids
        assert ours(text).input_ids == ids, text
        assert (
            ours(text, add_special_tokens=False).input_ids
            == ref(text, add_special_tokens=False).input_ids
        ), text
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        ), text
    assert ours.all_special_tokens == ref.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert len(ours) == len(ref)


def test_bundled_byte_level_bpe_matches_transformers():
    from transformers import AutoTokenizer

    path = default_model_path()
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = read_gguf_tokenizer(path)
    texts = sample_texts(0, 300)
    texts += chat_texts(ref, texts[:100])
    assert_same_tokenizer(ours, ref, texts)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == (
        ref.apply_chat_template(messages, add_generation_prompt=True)
    )


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


def sentencepiece_metadata() -> dict:
    """A llama.cpp SentencePiece vocabulary (`tokenizer.ggml.model` = llama): <unk>, <s>, </s>,
    the 256 byte-fallback tokens, a user-defined <think>, then BPE pieces learned here, scored
    by merge order; no merges stored (they are derived from the scores)."""
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Paris is the capital of France; Berlin is the capital of Germany.",
        "Hello world! How are you today? I'm fine, thanks.",
        "numbers 123 4567 89, dates 2026-11-23, def return include",
        "Les élèves étudient à l'école. Straße über naïve café",
    ] * 4
    bpe = SentencePieceBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=400, min_frequency=1, show_progress=False)
    pieces = [t for t, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1]) if t != "<unk>"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<think>", *pieces]
    types = [2, 3, 3, *[6] * 256, 4, *[1] * len(pieces)]  # unknown, control, byte, user, normal
    scores = [0.0] * 260 + [-float(i) for i in range(len(pieces))]
    return {
        "ggml.model": "llama",
        "ggml.tokens": tokens,
        "ggml.token_type": types,
        "ggml.scores": scores,
        "ggml.bos_token_id": 1,
        "ggml.eos_token_id": 2,
        "ggml.unknown_token_id": 0,
        "chat_template": CHAT_TEMPLATE,
    }


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory):
    """A tiny llama model with the SentencePiece vocabulary above, as a GGUF file."""
    tokenizer = sentencepiece_metadata()
    hf_dir = make_tiny_hf(
        "llama", tmp_path_factory.mktemp("hf"), vocab_size=len(tokenizer["ggml.tokens"])
    )
    path = tmp_path_factory.mktemp("gguf") / "spm.gguf"
    write_llama_gguf(path, hf_model(str(hf_dir)), tokenizer=tokenizer)
    return path


def test_sentencepiece_vocabulary_matches_transformers(sentencepiece_gguf):
    from transformers import AutoTokenizer

    path = sentencepiece_gguf
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = read_gguf_tokenizer(path)
    texts = sample_texts(1, 300)
    texts += chat_texts(ref, texts[:100])
    assert_same_tokenizer(ours, ref, texts)
    assert ours("hi").input_ids[0] == 1  # llama.cpp adds BOS to a SentencePiece vocabulary
    # a character outside the vocabulary falls back to its UTF-8 bytes
    bytes_ = ["<0xE6>", "<0x97>", "<0xA5>"]
    assert ours.convert_ids_to_tokens(ours("日").input_ids) == ["<s>", "▁", *bytes_]


def test_unsupported_tokenizer_type_is_named(tmp_path):
    import gguf

    path = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("rwkv")
    writer.add_token_list(["a", "b"])
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file):
        step()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"rwkv\.gguf: tokenizer type 'rwkv' is not supported"):
        read_gguf_tokenizer(path)


def test_serving_a_gguf_never_imports_transformers_gguf_integration(sentencepiece_gguf):
    """In a fresh interpreter the engine loads the GGUF, tokenizes, generates and detokenizes;
    torch is installed here, so an import of the integration would succeed: look for it."""
    script = textwrap.dedent(
        f"""
        import json, sys
        from jaxserve import LLM, SamplingParams
        llm = LLM({str(sentencepiece_gguf)!r}, max_model_len=64, max_num_seqs=4,
                  max_num_batched_tokens=64)
        out = llm.generate(["Paris is the"], SamplingParams(temperature=0, max_tokens=4))
        print(json.dumps({{
            "text": out[0].outputs[0].text,
            "gguf_modules": sorted(  # transformers' own, not jaxserve.transformers_utils
                m for m in sys.modules if "gguf" in m and m.startswith("transformers.")
            ),
        }}))
        """
    )
    env = {**os.environ, "JAXSERVE_ENABLE_MULTIPROCESSING": "0"}
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["gguf_modules"] == []
    assert len(result["text"]) > 0
    assert read_tokenizer(sentencepiece_gguf).decode([1, 2]) == "<s></s>"
