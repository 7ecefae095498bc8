"""A request body's JSON structure checked on its bytes, before any Python object is built.

Decoding builds one Python object per JSON value (an 11 MB body of `{}` is 3.8M dicts), and a
check that walks the decoded values runs in Python, holding the GIL every other request
needs. So `check_json_limits` scans the bytes themselves with numpy, CHUNK_BYTES at a time (a
few MB of temporaries; numpy's loops release the GIL), and refuses, at the first chunk that
passes a limit, before anything is decoded (`BodyLimits`: as the body is read, so the rest
of a refused body is not):

- nesting deeper than MAX_JSON_DEPTH (the body itself is level 1);
- more than MAX_FIELDS top-level fields, MAX_CONTAINERS arrays and objects or MAX_VALUES
  values in the whole body, or more values in one top-level field than `field_limit` allows
  it: DEFAULT_FIELD_VALUES for free-form fields such as chat_template_kwargs,
  kv_transfer_params or response_format; more for the fields that are legitimately large
  (FIELD_VALUES: prompts and token ids, conversations, tools, documents);
- an integer outside the engine core's msgpack wire, [-2**63, 2**64 - 1] (a float of many
  digits, 1e400 or a string of digits is not an integer).

A field's values are its array elements and object members at any depth, an empty array or
object counting one more (the commas and opening brackets outside strings), so a list of 1M
token ids is 1M values and a list of n empty objects 2n. Strings are found as simdjson finds
them: a quote is a string's edge unless an odd run of backslashes precedes it. A body with a
syntax error may pass the scan; the decoder refuses it next.
"""

from __future__ import annotations

import re

import msgspec
import numpy as np

MAX_JSON_DEPTH = 64  # levels of arrays and objects, the body itself being level 1
MAX_FIELDS = 256  # top-level fields (a request has a few dozen at most)
MAX_CONTAINERS = 1 << 16  # arrays and objects in one body: each becomes a dict or a list
MAX_VALUES = 1 << 21  # values in one body: a prompt of 1M token ids fits twice
DEFAULT_FIELD_VALUES = 4096  # a top-level field FIELD_VALUES does not name
# prompts and token ids: a whole long context
_TOKEN_FIELDS = ("prompt", "input", "tokens", "allowed_token_ids", "stop_token_ids", "logit_bias")
# conversations, tool definitions, the texts a pooling request scores, JSON schemas
_LIST_FIELDS = ("messages", "tools", "system", "documents", "text_1", "text_2")
_SCHEMA_FIELDS = ("response_format", "structured_outputs", "guided_json", "text", "output_config")
FIELD_VALUES = {
    **dict.fromkeys(_TOKEN_FIELDS, MAX_VALUES),
    **dict.fromkeys(_LIST_FIELDS + _SCHEMA_FIELDS, 1 << 18),
}
_SPACE = re.compile(rb"[ \t\r\n]*")
_LONG_DIGITS = re.compile(rb"[0-9]{19}")
CHUNK_BYTES = 1 << 18  # bytes scanned at a time: temporaries of a few MB, an early refusal
_INT_MAX_20 = b"18446744073709551615"  # 2**64 - 1: the only 20-digit integers allowed
_INT_MIN_19 = b"9223372036854775808"  # -2**63: the largest negative magnitude


def field_limit(name: str) -> int:
    """The most values the top-level field `name` may hold."""
    return FIELD_VALUES.get(name, DEFAULT_FIELD_VALUES)


def check_json_limits(body: bytes) -> None:
    """ValueError, naming the top-level field, if `body` (a JSON object's bytes) passes one
    of the limits above. A body that is not an object is left to the decoder (a typed decode
    refuses it at its first byte, before building anything)."""
    first = _SPACE.match(body).end()
    if body[first : first + 1] == b"{" and not _within_limits_by_counts(body):
        _Scan().run(body, final=True)


class BodyLimits:
    """check_json_limits for a body read in pieces: `feed(body so far)` scans the whole
    chunks not scanned yet, so a body past a limit is refused within a chunk of where it
    passes it, before the rest is read; `finish(body)` scans the rest (or, if nothing was
    fed, is check_json_limits). The body passed may be a bytearray that grows in between."""

    def __init__(self):
        self._scan: _Scan | None | bool = None  # None: undecided; False: not an object

    def feed(self, body: bytes | bytearray) -> None:
        if self._scan is None:
            first = _SPACE.match(body).end()
            if first < len(body):  # (only spaces so far: undecided)
                self._scan = _Scan() if body[first : first + 1] == b"{" else False
        if self._scan:
            self._scan.run(body, final=False)

    def finish(self, body: bytes | bytearray) -> None:
        if self._scan is None:
            check_json_limits(body)
        elif self._scan:
            self._scan.run(body, final=True)


def _within_limits_by_counts(body: bytes) -> bool:
    """Whether byte counts alone (brackets and commas inside strings included, so counted
    high) show `body` within every limit, as a typical request is: no more opening brackets
    than MAX_JSON_DEPTH (so no deeper), fewer commas than MAX_FIELDS (so fewer fields), not
    more of both than DEFAULT_FIELD_VALUES (so fewer values), no run of 19 digits (so every
    integer within 64 bits). Microseconds, where the scan of a small body takes a few
    hundred."""
    if len(body) > CHUNK_BYTES:
        return False  # a large body: the scan, which stops at its first chunk past a limit
    opens = body.count(b"{") + body.count(b"[")
    if opens > MAX_JSON_DEPTH:
        return False
    commas = body.count(b",")
    return (
        commas < MAX_FIELDS
        and opens + commas <= DEFAULT_FIELD_VALUES
        and _LONG_DIGITS.search(body) is None
    )


def _bytes(chars: str) -> np.ndarray:
    return np.frombuffer(chars.encode(), np.uint8)


_FRACTION_OR_EXPONENT, _EXPONENT, _SIGN = _bytes(".eE"), _bytes("eE"), _bytes("+-")
_STEP = np.zeros(256, np.int8)  # a byte's change to the depth
_STEP[_bytes("{[")], _STEP[_bytes("}]")] = 1, -1
_WORD_SHIFTS = [np.uint64(s) for s in (1, 2, 4, 8, 16, 32)]


class _Scan:
    """One pass over the body, chunk by chunk, carrying what a chunk's end cuts: the string
    parity, a backslash run, the depth, a digit run and the top-level field's index. Work
    past a few full-chunk comparisons is done on the positions of brackets, commas and
    colons only, so it grows with the structure, not the bytes."""

    def __init__(self):
        self.body: bytes | bytearray = b""
        self.data = np.zeros(0, np.uint8)
        self.scanned = 0  # bytes
        self.in_string = 0  # 1: the last chunk ended inside a string
        self.backslashes = 0  # the length of the backslash run that ended the last chunk
        self.digits = 0  # the length of the digit run (outside strings) ending the last chunk
        self.depth = 0
        self.fields = 0  # top-level commas so far: the current field's index
        self.edges: list[int] = []  # where each top-level field begins: "{", then its comma
        self.colons: list[int] = []  # each top-level field's colon
        self.values = np.zeros(MAX_FIELDS, np.int64)  # per top-level field
        self.containers = 0
        self.total = 0

    def run(self, body: bytes | bytearray, final: bool) -> None:
        """Scan `body` (what was scanned before, and more) from where the last run stopped:
        to its end if final, else to its last whole chunk. Keeps no view of it after."""
        self.body, self.data = body, np.frombuffer(body, np.uint8)
        end = len(body) if final else len(body) - len(body) % CHUNK_BYTES
        try:
            for at in range(self.scanned, end, CHUNK_BYTES):
                self._chunk(self.data[at : at + CHUNK_BYTES], at)
            self.scanned = end
        finally:
            self.body, self.data = b"", np.zeros(0, np.uint8)  # (a bytearray may then grow)

    def _chunk(self, b: np.ndarray, at: int) -> None:
        quotes = b == ord('"')
        escaped = self._escapes(b == ord("\\"))
        if self.in_string and not quotes.any():
            return  # the middle of a long string
        quotes[escaped] = False
        outside = self._outside_strings(quotes)
        marks = (b == ord("{")) | (b == ord("[")) | (b == ord("}")) | (b == ord("]"))
        marks |= (b == ord(",")) | (b == ord(":"))
        where = np.flatnonzero(marks & outside)  # brackets, commas and colons, in order
        kind = b[where]
        step = _STEP[kind]
        depth = np.cumsum(step, dtype=np.int32)  # after each of them
        depth += self.depth
        self.depth = int(depth[-1]) if len(depth) else self.depth
        is_open, comma = step == 1, kind == ord(",")
        top = depth == 1
        separators = where[comma & top]
        if not self.edges and is_open.any():
            self.edges.append(at + int(where[np.argmax(is_open)]))
        self.edges += (separators + at).tolist()
        self.colons += (where[(kind == ord(":")) & top] + at).tolist()
        if len(depth) and depth.max() > MAX_JSON_DEPTH:
            deep = at + int(where[np.argmax(depth > MAX_JSON_DEPTH)])
            raise self._error(deep, f"the JSON is nested more than {MAX_JSON_DEPTH} levels deep")
        if self.fields + len(separators) >= MAX_FIELDS:
            raise ValueError(f"the JSON body has more than {MAX_FIELDS} top-level fields")
        inner = depth >= 2
        counted = where[(is_open | comma) & inner]  # in order
        self._count(separators, counted, where[is_open & inner], at)
        self.fields += len(separators)
        self._check_integers((b >= ord("0")) & (b <= ord("9")) & outside, at)

    def _escapes(self, backslash: np.ndarray) -> np.ndarray:
        """The positions of the bytes escaped by a backslash (after an odd run of them)."""
        if not (self.backslashes or backslash.any()):
            return np.zeros(0, np.intp)
        length, ends = _runs(backslash, self.backslashes)
        self.backslashes = int(length[-1]) if len(ends) and ends[-1] == len(backslash) else 0
        escaped = ends[length % 2 == 1]
        return escaped[escaped < len(backslash)]

    def _outside_strings(self, quotes: np.ndarray) -> np.ndarray:
        """True where a byte is outside every string (a closing quote counts as outside):
        the prefix parity of the quotes, 64 bytes to a word as simdjson computes it."""
        n = len(quotes)
        bits = np.zeros(-(-n // 64) * 8, np.uint8)
        bits[: -(-n // 8)] = np.packbits(quotes, bitorder="little")
        words = bits.view(np.uint64)
        for shift in _WORD_SHIFTS:  # within a word: bit i = the xor of bits 0..i
            words ^= words << shift
        before = np.bitwise_xor.accumulate(words >> np.uint64(63)) ^ np.uint64(self.in_string)
        words ^= -np.concatenate(([np.uint64(self.in_string)], before[:-1]))
        inside = np.unpackbits(bits, count=n, bitorder="little").view(bool)
        self.in_string = int(inside[-1])
        return ~inside

    def _count(self, separators, counted: np.ndarray, containers: np.ndarray, at: int) -> None:
        """Add a chunk's values (`counted`: their positions, in order; each in the top-level
        field the chunk's top-level commas, `separators`, put it in) and containers (their
        positions, in order) to the totals; ValueError past a limit."""
        if len(separators):
            fields = self.fields + np.searchsorted(separators, counted)
            self.values += np.bincount(fields, minlength=MAX_FIELDS)
        else:  # all in the current field
            self.values[self.fields] += len(counted)
        for field in np.flatnonzero(self.values > DEFAULT_FIELD_VALUES):
            name = self._name(int(field))
            if self.values[field] > field_limit(name):
                raise ValueError(
                    f"{name}: more than {field_limit(name)} values (the limit for this field)"
                )
        before, self.total = self.total, self.total + len(counted)
        if self.total > MAX_VALUES:
            position = at + int(counted[MAX_VALUES - before])
            raise self._error(position, f"the body holds more than {MAX_VALUES} values")
        before, self.containers = self.containers, self.containers + len(containers)
        if self.containers > MAX_CONTAINERS:
            position = at + int(containers[MAX_CONTAINERS - before])
            raise self._error(
                position, f"the body holds more than {MAX_CONTAINERS} arrays and objects"
            )

    def _check_integers(self, digit: np.ndarray, at: int) -> None:
        """ValueError for an integer token outside [-2**63, 2**64 - 1]: only runs of 19 or
        more digits can be, and of those only the ones neither after a "." or an exponent's
        "e" nor before a "." or "e" (those are floats)."""
        carried = self.digits
        lead = len(digit) if digit.all() else int(np.argmin(digit))
        trail = len(digit) if lead == len(digit) else int(np.argmin(digit[::-1]))
        self.digits = carried + lead if lead == len(digit) else trail
        if not (_has_run(digit, 19) or (carried and carried + lead >= 19)):
            return
        length, ends = _runs(digit, carried)
        closed = ends < len(digit)  # a run reaching the chunk's end is checked with the next
        long = closed & (length >= 19)
        n, end = length[long], ends[long] + at
        start, data = end - n, self.data
        left, right = data[start - 1], data[end]
        integer = ~(
            np.isin(right, _FRACTION_OR_EXPONENT)
            | np.isin(left, _FRACTION_OR_EXPONENT)
            | (np.isin(left, _SIGN) & np.isin(data[np.maximum(start - 2, 0)], _EXPONENT))
        )
        negative = left == ord("-")
        bad = integer & ((n > 20) | ((n == 20) & negative))
        for size, sign, bound in ((20, False, _INT_MAX_20), (19, True, _INT_MIN_19)):
            pick = np.flatnonzero(integer & (n == size) & (negative == sign))
            if len(pick):
                digits = data[start[pick, None] + np.arange(size)].view(f"S{size}").ravel()
                bad[pick] |= digits > bound
        if bad.any():
            i = int(np.argmax(bad))
            token = self.body[int(start[i] - negative[i]) : int(end[i])].decode()
            shown = token if len(token) <= 40 else f"of {n[i]} digits"
            bound = "greater_than_equal" if negative[i] else "less_than_equal"  # vLLM's names
            raise self._error(
                int(start[i]),
                f"the integer {shown} is outside the 64-bit range [-2**63, 2**64 - 1] ({bound})",
            )

    def _name(self, field: int) -> str:
        """A top-level field's name, from its key's bytes (decoded only for a message)."""
        try:
            key = self.body[self.edges[field] + 1 : self.colons[field]]
            name = msgspec.json.decode(key, type=str)
        except (IndexError, msgspec.DecodeError):
            return f"top-level field #{field + 1}"
        return name if len(name) <= 100 else name[:100] + "..."

    def _error(self, position: int, what: str) -> ValueError:
        field = int(np.searchsorted(np.asarray(self.edges[1:], np.int64), position))
        return ValueError(f"{self._name(field)}: {what}")


def _has_run(mask: np.ndarray, n: int) -> bool:
    """Whether `mask` has n True in a row: the windows of 1, 2, 4, .. doubled by shifted
    ands, then two overlapping ones of the largest power of two below n."""
    width, window = 1, mask
    while 2 * width <= n and len(window) > width:
        window, width = window[:-width] & window[width:], 2 * width
    rest = n - width
    return bool(len(window) > rest and (window[: len(window) - rest] & window[rest:]).any())


def _runs(mask: np.ndarray, carried: int) -> tuple[np.ndarray, np.ndarray]:
    """The runs of True in a chunk's `mask`, the first continuing a run of `carried` that
    ended the chunk before: (their lengths, where each ends, exclusive). A run that reaches
    the chunk's end ends at len(mask); a carried run the chunk does not continue, at 0."""
    step = np.diff(mask.view(np.int8), prepend=np.int8(carried > 0), append=np.int8(0))
    starts = np.flatnonzero(step == 1)
    ends = np.flatnonzero(step == -1)
    if carried:
        starts = np.concatenate(([-carried], starts))
    return ends - starts, ends
