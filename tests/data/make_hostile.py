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

from unickpt.format.naming import SLICED_SENTINEL

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
    return c


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
