"""The byte scan that bounds a request body's JSON before it is decoded (json_limits.py):
depth, values per field and per body, arrays and objects, integers within 64 bits; strings
(escaped quotes, backslash runs) and chunk edges handled; floats never taken for integers."""

from __future__ import annotations

import json
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.entrypoints.openai import json_limits
from jaxserve.entrypoints.openai.json_limits import CHUNK_BYTES, check_json_limits


def refusal(body: bytes | str) -> str | None:
    """check_json_limits' message for `body`, None if it passes."""
    try:
        check_json_limits(body.encode() if isinstance(body, str) else body)
    except ValueError as e:
        return str(e)
    return None


def straddling(doc: str, at: int) -> bytes:
    """doc after leading spaces, so its byte `at` is the first of the second chunk."""
    return b" " * (CHUNK_BYTES - at) + doc.encode()


# ---------------------------------------------------------------------- integers
IN_RANGE = ["18446744073709551615", "-9223372036854775808", "9999999999999999999",
            "10000000000000000000", "-1111111111111111111", "0", "-0"]  # fmt: skip
OUT_OF_RANGE = ["18446744073709551616", "-9223372036854775809", "99999999999999999999",
                "-10000000000000000000", "123456789012345678901234567890"]  # fmt: skip
NOT_INTEGERS = ["1" * 25 + ".5", "0." + "0" * 30 + "1", "1e400", "1E+" + "0" * 25 + "1",
                "-1e-" + "0" * 25 + "1", "12345678901234567890123e5", "1" * 30 + "E2",
                '"' + "9" * 30 + '"']  # fmt: skip


@pytest.mark.parametrize("token", IN_RANGE + NOT_INTEGERS)
def test_integers_within_64_bits_and_other_numbers_pass(token):
    doc = '{"x": [1, ' + token + "]}"
    assert refusal(doc) is None
    for at in range(doc.index(token) - 1, len(doc)):  # the chunk edge anywhere in the token
        assert refusal(straddling(doc, at)) is None, at


@pytest.mark.parametrize("token", OUT_OF_RANGE)
def test_integers_outside_64_bits_are_refused_naming_the_field(token):
    doc = '{"model": "m", "kv_transfer_params": {"a": [' + token + "]}}"
    bound = "greater_than_equal" if token.startswith("-") else "less_than_equal"
    expected = (
        f"kv_transfer_params: the integer {token} is outside the 64-bit range "
        f"[-2**63, 2**64 - 1] ({bound})"
    )
    assert refusal(doc) == expected
    for at in range(doc.index(token) - 1, len(doc)):
        assert refusal(straddling(doc, at)) == expected, at


def test_a_huge_integer_is_refused_by_its_digit_count():
    assert refusal('{"seed": 1' + "0" * 400 + "}") == (
        "seed: the integer of 401 digits is outside the 64-bit range [-2**63, 2**64 - 1] "
        "(less_than_equal)"
    )


# ---------------------------------------------------------------------- depth and strings
def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_depth_is_counted_outside_strings_only():
    assert refusal('{"a": ' + nested(63) + "}") is None  # 64 levels with the body
    assert refusal('{"a": ' + nested(64) + "}") == (
        "a: the JSON is nested more than 64 levels deep"
    )
    assert refusal('{"b": 1, "we\\"ird": ' + nested(10_000) + "}").startswith(
        'we"ird: the JSON is nested'
    )
    assert refusal(json.dumps({"a": '\\"' + "[" * 100, "b": "{" * 100})) is None


@pytest.mark.parametrize(
    "string, passes",
    [('\\"' + "[" * 70, True), ('\\\\"' + ", " + nested(70) + ', "', False),
     ("\\\\\\" + '"' + "{" * 70, True), ("\\\\\\\\" + '", ' + nested(70) + ', "', False)],
    ids=["escaped quote", "escaped backslash", "three backslashes", "four backslashes"],
)  # fmt: skip
def test_backslash_runs_decide_which_quotes_end_a_string_at_any_chunk_edge(string, passes):
    doc = '{"a": ["' + string + '"]}'
    for at in range(doc.index("\\") - 1, doc.index("\\") + 6):
        message = refusal(straddling(doc, at))
        assert (message is None) == passes, (at, message)
        assert passes or message == "a: the JSON is nested more than 64 levels deep"


def test_a_body_that_is_not_an_object_is_left_to_the_decoder():
    assert refusal("[" * 10_000) is None
    assert refusal("") is None


# ---------------------------------------------------------------------- how many values
def test_each_field_holds_at_most_its_limit_of_values():
    assert refusal(json.dumps({"stop": ["x"] * 4096})) is None
    assert refusal(json.dumps({"stop": ["x"] * 4097})) == (
        "stop: more than 4096 values (the limit for this field)"
    )
    assert refusal(json.dumps({"metadata": {str(i): i for i in range(4097)}})) == (
        "metadata: more than 4096 values (the limit for this field)"
    )
    assert refusal(json.dumps({"prompt": [7] * (2**21 + 1)})) == (
        "prompt: more than 2097152 values (the limit for this field)"
    )


def test_the_body_holds_at_most_its_limits_of_values_and_containers():
    both = {"prompt": [0] * 2**20, "input": [0] * (2**20 + 1)}
    assert refusal(json.dumps(both)) == "input: the body holds more than 2097152 values"
    assert refusal(json.dumps({"messages": [{}] * 65_535})) is None  # and the list: 65536
    assert refusal(json.dumps({"messages": [{}] * 65_536})) == (
        "messages: the body holds more than 65536 arrays and objects"
    )
    assert refusal(json.dumps({f"f{i}": 0 for i in range(257)})) == (
        "the JSON body has more than 256 top-level fields"
    )


@pytest.mark.parametrize(
    "doc",
    [" " * 2**20 + json.dumps({"messages": [{}] * 100_000}),
     json.dumps({"prompt": list(range(1_000_000)), "x": 2**64}),
     json.dumps({"prompt": "x" * 3 * 2**20, "a": [[[[[[[[0]]]]]]]] * 2}),
     json.dumps({"tools": ["\\" * 999_999 + '"' + "[" * 70]})],
    ids=["after a MiB of spaces", "a wide integer after 7 MB", "within the limits",
         "backslashes across feeds"],
)  # fmt: skip
def test_a_body_fed_as_it_is_read_gets_the_verdict_of_the_whole(doc):
    body, expected = doc.encode(), refusal(doc)
    limits, so_far = json_limits.BodyLimits(), bytearray()
    try:
        for at in range(0, len(body), 300_000):  # fed after each 300 kB read
            so_far += body[at : at + 300_000]
            limits.feed(so_far)
        limits.finish(bytes(so_far))
    except ValueError as e:
        assert str(e) == expected
    else:
        assert expected is None


# ---------------------------------------------------------------------- against a reference
def values(v) -> int:
    """The scan's count of v's values: n for n elements or members (an empty one: 1), plus
    what each holds."""
    children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
    return 0 if children is None else max(len(children), 1) + sum(map(values, children))


def depth(v) -> int:
    children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
    return 0 if children is None else 1 + max(map(depth, children), default=0)


def wide(v) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return not -(2**63) <= v <= 2**64 - 1
    children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else []
    return any(map(wide, children))


TEXT = st.text(st.sampled_from('ab"\\[]{},:-.e0123456789 é\n'), max_size=12)
SCALARS = (
    st.none() | st.booleans() | TEXT | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(-(2**66), 2**66)
    | st.sampled_from([2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**19, -(10**19)])
)  # fmt: skip
JSON = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=25,
)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=JSON, wrap=st.integers(0, 70), edge=st.integers(0, 400), ascii=st.booleans(),
       scan=st.booleans())  # fmt: skip
def test_the_scan_agrees_with_the_decoded_values(value, wrap, edge, ascii, scan):
    """Whatever the value (strings of quotes, backslashes and brackets, integers at the 64-bit
    edges) and wherever a chunk edge falls in it, the scan refuses exactly what a walk of the
    decoded value would, and counts the values it holds. scan: the byte scan even where the
    byte counts alone show the body within the limits (a typical request's quick path)."""
    for _ in range(wrap):
        value = [value]
    doc = json.dumps({"model": "m", "x": value}, ensure_ascii=ascii)
    body = straddling(doc, min(edge, len(doc.encode())))
    count = values(value)
    quick = json_limits._within_limits_by_counts
    with mock.patch.object(
        json_limits, "_within_limits_by_counts", (lambda body: False) if scan else quick
    ):
        with mock.patch.object(json_limits, "DEFAULT_FIELD_VALUES", count):
            message = refusal(body)
        if 1 + depth(value) > 64:  # (an integer before the depth's chunk may be found first)
            deep = "x: the JSON is nested more than 64 levels deep"
            assert message == deep or (wide(value) and "is outside the 64-bit range" in message)
        elif wide(value):
            assert message is not None and "is outside the 64-bit range" in message
        else:
            assert message is None
            if count:
                with mock.patch.object(json_limits, "DEFAULT_FIELD_VALUES", count - 1):
                    expected = f"x: more than {count - 1} values (the limit for this field)"
                    assert refusal(body) == expected
