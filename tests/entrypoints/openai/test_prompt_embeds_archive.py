"""prompt_embeds' archives (prompt_embeds.py) from a hostile client: torch.save'd tensors of
every dtype and layout decode to torch's values; compressed entries (a 15 KB bzip2 entry can
inflate to 1 GiB), entries whose sizes lie, zero or overlapping strides, shapes past
[max_model_len, hidden size], pickles that declare huge allocations and code are each a
ValueError naming what is wrong, before anything that size is allocated; over HTTP a 400, and
without --enable-prompt-embeds a 400 before the payload is even base64-decoded."""

from __future__ import annotations

import base64
import collections
import io
import pickle
import struct
import zipfile

import numpy as np
import pytest
import torch

from jaxserve.entrypoints.openai.prompt_embeds import decode_prompt_embeds
from jaxserve.transformers_utils.tokenizer import read_tokenizer
from tests.entrypoints.openai.test_http_hardening import message, post, serve

HIDDEN, MAX_LEN = 8, 16  # the stand-in model's hidden size; its max_model_len
LIMITS = {"hidden_size": HIDDEN, "max_positions": MAX_LEN}


def saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def decode(data: bytes) -> np.ndarray:
    return decode_prompt_embeds(b64(data), **LIMITS)


class _StorageMark:
    def __init__(self, numel: int, kind, key: str):
        self.numel, self.kind, self.key = numel, kind, key


class _Declared:
    """Pickles as torch pickles a tensor, declaring any size, stride, offset and storage."""

    def __init__(self, size, stride, offset=0, numel=None, kind=torch.FloatStorage, key="0"):
        numel = int(np.prod(size)) if numel is None else numel
        self.args = (_StorageMark(numel, kind, key), offset, size, stride, False)

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, (*self.args, collections.OrderedDict())


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _StorageMark):
            return ("storage", obj.kind, obj.key, "cpu", obj.numel)
        return None


def archive(obj, storages: dict[str, bytes], compress: int = zipfile.ZIP_STORED) -> bytes:
    """An archive laid out as torch.save writes one: archive/data.pkl, archive/data/<key>..."""
    pkl = io.BytesIO()
    _TorchPickler(pkl, protocol=2).dump(obj)
    return entries({"data.pkl": pkl.getvalue(), **{f"data/{k}": v for k, v in storages.items()}},
                   compress)  # fmt: skip


def entries(
    files: dict[str, bytes], compress: int = zipfile.ZIP_STORED, flag_bits: int = 0, **declared
) -> bytes:
    """A zip of archive/<name> entries, each with these general-purpose flags; `declared`
    (name -> size) overrides the sizes the directory states for an entry (its bytes
    unchanged)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, data in {**files, "byteorder": b"little", "version": b"3\n"}.items():
            z.writestr(f"archive/{name}", data, compress_type=compress)
            z.getinfo(f"archive/{name}").flag_bits |= flag_bits
        for name, size in declared.items():
            info = z.getinfo(f"archive/{name}")
            info.file_size = info.compress_size = size
    return buffer.getvalue()


# ---------------------------------------------------------------------- what torch.save writes
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_torch_saved_tensors_decode_to_torchs_values(dtype):
    t = torch.randn(5, HIDDEN).to(dtype)
    want = t.float().numpy()
    np.testing.assert_array_equal(decode(saved(t)), want)
    np.testing.assert_array_equal(decode(saved(t.T.contiguous().T)), want)  # column-major
    wider = torch.randn(HIDDEN, HIDDEN + 4).to(dtype)  # a view inside a larger storage
    view = wider[2:7, 3 : 3 + HIDDEN]
    np.testing.assert_array_equal(decode(saved(view)), view.float().numpy())
    np.testing.assert_array_equal(decode(saved(torch.ones(1, HIDDEN))), np.ones((1, HIDDEN)))


def test_a_pickle_that_would_run_code_is_refused():
    class Evil:
        def __reduce__(self):
            return (eval, ("1 + 1",))

    buffer = io.BytesIO()
    torch.save({"x": Evil()}, buffer, pickle_module=pickle)
    with pytest.raises(ValueError, match=r"eval is not a tensor's part"):
        decode(buffer.getvalue())
    with pytest.raises(ValueError, match="must hold one tensor, got dict"):
        decode(saved({"x": torch.ones(2, HIDDEN)}))
    with pytest.raises(ValueError, match="base64 of a torch.save'd tensor"):
        decode_prompt_embeds("bm90IGEgemlw", **LIMITS)  # "not a zip"


# ---------------------------------------------------------------------- the archive
@pytest.mark.parametrize(
    "method, name", [(zipfile.ZIP_BZIP2, "bzip2"), (zipfile.ZIP_DEFLATED, "deflate")]
)
def test_a_compressed_entry_is_refused_by_name_without_inflating(method, name):
    data = archive(_Declared((1, HIDDEN), (HIDDEN, 1)), {"0": bytes(1 << 20)}, compress=method)
    with pytest.raises(ValueError, match=rf"'archive/data.pkl' is {name}-compressed"):
        decode(data)


def test_entries_whose_sizes_lie_are_refused_before_they_are_read():
    tensor = _Declared((2, HIDDEN), (HIDDEN, 1))
    pkl = io.BytesIO()
    _TorchPickler(pkl, protocol=2).dump(tensor)
    need = 2 * HIDDEN * 4
    # the directory declares what the tensor needs, the entry holds 4x that: only `need`
    # bytes are read, and their checksum is not the entry's
    bigger = entries({"data.pkl": pkl.getvalue(), "data/0": bytes(4 * need)}, **{"data/0": need})
    with pytest.raises(ValueError, match="CRC"):
        decode(bigger)
    huge = entries({"data.pkl": pkl.getvalue(), "data/0": bytes(need)}, **{"data/0": 1 << 40})
    with pytest.raises(ValueError, match=rf"'archive/data/0' declares {1 << 40} bytes"):
        decode(huge)
    short = entries({"data.pkl": pkl.getvalue(), "data/0": bytes(need - 4)})
    with pytest.raises(ValueError, match=rf"declares {need - 4} bytes .*, {need} expected"):
        decode(short)
    big_pickle = entries({"data.pkl": pkl.getvalue() + bytes(1 << 15), "data/0": bytes(need)})
    with pytest.raises(ValueError, match=f"data.pkl of {len(pkl.getvalue()) + (1 << 15)} bytes"):
        decode(big_pickle)
    for flag, what in [(0x1, "is encrypted"), (0x20, "patched data"), (0x40, "strong encrypt")]:
        with pytest.raises(ValueError, match=what):
            decode(entries({"data.pkl": pkl.getvalue(), "data/0": bytes(need)}, flag_bits=flag))
    many = entries({"data.pkl": pkl.getvalue(), **{f"x{i}": b"" for i in range(100)}})
    with pytest.raises(ValueError, match="more than 64 entries"):
        decode(many)
    with pytest.raises(ValueError, match="no data.pkl"):
        decode(entries({"data/0": bytes(need)}))
    with pytest.raises(ValueError, match="'archive/data/1'"):
        decode(archive(_Declared((2, HIDDEN), (HIDDEN, 1), key="1"), {"0": bytes(need)}))


def test_base64_longer_than_the_largest_tensor_is_refused_before_it_is_decoded():
    with pytest.raises(ValueError, match=r"prompt_embeds of 1000000 base64 characters: a \[2, 8\]"):
        decode_prompt_embeds("!" * 1_000_000, hidden_size=HIDDEN, max_positions=2)


# ---------------------------------------------------------------------- the declared tensor
@pytest.mark.parametrize(
    "tensor, error",
    [
        # torch.save's own: an expanded tensor (stride 0), an overlapping strided view
        (torch.zeros(1).expand(200_000, 576), r"got shape \(200000, 576\)"),
        (torch.zeros(1, HIDDEN).expand(MAX_LEN, HIDDEN), r"strides \[0, 1\] .* repeat or overlap"),
        (torch.zeros(1).expand(4, HIDDEN), r"strides \[0, 0\] .* repeat or overlap"),
        (torch.zeros(64).as_strided((4, HIDDEN), (2, 1)), r"strides \[2, 1\] .*repeat or overlap"),
        (torch.zeros(MAX_LEN + 1, HIDDEN), r"1 to 16 positions \(max_model_len\), got shape \(17"),
        (torch.zeros(3, HIDDEN + 1), r"must be \[positions, 8\] .* got shape \(3, 9\)"),
        (torch.zeros(HIDDEN), r"got shape \(8,\)"),
        (torch.zeros(1, 2, HIDDEN), r"got shape \(1, 2, 8\)"),
        (torch.zeros(0, HIDDEN), r"got shape \(0, 8\)"),
        (torch.zeros(MAX_LEN + 1, HIDDEN)[:2], r"storage of 136 elements \(at most .* = 128\)"),
        (torch.zeros(2, HIDDEN, dtype=torch.int64), r"torch.LongStorage is not a tensor's part"),
    ],
)  # fmt: skip
def test_torch_saved_tensors_the_server_cannot_use_are_refused(tensor, error):
    with pytest.raises(ValueError, match=error):
        decode(saved(tensor))


@pytest.mark.parametrize(
    "declared, error",
    [
        # (10^7, 10^6) float32 is 40 TB: refused from the pickle, nothing allocated
        (_Declared((10**7, 10**6), (10**6, 1)), r"got shape \(10000000, 1000000\)"),
        (_Declared((2, HIDDEN), (HIDDEN, -1)), r"strides \(8, -1\) and offset 0"),
        (_Declared((2, HIDDEN), (HIDDEN, 1), offset=-1), "offset -1 are not a tensor's"),
        (_Declared((2, HIDDEN), (1, 1)), r"strides \[1, 1\] .* repeat or overlap"),
        (_Declared((2, HIDDEN), (HIDDEN, 1), numel=10**12), r"a storage of 1000000000000 el"),
        (_Declared((2, HIDDEN), (HIDDEN, 1), offset=2), r"at offset 2 run past a storage of 16"),
        (_Declared((2, HIDDEN), (HIDDEN, 1), numel=-1), "a storage of -1 elements"),
        (_Declared((2.0, HIDDEN), (HIDDEN, 1)), r"got shape \(2.0, 8\)"),
        (_Declared((2, HIDDEN), ("8", 1)), r"strides \('8', 1\)"),
    ],
)  # fmt: skip
def test_declared_tensors_are_checked_before_their_storage_is_read(declared, error):
    # the archive holds no storage entry: a refusal here comes before one is looked for
    with pytest.raises(ValueError, match=error):
        decode(archive(declared, {}))


@pytest.mark.parametrize(
    "pkl, error",
    [
        # a 9-byte pickle whose memo index would make pickle allocate 400 MB
        (b"\x80\x02Nr" + struct.pack("<I", 50_000_000) + b".", "memo index 50000000"),
        # bytes declared 1 TiB long, which pickle allocates before reading them
        (b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"x.", r"expected 1099511627776 bytes"),
        (b"\x80\x02K\x01.", "must hold one tensor, got int"),
        (b"\x80\x02cos\nsystem\n.", "os.system is not a tensor's part"),
    ],
)
def test_pickles_that_declare_huge_allocations_are_refused(pkl, error):
    with pytest.raises(ValueError, match=error):
        decode(entries({"data.pkl": pkl}))


# ---------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def tokenizer():
    return read_tokenizer(None)


def completion(prompt_embeds) -> dict:
    return post("/v1/completions", {"model": "m", "prompt_embeds": prompt_embeds, "max_tokens": 1})


def test_without_the_flag_prompt_embeds_are_refused_before_they_are_decoded(tokenizer):
    # not base64 at all: only a refusal that decodes nothing answers with the flag's name
    (refused,) = serve(tokenizer, [completion("%%% not base64, not a zip %%%")])
    assert refused.status_code == 400
    assert "--enable-prompt-embeds" in message(refused)
