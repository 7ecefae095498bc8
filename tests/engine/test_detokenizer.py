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
