"""The one safetensors header parser (spec/safetensors_bulk.parse_header) against hostile headers:
every count scaled up (header length, entry count, key length, shape rank, nesting, digits of an
offset), each refused with a ``HeaderError`` naming the file, the entry, the field, what was
expected and what was found, in a message of bounded length; in both the compact form the
writers produce and any other JSON form."""

from __future__ import annotations

import json
from typing import Any

import pytest

from unickpt.ckpt.safetensors_io import header_from_bytes, parse_header
from unickpt.errors import HeaderError
from unickpt.spec.safetensors_bulk import HeaderEntries

PATH = "/ckpt/model-00003-of-00008.safetensors"


def _entry(dtype: Any = "U8", shape: Any = (1,), offsets: Any = (0, 1)) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _many(n: int) -> dict[str, Any]:
    """``n`` one-byte U8 entries back to back (keys of a sliced save's form)."""
    return {f"layers.{i}.w@0": _entry(offsets=(i, i + 1)) for i in range(n)}


def _forms(obj: dict[str, Any]) -> list[bytes]:
    """The header in the compact form (the writers') and in JSON's default form (spaces)."""
    return [json.dumps(obj, separators=(",", ":")).encode(), json.dumps(obj).encode()]


def _refused(raw: bytes, data_len: int, *parts: str) -> str:
    with pytest.raises(HeaderError) as ei:
        parse_header(raw, data_len, PATH)
    msg = str(ei.value)
    assert msg.startswith(f"{PATH}: "), msg
    for p in parts:
        assert p in msg, (p, msg)
    assert len(msg) < 700, len(msg)  # readable, however large the header
    return msg


@pytest.mark.parametrize("form", [0, 1])
def test_one_bad_entry_among_50k_is_named(form: int) -> None:
    obj = _many(50_000)
    obj["layers.35000.w@0"]["dtype"] = "F4"
    _refused(
        _forms(obj)[form],
        50_000,
        "tensor 'layers.35000.w@0': unknown or unsupported dtype 'F4' (expected one of BF16, BOOL",
    )
    obj["layers.35000.w@0"]["dtype"] = "U8"
    obj["layers.49999.w@0"]["data_offsets"] = [49_999, 50_001]
    _refused(
        _forms(obj)[form], 50_001, "tensor 'layers.49999.w@0': U8[1] needs 1 bytes but data_offsets span 2"
    )


@pytest.mark.parametrize("form", [0, 1])
def test_a_gap_is_named_in_data_order(form: int) -> None:
    obj = _many(1000)
    # Entry 10 moved to the end: in data order, entry 11 starts a byte late.
    obj["layers.10.w@0"]["data_offsets"] = [1000, 1001]
    _refused(
        _forms(obj)[form],
        1001,
        "tensor 'layers.11.w@0' at byte 11 leaves a gap before it (expected byte 10)",
    )
    obj["layers.10.w@0"]["data_offsets"] = [5, 6]
    _refused(_forms(obj)[form], 1000, "tensor 'layers.10.w@0' at byte 5 overlaps the previous tensor")
    _refused(_forms(_many(3))[form], 4, "tensors cover 3 bytes but the data section holds 4")


def test_a_key_of_a_megabyte_is_cut_in_the_message() -> None:
    key = "k" * (1 << 20)
    msg = _refused(json.dumps({key: _entry(dtype="F33")}).encode(), 1, "unknown or unsupported dtype 'F33'")
    assert f"({1 << 20} characters)" in msg
    entries, _ = parse_header(json.dumps({key: _entry()}).encode(), 1, PATH)  # a long key itself is fine
    assert entries[key].end == 1


@pytest.mark.parametrize("form", [0, 1])
def test_a_shape_of_a_million_dims(form: int) -> None:
    _refused(
        _forms({"a": _entry(shape=[1] * 1_000_000)})[form],
        1,
        "tensor 'a': shape must be a list of at most 64 non-negative integers below 2^62, found [1, 1,",
    )
    # 64 dims are fine, 65 are not
    entries, _ = parse_header(_forms({"a": _entry(shape=[1] * 64)})[form], 1, PATH)
    assert entries["a"].shape == (1,) * 64
    _refused(_forms({"a": _entry(shape=[1] * 65)})[form], 1, "tensor 'a': shape must be a list of at most 64")


def test_a_shape_nested_a_million_deep() -> None:
    raw = b'{"a":{"dtype":"U8","shape":' + b"[" * 1_000_000 + b"]" * 1_000_000 + b',"data_offsets":[0,1]}}'
    _refused(raw, 1, "safetensors header is nested too deeply")
    _refused(
        json.dumps({"a": _entry(shape=[[[1] * 100_000]])}).encode(),
        1,
        "tensor 'a': shape must be a list of at most 64",
    )


@pytest.mark.parametrize(
    ("offsets", "parts"),
    [
        ((0, 10**4000 - 1), ["tensor 'a': data_offsets [0, 9999", "out of range of the 1-byte data section"]),
        ((0, 10**19), ["tensor 'a': data_offsets [0, 10000000000000000000] out of range"]),  # past int64
        ((-(2**70), 1), [f"data_offsets [{-(2**70)}, 1] out of range"]),
        ((1, 0), ["tensor 'a': data_offsets [1, 0] out of range of the 1-byte data section"]),
        ((0, 1.0), ["tensor 'a': data_offsets must be two integers, found [0, 1.0]"]),
        ((0, True), ["tensor 'a': data_offsets must be two integers, found [0, True]"]),
        ((0, 1, 2), ["tensor 'a': data_offsets must be two integers, found [0, 1, 2]"]),
    ],
)
@pytest.mark.parametrize("form", [0, 1])
def test_offsets_out_of_every_bound(offsets: tuple[Any, ...], parts: list[str], form: int) -> None:
    _refused(_forms({"a": _entry(offsets=offsets)})[form], 1, *parts)


def test_an_offset_of_5000_digits_is_no_json_number() -> None:
    raw = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,' + b"9" * 5000 + b"]}}"
    _refused(raw, 1, "safetensors header is not valid JSON", "4300 digits")


@pytest.mark.parametrize(
    ("entry", "parts"),
    [
        # dims below 2^62 each, their product past it
        (
            _entry(shape=[2**40, 2**40]),
            ["tensor 'a': shape [1099511627776, 1099511627776] has too many elements"],
        ),
        # 2^61 F64 elements: 2^64 bytes (past int64), data_offsets span 8
        (
            _entry(dtype="F64", shape=[2**61], offsets=(0, 8)),
            [f"tensor 'a': F64[{2**61}] needs {2**64} bytes but data_offsets span 8"],
        ),
        (_entry(shape=[2**62]), ["tensor 'a': shape must be a list of at most 64 non-negative integers"]),
        (_entry(shape=[-1]), ["found [-1]"]),
        (_entry(shape=[True]), ["found [True]"]),
        ({**_entry(), "shape": "1"}, ["found '1'"]),
        (_entry(dtype=["F32"]), ["tensor 'a': unknown or unsupported dtype ['F32']"]),
        (_entry(dtype="F:32"), ["tensor 'a': unknown or unsupported dtype 'F:32'"]),
        (
            [1, 2],
            ["tensor 'a': entry must have exactly dtype, shape and data_offsets, found a JSON list [1, 2]"],
        ),
        ({**_entry(), "x": 1}, ["found fields ['dtype', 'shape', 'data_offsets', 'x']"]),
        ({"dtype": "U8", "shape": [1]}, ["found fields ['dtype', 'shape']"]),
    ],
)
@pytest.mark.parametrize("form", [0, 1])
def test_every_field_refused_with_what_was_found(entry: Any, parts: list[str], form: int) -> None:
    _refused(_forms({"a": entry})[form], 8, *parts)


def test_metadata_and_the_json_itself() -> None:
    _refused(b'{"__metadata__":{"k":1}}', 0, "__metadata__ must map strings to strings, found {'k': 1}")
    _refused(b'{"__metadata__":[]}', 0, "__metadata__ must map strings to strings, found []")
    _refused(
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":' + json.dumps(_entry()).encode() + b"}",
        1,
        "safetensors header has a duplicate key 'a'",
    )
    _refused(
        b'{"\\u003a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"\\u003a":{}}', 1, "duplicate key ':'"
    )
    _refused(b'{"a\\ud800":' + json.dumps(_entry()).encode() + b"}", 1, "lone UTF-16 surrogate")
    _refused(b'{"a":', 1, "safetensors header is not valid JSON")
    _refused(b"[]", 0, "must be a JSON object starting with '{'")
    _refused(b'{"a":\xff}', 0, "safetensors header is not valid UTF-8")
    _refused(b"{}", 5, "tensors cover 0 bytes but the data section holds 5")


def test_empty_and_zero_sized_entries_are_read() -> None:
    entries, meta = parse_header(b'{"__metadata__":{"format":"pt"}}', 0, PATH)
    assert isinstance(entries, HeaderEntries) and len(entries) == 0 and meta == {"format": "pt"}
    obj = {f"e{i}": _entry(shape=[0, 5], offsets=(0, 0)) for i in range(1000)}
    obj["x"] = _entry(dtype="BF16", shape=[], offsets=(0, 2))
    obj["z"] = _entry(shape=[0], offsets=(2, 2))
    for raw in _forms(obj):
        entries, _ = parse_header(raw, 2, PATH)
        assert (entries["e999"].shape, entries["e999"].nbytes) == ((0, 5), 0)
        assert (entries["x"].shape, entries["x"].begin, entries["x"].end) == ((), 0, 2)
        assert (entries["z"].begin, entries["z"].end) == (2, 2)
    # (a colon in a key or a value does not upset the duplicate count)
    entries, meta = parse_header(
        json.dumps({"__metadata__": {"a:b": "c:d"}, "k:1": _entry()}).encode(), 1, PATH
    )
    assert list(entries) == ["k:1"] and meta == {"a:b": "c:d"}


def test_the_file_is_named_through_header_from_bytes() -> None:
    raw = json.dumps({"w": _entry(dtype="I4")}).encode()
    blob = len(raw).to_bytes(8, "little") + raw + b"\0"
    with pytest.raises(
        HeaderError, match=r"^s3://b/ck/f\.safetensors: tensor 'w': unknown or unsupported dtype 'I4'"
    ):
        header_from_bytes(blob, len(blob), "s3://b/ck/f.safetensors")
