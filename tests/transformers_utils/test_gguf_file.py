"""transformers_utils/gguf_file.py reads what gguf-py's GGUFReader reads: every field's
contents (value and Python type) and every tensor's name, type, dims and data."""

import gguf
import numpy as np
import pytest

from jaxserve.transformers_utils.gguf_file import GGUFFile, gguf_reader
from jaxserve.transformers_utils.model_path import default_model_path


def assert_same_as_gguf_py(path):
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # gguf-py's header entries
    assert list(ours.fields) == keys
    for key in keys:
        mine, want = ours.get_field(key).contents(), theirs.get_field(key).contents()
        assert mine == want and type(mine) is type(want), key
        if isinstance(want, list) and want:
            assert {type(x) for x in mine} == {type(x) for x in want}, key
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, want in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (want.name, want.tensor_type)
        assert np.array_equal(mine.shape, want.shape), mine.name
        assert mine.data.dtype == want.data.dtype and mine.data.shape == want.data.shape
        assert np.array_equal(mine.data, want.data), mine.name


def test_every_value_type_and_tensor_type_reads_as_gguf_py_reads_it(tmp_path):
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -5)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**40)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁world")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "Ġthe", "<|im_end|>"])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("f32", w)
    writer.add_tensor("f16", w.astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
        writer.add_tensor(qtype.name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_py(path)


@pytest.mark.slow
def test_the_default_model_reads_as_gguf_py_reads_it():
    assert_same_as_gguf_py(default_model_path())


def test_a_truncated_file_is_a_value_error_naming_it(tmp_path):
    good = default_model_path()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[:100_000])  # inside the vocabulary
    with pytest.raises(ValueError, match=r"corrupt or unreadable GGUF file .*cut\.gguf"):
        gguf_reader(bad)
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ValueError, match="magic"):
        gguf_reader(tmp_path / "not.gguf")
