"""Hostile counts in unickpt's own files: every count, size, extent and length field scaled to
extremes (test_bounds.py builds and checks them; nothing is committed, the files are made in a
temporary directory).

Each case is a small file (a few bytes to a few MB) that declares far more than it holds: a
compact ``grid`` of 10^9 cells, a shape of 2^62 elements, 10^6 file ids, a megabyte-long key, a
header length of 2^63, a ``latest`` naming step 10^30, a COMMIT of 10^12 ranks... The base
checkpoint is a sliced one written here byte by byte (two data files, a tensor ``w`` F32[4, 3]
cut in two row blocks, one per file, and ``n`` I64[4] whole in the first), at format version 5 in
each of its two forms of slices: listed (form 2) and compact (form 5).
"""

from __future__ import annotations

import copy
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unickpt.spec.index import as_listed
from unickpt.spec.naming import SLICED_SENTINEL

INDEX = "model.safetensors.index.json"
FILES = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
SAVE = "0123456789abcdef0123456789abcdef"
#: The forms of the index: 2, every tensor's slices listed; 5, compact (both format version 5).
VERSIONS = (2, 5)
#: The forms swept by default.
FORMS = (2, 5)
#: The extreme values every count field is scaled to (more with ``big``).
HUGE = (10**9, 2**62 - 1)


def st(header: dict[str, Any], data: bytes = b"", length: int | None = None) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def ent(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


META = {"format": "unickpt-sliced", "unickpt_save": SAVE}
FILE0 = st(
    {"__metadata__": META, "w@0": ent("F32", [2, 3], 0, 24), "n@0": ent("I64", [4], 24, 56)}, bytes(56)
)
FILE1 = st({"__metadata__": META, "w@1": ent("F32", [2, 3], 0, 24)}, bytes(24))


def base_index(version: int = 5) -> dict[str, Any]:
    """The base checkpoint's index as JSON, its slices listed (``version`` 2) or compact (5)."""
    obj: dict[str, Any] = {
        "metadata": {"total_size": 80},
        "weight_map": {},
        "unickpt": {
            "format_version": 5,
            "kind": "model",
            "files": list(FILES),
            "created_by": "unickpt test",
            "layout": {"plugin": "fsdp2", "world_size": 2, "mesh": {"dp": 2}, "gathered": False},
            "tensors": {
                "w": {"dtype": "F32", "shape": [4, 3], "grid": [2, 1]},
                "n": {"dtype": "I64", "shape": [4], "file": 0},
            },
            "save_id": SAVE,
        },
    }
    if version < 3:
        obj = as_listed(obj)
    obj["weight_map"] = dict.fromkeys(obj["unickpt"]["tensors"], SLICED_SENTINEL)
    return obj


def write_checkpoint(d: Path, index: dict[str, Any] | bytes, files: dict[str, bytes] | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name, data in (files if files is not None else {FILES[0]: FILE0, FILES[1]: FILE1}).items():
        (d / name).write_bytes(data)
    raw = index if isinstance(index, bytes) else json.dumps(index, separators=(",", ":")).encode()
    (d / INDEX).write_bytes(raw)
    return d


@dataclass(frozen=True)
class Case:
    """One hostile file: ``build(dir)`` writes it and returns the path to open; ``error`` is the
    exception class name expected (``"ok"``: opens and is described, bounded all the same) and
    ``field`` a part of the message naming the field (None: not checked)."""

    name: str
    kind: str  # "index", "single", "data", "latest", "commit", "hashes", "train_state"
    build: Callable[[Path], Path]
    error: str
    field: str | None
    verify: str | None = None  # what verify answers, when it differs from opening


def _edit(version: int, edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        obj = base_index(version)
        edit(obj)
        return write_checkpoint(d, obj)

    return build


def _w(obj: dict[str, Any]) -> dict[str, Any]:
    t: dict[str, Any] = obj["unickpt"]["tensors"]["w"]
    return t


def _set(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def edit(obj: dict[str, Any]) -> None:
        t = _w(obj)
        for k, v in fields.items():
            if v is None:
                t.pop(k, None)
            else:
                t[k] = copy.deepcopy(v)

    return edit


def _adder(out: list[Case], v: int) -> Callable[..., None]:
    def add(
        name: str, edit: Callable[[dict[str, Any]], None], error: str, field: str | None, **kw: Any
    ) -> None:
        out.append(Case(f"v{v}-{name}", "index", _edit(v, edit), error, field, **kw))

    return add


def index_cases(big: bool = False) -> list[Case]:
    huge = HUGE + ((10**12, 2**40, 10**18) if big else ())
    many = 10**6 if big else 10**5  # items of a list the index holds (bytes present)
    lots = 10**5 if big else 1_000  # entries that each take a name (tensors, aliases, boxes)
    out: list[Case] = []
    for v in VERSIONS if big else FORMS:
        compact = v >= 3

        add = _adder(out, v)

        add("control", lambda obj: None, "ok", None, verify="ok")
        # shapes: products past 2^62, past the data, negative, 10^6 dims
        for n in huge:  # 10^18 elements are a shape; 2^124 are not
            fits = n * n < 2**62
            add(
                f"shape-{n}",
                _set(shape=[n, n]),
                "ok" if fits else "IndexFileError",
                "shape",
                verify=("HeaderError" if compact else "IndexFileError") if fits else None,
            )
        add(
            "shape-data",
            _set(shape=[4 * 2**30, 3]),
            "ok",
            None,
            verify="HeaderError" if compact else "IndexFileError",
        )
        add("shape-negative", _set(shape=[-4, 3]), "IndexFileError", "shape")
        add("shape-ndim", _set(shape=[1] * many), "IndexFileError", "shape")
        add("shape-string", _set(shape="4" * many), "IndexFileError", "shape")
        if compact:
            # the grid: 10^9 cells, 2^62, negative, a million parts, a part list of a million
            for n in huge:
                add(f"grid-{n}", _set(grid=[n, 1], file=0), "IndexFileError", "grid")
                add(f"grid-2d-{n}", _set(grid=[n, n], file=0), "IndexFileError", "grid")
                add(f"grid-nofile-{n}", _set(grid=[n, 1]), "IndexFileError", "slice")
            add("grid-negative", _set(grid=[-2, 1]), "IndexFileError", "grid")
            add("grid-zero", _set(grid=[0, 1]), "IndexFileError", "grid")
            add(
                "grid-cells-past-file",
                _set(grid=[100_000, 1], file=0),
                "IndexFileError",
                "unickpt.tensors",
                verify="IndexFileError",
            )
            add(
                "grid-parts-million",
                _set(grid=[[0] * (many - 1) + [4], 1], file=0),
                "IndexFileError",
                "unickpt.tensors",
            )
            add("grid-parts-huge", _set(grid=[[2**62 - 1, 1], 1]), "IndexFileError", "grid")
            add("grid-nested", _set(grid=[[[1]] * 1000, 1]), "IndexFileError", "grid")
            # file ids: huge, negative, a million of them
            for n in huge:
                add(f"file-{n}", _set(file=n), "IndexFileError", "file")
            add("file-negative", _set(file=-1), "IndexFileError", "file")
            add("file-million", _set(file=[0] * many), "IndexFileError", "file")
            # boxes: a hundred thousand boxes in a 300-byte file, a huge box
            add(
                "boxes-many",
                _set(grid=None, boxes=[[0, 0, 0, 0]] * lots, file=0),
                "IndexFileError",
                "unickpt.tensors",
                verify="IndexFileError",
            )
            add("boxes-huge", _set(grid=None, boxes=[[0, 0, 2**62 - 1, 3]], file=0), "IndexFileError", "box")
            # keys and hashes: a million of them, a megabyte-long one
            add("keys-million", _set(keys=["k"] * many), "IndexFileError", "keys")
            add("keys-long", _set(keys=["k" * many, "w@1"]), "ok", None, verify="HeaderError")
            hexs = "0" * 16 if v < 5 else "A" * 11
            add("xxh3-long", _set(xxh3=hexs * (many // 16)), "IndexFileError", "xxh3")
            # the block's file table: a hundred thousand names (slice K in files[K])
            add(
                "files-many",
                lambda obj: obj["unickpt"].update(files=[f"f{i:06d}.safetensors" for i in range(lots)]),
                "IndexFileError",
                "slice",
            )
        else:
            add(
                "slices-million-offsets",
                lambda obj: _w(obj)["slices"][0].update(offsets=[0] * many),
                "IndexFileError",
                "offsets",
            )
            add(
                "slices-many",
                lambda obj: _w(obj).update(slices=_w(obj)["slices"] * lots),
                "IndexFileError",
                None,
                verify="IndexFileError",
            )
            add(
                "slices-huge-offsets",
                lambda obj: _w(obj)["slices"][0].update(offsets=[2**62 - 1, 0]),
                "IndexFileError",
                "w",
            )
        # the block and the Hugging Face keys
        for n in huge:
            add(
                f"total-size-{n}",
                lambda obj, n=n: obj["metadata"].update(total_size=n),
                "ok",
                None,
                verify="IndexFileError",
            )
            add(
                f"world-size-{n}",
                lambda obj, n=n: obj["unickpt"]["layout"].update(world_size=n),
                "ok",
                None,
                verify="ok",
            )
            add(
                f"version-{n}",
                lambda obj, n=n: obj["unickpt"].update(format_version=n),
                "IndexFileError",
                "format_version",
            )
        add(
            "total-size-negative",
            lambda obj: obj["metadata"].update(total_size=-1),
            "IndexFileError",
            "total_size",
        )
        add(
            "name-long",
            lambda obj: _rename(obj, "w" * many),
            "ok",
            None,
            verify="HeaderError" if compact else "ok",
        )
        add(
            "tensors-many",
            lambda obj: _many_tensors(obj, lots),
            "IndexFileError",
            "unickpt.tensors",
            verify="IndexFileError",
        )
        add(
            "aliases-many",
            lambda obj: obj["unickpt"].update(aliases={f"a{i}": "x" for i in range(lots)}),
            "IndexFileError",
            "alias",
        )
        add(
            "param-state-deep",
            lambda obj: obj["unickpt"].update(param_state={"p": _deep(500)}),
            "IndexFileError",
            None,
        )
        add(
            "created-by-long",
            lambda obj: obj["unickpt"].update(created_by="c" * many),
            "ok",
            None,
            verify="ok",
        )
    return out


def _rename(obj: dict[str, Any], new: str) -> None:
    t = obj["unickpt"]["tensors"]
    t[new] = t.pop("w")
    obj["weight_map"][new] = obj["weight_map"].pop("w")


def _many_tensors(obj: dict[str, Any], n: int) -> None:
    tensors = obj["unickpt"]["tensors"]
    compact = "files" in obj["unickpt"]
    sentinel = next(iter(obj["weight_map"].values()))
    for i in range(n):
        if compact:
            tensors[f"t{i}"] = {"shape": [], "file": 0}
        else:
            tensors[f"t{i}"] = {
                "dtype": "U8",
                "shape": [],
                "slices": [{"file": FILES[0], "key": f"t{i}", "offsets": [], "shape": []}],
            }
        obj["weight_map"][f"t{i}"] = sentinel
    obj["unickpt"]["dtype"] = "U8"
    for name in ("w", "n"):
        tensors[name]["dtype"] = {"w": "F32", "n": "I64"}[name]


def _deep(n: int) -> Any:
    v: Any = 0
    for _ in range(n):
        v = [v]
    return v


# ------------------------------------------------------------------ safetensors headers


def single_cases() -> list[Case]:
    """Single-file checkpoints: the header length, entries, shapes and offsets, and the unickpt
    block of the header metadata (its own counts)."""

    def single(
        header: dict[str, Any] | None, data: bytes = b"", length: int | None = None, raw: bytes | None = None
    ) -> Callable[[Path], Path]:
        def build(d: Path) -> Path:
            d.mkdir(parents=True, exist_ok=True)
            p = d / "model.safetensors"
            body = raw if raw is not None else st(header or {}, data, length)
            p.write_bytes(body)
            return p

        return build

    def block(tensors: dict[str, Any], **extra: Any) -> str:
        b = {
            "format_version": 5,
            "kind": "model",
            "files": ["model.safetensors"],
            "tensors": tensors,
            **extra,
        }
        return json.dumps(b)

    w = {"dtype": "F32", "shape": [2, 3], "file": 0, "keys": ["w"]}
    good = {"w": ent("F32", [2, 3], 0, 24)}

    def with_block(tensors: dict[str, Any]) -> dict[str, Any]:
        return {"__metadata__": {"format": "pt", "unickpt": block(tensors)}, **good}

    out = [
        Case("single-control", "single", single(with_block({"w": w}), bytes(24)), "ok", None),
        Case("single-header-2^63", "single", single({}, length=2**63 + 5), "HeaderError", "header length"),
        Case("single-header-2^62", "single", single({}, length=2**62), "HeaderError", "header length"),
        Case(
            "single-header-past-eof", "single", single({}, length=99_999_992), "HeaderError", "header length"
        ),
        Case(
            "single-shape-2^62",
            "single",
            single({"a": ent("F32", [2**62], 0, 8)}, bytes(8)),
            "HeaderError",
            "shape",
        ),
        Case(
            "single-shape-ndim",
            "single",
            single({"a": ent("F32", [1] * 10**5, 0, 4)}, bytes(4)),
            "HeaderError",
            "shape",
        ),
        Case(
            "single-offsets-2^62",
            "single",
            single({"a": ent("F32", [2], 0, 2**62)}, bytes(8)),
            "HeaderError",
            "a",
        ),
        Case(
            "single-offsets-negative",
            "single",
            single({"a": ent("F32", [2], -8, 0)}, bytes(8)),
            "HeaderError",
            "a",
        ),
        Case(
            "single-entries-500",
            "single",
            single({f"t{i}": ent("U8", [0], 0, 0) for i in range(500)}),
            "ok",
            None,
        ),
        Case("single-name-long", "single", single({"n" * 10**6: ent("U8", [8], 0, 8)}, bytes(8)), "ok", None),
        Case(
            "single-metadata-long",
            "single",
            single({"__metadata__": {"x": "m" * 10**6}, **good}, bytes(24)),
            "ok",
            None,
        ),
    ]
    for n in HUGE:
        out += [
            Case(
                f"single-block-grid-{n}",
                "single",
                single(with_block({"w": {**w, "grid": [n, 1], "keys": None}}), bytes(24)),
                "IndexFileError",
                "grid",
            ),
            Case(
                f"single-block-shape-{n}",
                "single",
                single(with_block({"w": {**w, "shape": [n, 3]}}), bytes(24)),
                "IndexFileError",
                "shape",
            ),
            Case(
                f"single-block-file-{n}",
                "single",
                single(with_block({"w": {**w, "file": n}}), bytes(24)),
                "IndexFileError",
                "file",
            ),
        ]
    out.append(
        Case(
            "single-block-grid-past-file",
            "single",
            single(with_block({"w": {**w, "grid": [1000, 1], "keys": None}}), bytes(24)),
            "IndexFileError",
            "slices",
        )
    )
    out.append(
        Case(
            "single-block-boxes-many",
            "single",
            single(with_block({"w": {**w, "boxes": [[0, 0, 0, 0]] * 50_000, "keys": None}}), bytes(24)),
            "IndexFileError",
            "slices",
        )
    )
    return out


def data_cases() -> list[Case]:
    """Data files of the base checkpoint whose headers lie about their counts."""

    def data(file0: bytes) -> Callable[[Path], Path]:
        def build(d: Path) -> Path:
            return write_checkpoint(d, base_index(4), {FILES[0]: file0, FILES[1]: FILE1})

        return build

    many = {
        "__metadata__": META,
        **{f"x{i}": ent("U8", [0], 0, 0) for i in range(5_000)},
        "w@0": ent("F32", [2, 3], 0, 24),
        "n@0": ent("I64", [4], 24, 56),
    }
    return [
        Case(
            "data-header-2^63",
            "data",
            data(st({}, bytes(400), length=2**63 + 5)),
            "HeaderError",
            "header length",
        ),
        Case(
            "data-header-2^62", "data", data(st({}, bytes(400), length=2**62)), "HeaderError", "header length"
        ),
        Case(
            "data-header-past-eof",
            "data",
            data(st({}, bytes(400), length=99_999_992)),
            "HeaderError",
            "header length",
        ),
        Case("data-entries-5k", "data", data(st(many, bytes(56))), "IndexFileError", "no slice"),
        Case(
            "data-shape-2^62",
            "data",
            data(
                st(
                    {
                        "__metadata__": META,
                        "w@0": ent("F32", [2**62, 3], 0, 24),
                        "n@0": ent("I64", [4], 24, 56),
                    },
                    bytes(56),
                )
            ),
            "HeaderError",
            "shape",
        ),
        Case(
            "data-offsets-2^62",
            "data",
            data(
                st(
                    {
                        "__metadata__": META,
                        "w@0": ent("F32", [2, 3], 0, 2**62),
                        "n@0": ent("I64", [4], 24, 56),
                    },
                    bytes(56),
                )
            ),
            "HeaderError",
            "w@0",
        ),
        Case(
            "data-key-long",
            "data",
            data(
                st(
                    {
                        "__metadata__": META,
                        "w@0" + "k" * 10**6: ent("F32", [2, 3], 0, 24),
                        "n@0": ent("I64", [4], 24, 56),
                    },
                    bytes(56),
                )
            ),
            "HeaderError",
            "w@0",
        ),
    ]


# ------------------------------------------------------------------ run records


def _run(d: Path, latest: bytes | None = None, commit: bytes | None = None) -> Path:
    step = d / "step-5"
    (step / "model").mkdir(parents=True, exist_ok=True)
    write_checkpoint(step / "model", base_index(5))
    (step / "COMMIT").write_bytes(
        commit if commit is not None else json.dumps({"step": 5, "world_size": 1}).encode()
    )
    (d / "latest").write_bytes(latest if latest is not None else b'{"step": 5}')
    return d


def run_cases() -> list[Case]:
    out: list[Case] = []
    for label, raw in [
        ("1e30", b'{"step": 1000000000000000000000000000000}'),
        ("2^63", json.dumps({"step": 2**63}).encode()),
        ("negative", b'{"step": -5}'),
        ("infinity", b'{"step": Infinity}'),
        ("float", b'{"step": 5.0}'),
        ("string", b'{"step": "5"}'),
        ("true", b'{"step": true}'),
        ("digits-5000", b'{"step": ' + b"9" * 5000 + b"}"),
        ("deep", b'{"step": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("long-string", b'{"step": "' + b"5" * 10**6 + b'"}'),
        ("entries-million", json.dumps({f"k{i}": i for i in range(10**6)}).encode()),
        ("over-limit", b'{"step": 5, "pad": "' + b" " * (2 << 20) + b'"}'),
    ]:
        out.append(Case(f"latest-{label}", "latest", lambda d, raw=raw: _run(d, latest=raw), "ok", None))
    for label, raw in [
        ("world-1e12", json.dumps({"step": 5, "world_size": 10**12}).encode()),
        ("world-2^62", json.dumps({"step": 5, "world_size": 2**62}).encode()),
        ("world-negative", json.dumps({"step": 5, "world_size": -3}).encode()),
        ("deep", b"[" * 100_000 + b"]" * 100_000),
        ("over-limit", b'{"step": 5, "pad": "' + b" " * (2 << 20) + b'"}'),
        (
            "xxh3-million",
            json.dumps(
                {"step": 5, "world_size": 1, "xxh3": {f"f{i}.json": "0" * 16 for i in range(10**5)}}
            ).encode(),
        ),
    ]:
        out.append(Case(f"commit-{label}", "commit", lambda d, raw=raw: _run(d, commit=raw), "ok", None))
    return out


def hashes_cases() -> list[tuple[str, Callable[[], bytes], str]]:
    """(name, a rank's hashes file (built when called), a part of the failure reading it gives)."""
    return [
        (
            "entries-million",
            lambda: json.dumps(
                {"unickpt_hashes": 1, "xxh3": {f"f{i}": "0" * 16 for i in range(10**5)}}
            ).encode(),
            "lists 100000 paths",
        ),
        (
            "deep",
            lambda: b'{"unickpt_hashes": 1, "xxh3": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "nested",
        ),
        (
            "over-limit",
            lambda: b'{"unickpt_hashes": 1, "pad": "' + b" " * (65 << 20) + b'"}',
            "bytes allowed",
        ),
        (
            "long-path",
            lambda: json.dumps({"unickpt_hashes": 1, "xxh3": {"p" * 10**6: "0" * 16}}).encode(),
            "not a path inside the step",  # no plain name is 10^6 characters long
        ),
    ]


def train_state_cases() -> list[tuple[str, Callable[[dict[str, Any]], Any], str]]:
    """(name, an edit of a rank's train-state JSON object (returns the new object or bytes), the
    field the refusal names)."""

    def set_(field: str, v: Any) -> Callable[[dict[str, Any]], Any]:
        def edit(js: dict[str, Any]) -> Any:
            js[field] = v
            return js

        return edit

    def rng(path: str, v: Any) -> Callable[[dict[str, Any]], Any]:
        def edit(js: dict[str, Any]) -> Any:
            a, b = path.split(".")
            js["rng"][a][b] = v
            return js

        return edit

    out: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = []
    for field in ("world_size", "step", "rank"):
        for label, v in [
            ("1e30", 10**30),
            ("negative", -1),
            ("string", "4"),
            ("float", 4.0),
            ("true", True),
            ("list", [1] * 1000),
        ]:
            out.append((f"{field}-{label}", set_(field, v), field))
    out += [
        (
            "deep",
            lambda js: b'{"unickpt_train_state": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "nested",
        ),
        (
            "over-limit",
            lambda js: b'{"unickpt_train_state": 1, "pad": "' + b" " * (65 << 20) + b'"}',
            "bytes allowed",
        ),
        ("rng-python-million", rng("python.state", [0] * 10**6), "rng"),
        ("rng-numpy-million", rng("numpy.keys", [0] * 10**6), "rng"),
        ("rng-numpy-huge-word", rng("numpy.keys", [2**40] * 624), "rng"),
        ("rng-python-string", rng("python.state", "0" * 10**6), "rng"),
        ("rng-cuda-1e12", lambda js: {**js, "rng": {**js["rng"], "cuda_devices": 10**12}}, "ok"),
    ]
    return out


def count_all(big: bool = False) -> dict[str, int]:
    return {
        "index": len(index_cases(big)),
        "single": len(single_cases()),
        "data": len(data_cases()),
        "run": len(run_cases()),
        "hashes": len(hashes_cases()),
        "train_state": len(train_state_cases()),
    }


if __name__ == "__main__":  # pragma: no cover - prints the case counts
    print(json.dumps(count_all(bool(os.environ.get("UNICKPT_FUZZ_EXAMPLES"))), indent=1))
