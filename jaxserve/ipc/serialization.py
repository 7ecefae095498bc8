"""msgpack (msgspec) with numpy arrays: small ones inline, large ones as their own frames.

A message encodes to frames `[main, *arrays]`. An array under `inline_threshold` bytes rides
inside the main frame as an msgpack extension (dtype, shape, bytes); a larger one is sent as a
separate frame straight from its buffer (no copy on the way out; `np.frombuffer` over the
received frame on the way in) and the main frame holds only (dtype, shape, frame index).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes  # noqa: F401 (registers bfloat16 / float8 names with numpy: np.dtype(name))
import msgspec
import numpy as np

INLINE_THRESHOLD = 256  # bytes
_EXT_INLINE, _EXT_FRAME = 1, 2


class MsgpackEncoder:
    """Reuses one bytearray for the main frame: send it with copy=True (or finish sending it)
    before the next encode."""

    def __init__(self, inline_threshold: int = INLINE_THRESHOLD):
        self.inline_threshold = inline_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._buffer = bytearray()
        self._frames: list[Any] = []

    def encode(self, obj: Any) -> list[Any]:
        """obj -> [main frame, *array frames] (buffer-protocol objects, for send_multipart)."""
        self._frames = [self._buffer]
        self._encoder.encode_into(obj, self._buffer)
        frames, self._frames = self._frames, []
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if not isinstance(obj, np.ndarray):
            raise NotImplementedError(f"cannot serialize {type(obj).__name__}")
        if obj.dtype.hasobject:
            raise TypeError(f"cannot serialize a numpy array of dtype {obj.dtype}")
        arr = np.ascontiguousarray(obj)
        # ml_dtypes' bfloat16 / float8 are "V" (void) in dtype.str: sent by name
        dtype = arr.dtype.name if arr.dtype.kind == "V" else arr.dtype.str
        if arr.nbytes < self.inline_threshold:
            header = msgspec.msgpack.encode((dtype, arr.shape, arr.tobytes()))
            return msgspec.msgpack.Ext(_EXT_INLINE, header)
        self._frames.append(arr.view(np.uint8).data if arr.dtype.kind == "V" else arr.data)
        header = (dtype, arr.shape, len(self._frames) - 1)
        return msgspec.msgpack.Ext(_EXT_FRAME, msgspec.msgpack.encode(header))


class MsgpackDecoder:
    """Decodes frames from `MsgpackEncoder.encode` into `type` (Any: plain msgpack values)."""

    def __init__(self, type: Any = Any):  # noqa: A002 (msgspec's name)
        self._decoder = msgspec.msgpack.Decoder(type, ext_hook=self._ext_hook, dec_hook=_dec_hook)
        self._frames: list[Any] = []

    def decode(self, frames: list[Any] | bytes) -> Any:
        """frames: bytes or a list of bytes / zmq.Frame (received with copy=False)."""
        if isinstance(frames, (bytes, bytearray, memoryview)):
            frames = [frames]
        self._frames = frames
        try:
            return self._decoder.decode(_buffer(frames[0]))
        finally:
            self._frames = []

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_INLINE:
            dtype, shape, raw = msgspec.msgpack.decode(data)
            return np.frombuffer(raw, np.dtype(dtype)).reshape(shape)
        if code == _EXT_FRAME:
            dtype, shape, index = msgspec.msgpack.decode(data)
            return np.frombuffer(_buffer(self._frames[index]), np.dtype(dtype)).reshape(shape)
        raise ValueError(f"unknown msgpack extension code {code}")


def _dec_hook(type: Any, obj: Any) -> Any:  # noqa: A002
    if type is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise NotImplementedError(f"cannot decode {type}")


def _buffer(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame
