"""Incremental detokenization of what a sampled model can emit."""

import gguf

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.sampling_params import SamplingParams
from jaxserve.transformers_utils.gguf_tokenizer import read_gguf_tokenizer
from tests.helpers import _gguf_value
from tests.transformers_utils.test_gguf_tokenizer import sentencepiece_metadata


def test_invalid_utf8_from_byte_fallback_tokens_does_not_break_the_stream(tmp_path):
    """A stray UTF-8 continuation byte (<0x9B>) between ASCII byte tokens changes how the
    earlier bytes decode, which tokenizers' DecodeStream raises on; the stream recovers and
    decodes the tokens after it."""
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in sentencepiece_metadata().items():
        writer.add_key_value(f"tokenizer.{key}", *_gguf_value(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = read_gguf_tokenizer(path)
    prompt = tok("Paris is", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["capital"]))
    noise = tok.convert_tokens_to_ids(["<0x48>", "<0x9B>", "<0x2F>", "<0x2F>"])
    assert detok.update(noise) is None
    tail = tok(" the capital of", add_special_tokens=False).input_ids
    assert detok.update(tail) == "capital"
    # "H" was already out; the invalid run decodes as ByteFallback does (one U+FFFD a byte)
    assert detok.output_text == "H" + "\ufffd" * 4 + " the "


def test_spaces_between_special_tokens_false_joins_consecutive_added_tokens():
    """A decoder that puts spaces between tokens (WordPiece's): with both
    skip_special_tokens and spaces_between_special_tokens false, an added token right after
    another comes without its space (vLLM's fast detokenizer); other text is unchanged."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": ["[A]", "[B]"]})
    a, b = tok.convert_tokens_to_ids(["[A]", "[B]"])
    texts = []
    for spaces in (True, False):
        params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        detok = IncrementalDetokenizer(tok, [1], params)
        detok.update([2, a, b, a, 1])
        texts.append(detok.output_text)
    assert texts == [" world [A] [B] [A] hello", " world [A][B][A] hello"]
