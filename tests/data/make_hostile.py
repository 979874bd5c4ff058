"""Generate the small hostile files of tests/data/hostile/ (run: .venv/bin/python tests/data/make_hostile.py).

Each file is a safetensors file (``*.safetensors``) or a model index (``*.index.json``) built to
attack one check of the reader. ``manifest.json`` maps each file name to the exception class
unickpt must answer it with and a one-line description. Index files are meant to be placed as
``model.safetensors.index.json`` next to ``good.safetensors`` (a valid 2-tensor file).
test_hostile.py checks that these files are exactly what this script writes, and that each is
refused with its exception. Nothing here is executed from data: these are plain bytes.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

from unickpt.spec.naming import SLICED_SENTINEL

OUT = Path(__file__).resolve().parent / "hostile"
GOOD = "model-00001-of-00001.safetensors"


def st(header: object, data: bytes = b"", raw: bytes | None = None, length: int | None = None) -> bytes:
    h = raw if raw is not None else json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def ent(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# The valid data file the index cases point at: a F32[2,3] and an I64[4].
GOOD_HEADER = {"__metadata__": {"format": "pt"}, "w": ent("F32", [2, 3], 0, 24), "n": ent("I64", [4], 24, 56)}
GOOD_BYTES = st(GOOD_HEADER, bytes(range(56)))


def good_tensors() -> dict[str, object]:
    def sl(
        key: str, shape: list[int], file: str = GOOD, offsets: list[int] | None = None
    ) -> dict[str, object]:
        return {"file": file, "key": key, "offsets": offsets or [0] * len(shape), "shape": shape}

    return {
        "w": {"dtype": "F32", "shape": [2, 3], "slices": [sl("w", [2, 3])]},
        "n": {"dtype": "I64", "shape": [4], "slices": [sl("n", [4])]},
    }


def index(
    tensors: dict[str, object] | None = None, weight_map: dict[str, str] | None = None, **block: object
) -> bytes:
    t = tensors if tensors is not None else good_tensors()
    wm = weight_map if weight_map is not None else {k: GOOD for k in t}
    obj = {
        "metadata": {"total_size": 56},
        "weight_map": wm,
        "unickpt": {"kind": "model", "tensors": t, **block},
    }
    return json.dumps(obj).encode()


def with_slice(name: str, **changes: object) -> bytes:
    t = good_tensors()
    t[name]["slices"][0].update(changes)  # type: ignore[index]
    return index(t)


def cases() -> dict[str, tuple[bytes, str, str]]:
    f32 = ent("F32", [2], 0, 8)
    c: dict[str, tuple[bytes, str, str]] = {
        # ---------------------------------------------------------------- safetensors headers
        "st_too_short.safetensors": (b"\x01\x00", "HeaderError", "file shorter than the 8-byte length"),
        "st_huge_header_len.safetensors": (
            st(None, raw=b"{}", length=(1 << 63) + 5),
            "HeaderError",
            "header length 2^63: refused before allocation",
        ),
        "st_header_len_past_eof.safetensors": (
            st(None, raw=b"{}", length=99_000_000),
            "HeaderError",
            "99 MB header length in a tiny file",
        ),
        "st_not_utf8.safetensors": (st(None, raw=b'{"\xff\xfe":1}'), "HeaderError", "header not UTF-8"),
        "st_not_object.safetensors": (st([1, 2]), "HeaderError", "header is a JSON array"),
        "st_bad_json.safetensors": (st(None, raw=b'{"a":'), "HeaderError", "truncated JSON"),
        "st_deep_nesting.safetensors": (
            st(None, raw=b'{"a":' + b"[" * 5_000 + b"]" * 5_000 + b"}"),
            "HeaderError",
            "5,000 nested arrays",
        ),
        "st_duplicate_name.safetensors": (
            st(
                None,
                raw=b'{"a":' + json.dumps(f32).encode() + b',"a":' + json.dumps(f32).encode() + b"}",
                data=bytes(8),
            ),
            "HeaderError",
            "same tensor name twice",
        ),
        "st_unknown_dtype.safetensors": (
            st({"a": ent("Q7", [2], 0, 8)}, bytes(8)),
            "HeaderError",
            "dtype Q7",
        ),
        "st_negative_shape.safetensors": (
            st({"a": ent("F32", [-2], 0, 8)}, bytes(8)),
            "HeaderError",
            "shape [-2]",
        ),
        "st_enormous_shape.safetensors": (
            st({"a": ent("F32", [1 << 40, 1 << 40], 0, 8)}, bytes(8)),
            "HeaderError",
            "2^80 elements",
        ),
        "st_shape_overflow_bytes.safetensors": (
            st({"a": ent("F64", [1 << 61], 0, 8)}, bytes(8)),
            "HeaderError",
            "2^61 x 8 bytes overflows int64",
        ),
        "st_too_many_dims.safetensors": (
            st({"a": ent("F32", [1] * 100, 0, 4)}, bytes(4)),
            "HeaderError",
            "100 dims",
        ),
        "st_bool_in_shape.safetensors": (
            st({"a": ent("F32", [True, 2], 0, 8)}, bytes(8)),
            "HeaderError",
            "true as a dim",
        ),
        "st_float_offsets.safetensors": (
            st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}, bytes(8)),
            "HeaderError",
            "float offsets",
        ),
        "st_offsets_out_of_range.safetensors": (
            st({"a": ent("F32", [2], 0, 8)}, bytes(4)),
            "HeaderError",
            "offsets past the end of the data",
        ),
        "st_offsets_negative.safetensors": (
            st({"a": ent("F32", [2], -8, 0)}, bytes(8)),
            "HeaderError",
            "negative begin",
        ),
        "st_overlap.safetensors": (
            st({"a": ent("F32", [2], 0, 8), "b": ent("F32", [2], 4, 12)}, bytes(12)),
            "HeaderError",
            "two tensors overlap",
        ),
        "st_gap.safetensors": (
            st({"a": ent("F32", [2], 4, 12)}, bytes(12)),
            "HeaderError",
            "gap before the tensor",
        ),
        "st_trailing_bytes.safetensors": (
            st({"a": f32}, bytes(16)),
            "HeaderError",
            "data past the last tensor",
        ),
        "st_size_mismatch.safetensors": (
            st({"a": ent("F32", [3], 0, 8)}, bytes(8)),
            "HeaderError",
            "F32[3] in 8 bytes",
        ),
        "st_extra_field.safetensors": (
            st({"a": {**f32, "exec": "rm -rf /"}}, bytes(8)),
            "HeaderError",
            "unknown entry field",
        ),
        "st_metadata_not_str.safetensors": (
            st({"__metadata__": {"format": 1}, "a": f32}, bytes(8)),
            "HeaderError",
            "__metadata__ value not a string",
        ),
        "st_unickpt_meta_garbage.safetensors": (
            st({"__metadata__": {"unickpt": '{"tensors": [1]'}, "a": f32}, bytes(8)),
            "IndexFileError",
            "unickpt block in the metadata is not JSON",
        ),
        "st_unickpt_meta_wrong_types.safetensors": (
            st(
                {"__metadata__": {"unickpt": '{"kind":"model","tensors":{"a":{"slices":7}}}'}, "a": f32},
                bytes(8),
            ),
            "IndexFileError",
            "unickpt block with slices of the wrong type",
        ),
        "st_unickpt_meta_deep.safetensors": (
            st({"__metadata__": {"unickpt": "[" * 5_000 + "]" * 5_000}, "a": f32}, bytes(8)),
            "IndexFileError",
            "unickpt block nested 5,000 deep",
        ),
        # ---------------------------------------------------------------- index files
        "ix_not_utf8.index.json": (b'{"weight_map": {"\xff": "x"}}', "IndexFileError", "index not UTF-8"),
        "ix_not_json.index.json": (b'{"weight_map": ', "IndexFileError", "truncated JSON"),
        "ix_array.index.json": (b"[]", "IndexFileError", "index is an array"),
        "ix_deep.index.json": (
            b'{"x":' + b"[" * 5_000 + b"]" * 5_000 + b"}",
            "IndexFileError",
            "5,000 nested arrays",
        ),
        "ix_duplicate_key.index.json": (
            b'{"weight_map": {"w": "' + GOOD.encode() + b'", "w": "' + GOOD.encode() + b'"}}',
            "IndexFileError",
            "weight_map names w twice",
        ),
        "ix_no_weight_map.index.json": (b'{"metadata": {}}', "IndexFileError", "no weight_map"),
        "ix_abs_path.index.json": (
            index(weight_map={"w": "/etc/passwd", "n": GOOD}),
            "UnsafePathError",
            "absolute path",
        ),
        "ix_dotdot.index.json": (
            index(weight_map={"w": "../outside.safetensors", "n": GOOD}),
            "UnsafePathError",
            "..",
        ),
        "ix_subdir.index.json": (
            index(weight_map={"w": "sub/x.safetensors", "n": GOOD}),
            "UnsafePathError",
            "a subdirectory",
        ),
        "ix_backslash.index.json": (
            index(weight_map={"w": "..\\..\\x.safetensors", "n": GOOD}),
            "UnsafePathError",
            "Windows separators",
        ),
        "ix_drive.index.json": (
            index(weight_map={"w": "C:x.safetensors", "n": GOOD}),
            "UnsafePathError",
            "drive letter",
        ),
        "ix_hidden.index.json": (
            index(weight_map={"w": ".x.safetensors", "n": GOOD}),
            "UnsafePathError",
            "hidden file",
        ),
        "ix_nul.index.json": (
            index(weight_map={"w": "a\u0000.safetensors", "n": GOOD}),
            "UnsafePathError",
            "NUL byte",
        ),
        "ix_not_safetensors.index.json": (
            index(weight_map={"w": "model.py", "n": GOOD}),
            "UnsafePathError",
            "a .py file",
        ),
        "ix_slice_abs_path.index.json": (
            with_slice("w", file="/tmp/x.safetensors"),
            "UnsafePathError",
            "slice file absolute",
        ),
        "ix_slice_dotdot.index.json": (
            with_slice("w", file="..%2f..safetensors"),
            "UnsafePathError",
            "slice file with ..",
        ),
        "ix_slice_out_of_range.index.json": (
            with_slice("w", offsets=[1, 0]),
            "IndexFileError",
            "slice runs past the tensor",
        ),
        "ix_slice_negative.index.json": (
            with_slice("w", offsets=[-1, 0]),
            "IndexFileError",
            "negative offset",
        ),
        "ix_slice_wrong_ndim.index.json": (
            with_slice("w", shape=[6]),
            "IndexFileError",
            "slice with the wrong rank",
        ),
        "ix_unknown_dtype.index.json": (
            index({**good_tensors(), "w": {**good_tensors()["w"], "dtype": "pickle"}}),
            "IndexFileError",
            "dtype pickle",
        ),  # type: ignore[dict-item]
        "ix_enormous_shape.index.json": (
            index({"w": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "slices": []}}, {"w": GOOD}),
            "IndexFileError",
            "2^80 elements",
        ),
        "ix_bad_hash.index.json": (
            with_slice("w", xxh3="not-hex"),
            "IndexFileError",
            "hash not 16 hex digits",
        ),
        "ix_unknown_key.index.json": (
            index(exploit="__import__('os')"),
            "IndexFileError",
            "unknown key in the unickpt block",
        ),
        "ix_alias_dangling.index.json": (
            index(aliases={"v": "nowhere"}),
            "IndexFileError",
            "alias to nothing",
        ),
        "ix_future_version.index.json": (index(format_version=99), "IndexFileError", "format_version 99"),
        "ix_overlapping_slices.index.json": (
            index(
                {
                    **good_tensors(),
                    "n": {
                        "dtype": "I64",
                        "shape": [4],
                        "slices": [
                            {"file": GOOD, "key": "n", "offsets": [0], "shape": [4]},
                            {"file": GOOD, "key": "n", "offsets": [0], "shape": [4]},
                        ],
                    },
                }
            ),
            "IndexFileError",
            "two slices cover the same elements",
        ),
        "ix_gap.index.json": (
            index(
                {
                    **good_tensors(),
                    "n": {
                        "dtype": "I64",
                        "shape": [8],
                        "slices": [{"file": GOOD, "key": "n", "offsets": [0], "shape": [4]}],
                    },
                }
            ),
            "IndexFileError",
            "half the tensor missing",
        ),
        "ix_key_missing_in_file.index.json": (
            # Sliced (a gathered index must store each tensor under its own name: refused earlier).
            index(
                {
                    **good_tensors(),
                    "w": {
                        **good_tensors()["w"],
                        "slices": [{"file": GOOD, "key": "nope", "offsets": [0, 0], "shape": [2, 3]}],
                    },
                },
                weight_map={k: SLICED_SENTINEL for k in good_tensors()},
                layout={"gathered": False},
            ),
            "HeaderError",
            "key absent from the file",
        ),
        "ix_shape_disagrees_with_file.index.json": (
            index(
                {
                    **good_tensors(),
                    "w": {
                        "dtype": "F32",
                        "shape": [3, 2],
                        "slices": [{"file": GOOD, "key": "w", "offsets": [0, 0], "shape": [3, 2]}],
                    },
                }
            ),
            "HeaderError",
            "index shape differs from the header's",
        ),
        "ix_dtype_disagrees_with_file.index.json": (
            index(
                {
                    **good_tensors(),
                    "w": {
                        "dtype": "I32",
                        "shape": [2, 3],
                        "slices": [{"file": GOOD, "key": "w", "offsets": [0, 0], "shape": [2, 3]}],
                    },
                }
            ),
            "HeaderError",
            "index dtype differs from the header's",
        ),
        "ix_missing_file.index.json": (
            index(
                {
                    **good_tensors(),
                    "w": {
                        **good_tensors()["w"],
                        "slices": [
                            {
                                "file": "model-00002-of-00002.safetensors",
                                "key": "w",
                                "offsets": [0, 0],
                                "shape": [2, 3],
                            }
                        ],
                    },
                },
                weight_map={"w": "model-00002-of-00002.safetensors", "n": GOOD},
            ),
            "IncompleteCheckpointError",
            "data file absent",
        ),
        "ix_plain_hf_bin.index.json": (
            json.dumps({"weight_map": {"w": "pytorch_model.bin"}}).encode(),
            "CheckpointFormatError",
            "plain HF index naming a pickle .bin shard",
        ),
    }
    c.update(more_cases())
    return c


def _with_len(raw: bytes, delta: int) -> bytes:
    """A valid file whose 8-byte header length is off by ``delta``."""
    (n,) = struct.unpack("<Q", raw[:8])
    return struct.pack("<Q", n + delta) + raw[8:]


def _raw_index(text: str) -> bytes:
    """An index written by hand (JSON that json.dumps would never produce)."""
    return text.replace("GOOD", GOOD).encode()


def _block_meta(block: str) -> bytes:
    """A single file holding F32[2] 'a' whose unickpt metadata block is the JSON text ``block``."""
    return st({"__metadata__": {"format": "pt", "unickpt": block}, "a": ent("F32", [2], 0, 8)}, bytes(8))


def more_cases() -> dict[str, tuple[bytes, str, str]]:
    """Names, numbers and encodings that JSON allows and a checkpoint must not trip over.

    ``"ok"`` marks a file that is a valid checkpoint: every reader and tool must accept it (and
    print or write its odd names without crashing).
    """
    f32 = ent("F32", [2], 0, 8)
    good = GOOD_BYTES
    t_ix = good_tensors()
    slice_w = json.dumps(t_ix["w"]["slices"][0])  # type: ignore[index]
    slice_n = json.dumps(t_ix["n"]["slices"][0])  # type: ignore[index]
    tensors_json = (
        '{"w": {"dtype": "F32", "shape": [2, 3], "slices": [' + slice_w + "]}, "
        '"n": {"dtype": "I64", "shape": [4], "slices": [' + slice_n + "]}}"
    )
    wm = '{"w": "GOOD", "n": "GOOD"}'

    def ix_text(tensors: str = tensors_json, weight_map: str = wm, extra: str = "") -> bytes:
        return _raw_index(
            '{"metadata": {"total_size": 56}, "weight_map": ' + weight_map + ', "unickpt": {"kind": "model", '
            '"tensors": ' + tensors + extra + "}}"
        )

    def renamed(old: str, new: str) -> bytes:
        """The good index with tensor ``old`` called ``new`` (its slices keep their keys)."""
        t = good_tensors()
        t[new] = t.pop(old)
        return index(t, {k: GOOD for k in t})

    return {
        # ------------------------------------------------ safetensors: names
        "st_name_backslash_u.safetensors": (
            st(None, raw=b'{"a\\\\ud800":' + json.dumps(f32).encode() + b"}", data=bytes(8)),
            "ok",
            "a backslash then 'ud800' in a name: an escaped backslash, not a surrogate",
        ),
        "st_name_surrogate_escape.safetensors": (
            st(None, raw=b'{"a\ud800b":' + json.dumps(f32).encode() + b"}", data=bytes(8)),
            "HeaderError",
            "tensor name with a lone surrogate escape",
        ),
        "st_name_low_surrogate.safetensors": (
            st(None, raw=b'{"\udfff":' + json.dumps(f32).encode() + b"}", data=bytes(8)),
            "HeaderError",
            "tensor name that is a lone low surrogate",
        ),
        "st_name_surrogate_pair.safetensors": (
            st(None, raw=b'{"\ud83d\ude00":' + json.dumps(f32).encode() + b"}", data=bytes(8)),
            "ok",
            "a valid surrogate pair (an emoji) as a name",
        ),
        "st_metadata_surrogate.safetensors": (
            st(
                None,
                raw=b'{"__metadata__":{"format":"\udc80"},"a":' + json.dumps(f32).encode() + b"}",
                data=bytes(8),
            ),
            "HeaderError",
            "lone surrogate in a metadata value",
        ),
        "st_name_controls.safetensors": (
            st({"a\u0000b\n\r\t\u001b[31mred\u0007": f32}, bytes(8)),
            "ok",
            "NUL, newline, CR, tab, ANSI escape, bell in a name",
        ),
        "st_name_rtl.safetensors": (
            st({"\u202eexe.txt\u200f\u2066x": f32}, bytes(8)),
            "ok",
            "right-to-left override and isolate marks in a name",
        ),
        "st_name_long.safetensors": (st({"n" * 20_000: f32}, bytes(8)), "ok", "a 20,000-character name"),
        "st_name_empty.safetensors": (st({"": f32}, bytes(8)), "ok", "the empty string as a name"),
        "st_name_at.safetensors": (
            st({"w@0": f32, "w@": ent("F32", [0], 8, 8)}, bytes(8)),
            "ok",
            "names that look like slice keys",
        ),
        # ------------------------------------------------ safetensors: numbers
        "st_shape_nan.safetensors": (
            st(None, raw=b'{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,8]}}', data=bytes(8)),
            "HeaderError",
            "NaN literal as a dim",
        ),
        "st_shape_infinity.safetensors": (
            st(None, raw=b'{"a":{"dtype":"F32","shape":[Infinity],"data_offsets":[0,8]}}', data=bytes(8)),
            "HeaderError",
            "Infinity literal as a dim",
        ),
        "st_offsets_neg_infinity.safetensors": (
            st(None, raw=b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[-Infinity,8]}}', data=bytes(8)),
            "HeaderError",
            "-Infinity as an offset",
        ),
        "st_shape_huge_int.safetensors": (
            st(
                None,
                raw=b'{"a":{"dtype":"F32","shape":[' + b"9" * 400 + b'],"data_offsets":[0,8]}}',
                data=bytes(8),
            ),
            "HeaderError",
            "a 400-digit dim",
        ),
        "st_offsets_huge_int.safetensors": (
            st(
                None,
                raw=b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,' + b"9" * 5000 + b"]}}",
                data=bytes(8),
            ),
            "HeaderError",
            "a 5,000-digit offset",
        ),
        "st_shape_float.safetensors": (
            st(None, raw=b'{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', data=bytes(8)),
            "HeaderError",
            "2.0 as a dim",
        ),
        "st_shape_exponent.safetensors": (
            st(None, raw=b'{"a":{"dtype":"F32","shape":[2e0],"data_offsets":[0,8]}}', data=bytes(8)),
            "HeaderError",
            "2e0 as a dim",
        ),
        "st_shape_string.safetensors": (
            st(None, raw=b'{"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}}', data=bytes(8)),
            "HeaderError",
            "a number as a string",
        ),
        "st_offsets_string.safetensors": (
            st(None, raw=b'{"a":{"dtype":"F32","shape":[2],"data_offsets":["0","8"]}}', data=bytes(8)),
            "HeaderError",
            "offsets as strings",
        ),
        "st_offsets_bool.safetensors": (
            st(None, raw=b'{"a":{"dtype":"F32","shape":[],"data_offsets":[false,true]}}', data=bytes(1)),
            "HeaderError",
            "false/true as offsets",
        ),
        "st_shape_neg_zero.safetensors": (
            st(None, raw=b'{"a":{"dtype":"F32","shape":[-0,2],"data_offsets":[0,0]}}'),
            "ok",
            "-0 as a dim: the integer 0",
        ),
        "st_dtype_lowercase.safetensors": (
            st({"a": ent("f32", [2], 0, 8)}, bytes(8)),
            "HeaderError",
            "dtype in lower case",
        ),
        "st_dtype_null.safetensors": (
            st({"a": {"dtype": None, "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
            "HeaderError",
            "dtype null",
        ),
        # ------------------------------------------------ safetensors: structure and encoding
        "st_empty.safetensors": (b"", "HeaderError", "an empty file"),
        "st_only_length.safetensors": (
            struct.pack("<Q", 0),
            "HeaderError",
            "a zero header length and nothing else",
        ),
        "st_header_spaces.safetensors": (st(None, raw=b" " * 16), "HeaderError", "a header of spaces"),
        "st_bom.safetensors": (
            st(None, raw=b"\xef\xbb\xbf" + json.dumps({"a": f32}).encode(), data=bytes(8)),
            "HeaderError",
            "UTF-8 BOM before the header",
        ),
        "st_utf16.safetensors": (
            st(None, raw=json.dumps({"a": f32}).encode("utf-16"), data=bytes(8)),
            "HeaderError",
            "header in UTF-16",
        ),
        "st_latin1_name.safetensors": (
            st(None, raw=b'{"caf\xe9":' + json.dumps(f32).encode() + b"}", data=bytes(8)),
            "HeaderError",
            "a Latin-1 byte in a name",
        ),
        "st_header_len_short_by_one.safetensors": (
            _with_len(good, -1),
            "HeaderError",
            "header length one byte short",
        ),
        "st_header_len_long_by_one.safetensors": (
            _with_len(good, 1),
            "HeaderError",
            "header length one byte long",
        ),
        "st_truncated_in_data.safetensors": (good[:-1], "HeaderError", "last data byte missing"),
        "st_truncated_in_header.safetensors": (good[:20], "HeaderError", "cut inside the header"),
        "st_duplicate_metadata.safetensors": (
            st(None, raw=b'{"__metadata__":{"format":"pt","format":"pt"}}'),
            "HeaderError",
            "duplicate metadata key",
        ),
        "st_duplicate_entry_field.safetensors": (
            st(
                None,
                raw=b'{"a":{"dtype":"F32","dtype":"I32","shape":[2],"data_offsets":[0,8]}}',
                data=bytes(8),
            ),
            "HeaderError",
            "dtype given twice in one entry",
        ),
        "st_metadata_nested.safetensors": (
            st({"__metadata__": {"a": {"b": "c"}}}),
            "HeaderError",
            "nested metadata value",
        ),
        "st_metadata_twice_deep.safetensors": (
            st(None, raw=b'{"__metadata__":' + b'{"a":' * 3000 + b'"x"' + b"}" * 3000 + b"}"),
            "HeaderError",
            "metadata nested 3,000 deep",
        ),
        "st_zero_size_and_scalar.safetensors": (
            st(
                {"e": ent("F32", [0, 5], 0, 0), "s": ent("F64", [], 0, 8), "z": ent("I8", [3, 0, 2], 8, 8)},
                bytes(8),
            ),
            "ok",
            "zero-size tensors and a 0-dim tensor",
        ),
        "st_only_empty_tensors.safetensors": (
            st({"e": ent("BOOL", [0], 0, 0)}),
            "ok",
            "one empty tensor, no data at all",
        ),
        "st_no_tensors.safetensors": (st({"__metadata__": {"format": "pt"}}), "ok", "metadata and no tensor"),
        "st_unickpt_meta_surrogate.safetensors": (
            _block_meta(
                '{"kind": "model", "tensors": {"\\ud800": {"dtype": "F32", "shape": [2], "slices": []}}}'
            ),
            "IndexFileError",
            "lone surrogate inside the unickpt block of a single file",
        ),
        "st_unickpt_meta_optimizer_kind.safetensors": (
            _block_meta(
                '{"kind": "optimizer", "tensors": {"a": {"dtype": "F32", "shape": [2], "slices": '
                '[{"file": "x.safetensors", "key": "a", "offsets": [0], "shape": [2]}]}}}'
            ),
            "IndexFileError",
            "a single optimizer checkpoint where the model one is expected",
        ),
        "st_unickpt_meta_param_state_deep.safetensors": (
            _block_meta(
                '{"kind": "model", "tensors": {"a": {"dtype": "F32", "shape": [2], "slices": '
                '[{"file": "x.safetensors", "key": "a", "offsets": [0], "shape": [2]}]}}, "param_state": {"p": {"k": '
                + "[" * 500
                + "]" * 500
                + "}}}"
            ),
            "IndexFileError",
            "param_state nested 500 deep",
        ),
        "st_unickpt_meta_duplicate.safetensors": (
            _block_meta('{"kind": "model", "kind": "model", "tensors": {}}'),
            "IndexFileError",
            "duplicate key in the unickpt block",
        ),
        # ------------------------------------------------ index files
        "ix_empty.index.json": (b"", "IndexFileError", "an empty index"),
        "ix_bom.index.json": (b"\xef\xbb\xbf" + index(), "IndexFileError", "UTF-8 BOM before the index"),
        "ix_utf16.index.json": (index().decode().encode("utf-16"), "IndexFileError", "index in UTF-16"),
        "ix_name_surrogate.index.json": (
            ix_text(tensors_json.replace('"w"', '"w\\udbff"', 1), wm.replace('"w"', '"w\\udbff"')),
            "IndexFileError",
            "tensor name with a lone surrogate escape",
        ),
        "ix_weight_map_file_surrogate.index.json": (
            ix_text(weight_map='{"w": "\\ud800.safetensors", "n": "GOOD"}'),
            "IndexFileError",
            "file name with a lone surrogate escape",
        ),
        "ix_metadata_surrogate.index.json": (
            _raw_index(index().decode().replace('"total_size": 56', '"total_size": 56, "note": "\\udc00"')),
            "IndexFileError",
            "lone surrogate in a preserved metadata value",
        ),
        # A gathered index stores each tensor under its own name, so these renames are refused as a
        # disagreement between the name and the stored key (odd names themselves are fine: st_name_*).
        "ix_name_controls.index.json": (
            renamed("w", "w\u0000\n\u001b[2J\u202e"),
            "IndexFileError",
            "control characters and RTL in a name stored under another key",
        ),
        "ix_name_long.index.json": (
            renamed("w", "w" * 20_000),
            "IndexFileError",
            "a 20,000-character name stored under another key",
        ),
        "ix_alias_controls.index.json": (
            index(aliases={"w\u0000\n\u001b[2J\u202e": "w"}),
            "ok",
            "control characters and RTL in a tied name",
        ),
        "ix_alias_long.index.json": (
            index(aliases={"n" * 20_000: "n"}),
            "ok",
            "a 20,000-character tied name",
        ),
        "ix_duplicate_tensor.index.json": (
            ix_text(tensors_json[:-1] + ', "w": ' + json.dumps(good_tensors()["w"]) + "}"),
            "IndexFileError",
            "the same tensor twice in unickpt.tensors",
        ),
        "ix_duplicate_slice_field.index.json": (
            ix_text(tensors_json.replace('"key": "w"', '"key": "w", "key": "n"')),
            "IndexFileError",
            "key given twice in one slice",
        ),
        "ix_duplicate_block.index.json": (
            _raw_index(index().decode()[:-1] + ', "unickpt": {"kind": "model", "tensors": {}}}'),
            "IndexFileError",
            "the unickpt block twice",
        ),
        "ix_offsets_true.index.json": (
            with_slice("n", offsets=[True]),
            "IndexFileError",
            "true as an offset",
        ),
        "ix_shape_false.index.json": (
            index({**good_tensors(), "n": {"dtype": "I64", "shape": [False], "slices": []}}),
            "IndexFileError",
            "false as a dim",
        ),
        "ix_offsets_float.index.json": (with_slice("n", offsets=[0.0]), "IndexFileError", "0.0 as an offset"),
        "ix_offsets_string.index.json": (
            with_slice("n", offsets=["0"]),
            "IndexFileError",
            "an offset as a string",
        ),
        "ix_shape_string.index.json": (with_slice("n", shape=["4"]), "IndexFileError", "a dim as a string"),
        "ix_offsets_huge.index.json": (
            with_slice("n", offsets=[10**30]),
            "IndexFileError",
            "a 31-digit offset",
        ),
        "ix_offsets_nan.index.json": (
            _raw_index(index().decode().replace('"offsets": [0]', '"offsets": [NaN]')),
            "IndexFileError",
            "NaN as an offset",
        ),
        "ix_total_size_infinity.index.json": (
            _raw_index(index().decode().replace('"total_size": 56', '"total_size": Infinity')),
            "IndexFileError",
            "Infinity as total_size",
        ),
        "ix_version_true.index.json": (
            index(format_version=True),
            "IndexFileError",
            "true as format_version",
        ),
        "ix_version_float.index.json": (index(format_version=1.0), "IndexFileError", "1.0 as format_version"),
        "ix_offsets_neg_zero.index.json": (
            _raw_index(index().decode().replace('"offsets": [0]', '"offsets": [-0]')),
            "ok",
            "-0 as an offset: the integer 0",
        ),
        "ix_param_state_deep.index.json": (
            index(param_state={"p": {"k": json.loads("[" * 200 + "]" * 200)}}),
            "IndexFileError",
            "param_state nested 200 deep",
        ),
        "ix_weight_map_not_str.index.json": (
            index(weight_map={"w": 5, "n": GOOD}),
            "IndexFileError",
            "a number as a file name",
        ),  # type: ignore[dict-item]
        "ix_kind_optimizer.index.json": (
            index(kind="optimizer"),
            "IndexFileError",
            "an optimizer index under the model's name",
        ),
        "ix_slices_not_list.index.json": (
            with_slice("w", shape={"0": 2}),
            "IndexFileError",
            "an object as a slice shape",
        ),
        "ix_zero_size_and_scalar.index.json": (
            index(
                {
                    **good_tensors(),
                    "e": {
                        "dtype": "F32",
                        "shape": [0, 3],
                        "slices": [{"file": GOOD, "key": "w", "offsets": [0, 0], "shape": [0, 3]}],
                    },
                }
            ),
            "IndexFileError",
            "an empty tensor naming a key another slice names (the consistency check refuses it first)",
        ),
    }


def write(out: Path = OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, (data, err, why) in sorted(cases().items()):
        (out / name).write_bytes(data)
        manifest[name] = {"error": err, "what": why}
    (out / GOOD).write_bytes(GOOD_BYTES)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
